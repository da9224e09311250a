"""Moving tensors between ranks: the communicator (process groups, agreement, fail-fast),
the communications of a program, pipelined transports (collective, ring, copy engine),
symmetric memory, partial sums, UCX point-to-point transfers.
"""

from overlap.comm.communicator import Communicator, PeerError

__all__ = ["Communicator", "PeerError"]

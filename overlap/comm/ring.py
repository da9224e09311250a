"""The ring transport's steps: each a batch of a send to the ring's successor and a
receive from its predecessor.

Iteration ``i`` of a ring loop receives from the predecessor the chunk that the
predecessor had at iteration ``i - k`` (``k`` chunks a rank), and sends to the successor
the chunk this rank had at iteration ``i - k``: one ``batch_isend_irecv`` (one NCCL group)
a step, which every rank of the ring posts at the same iteration
(``overlap.comm.pipelined`` says what moves). Unbatched, NCCL runs a process group's sends
and receives one after another on one stream (on two ranks both neighbours are one peer;
in eager initialization, every peer): a rank's send posted before its receive waits for
a receive that its peer queued behind its own send, for ever once the send outgrows
NCCL's buffers. Batched, the send and the receive of a step run together on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from overlap.ir import Communicate


class RingSteps:
    """The ring's steps on one rank: what it sends at a step, handed on by an earlier
    iteration, and what it sent, kept to the loop's end.

    On CUDA a value is handed on with an event recorded where it was written (another
    iteration's stream): the step's stream waits for it before posting, so NCCL's stream,
    which waits for the posting stream, reads the value written. The values sent stay
    referenced until the loop's end (``clear``): a value written on one iteration's
    stream is sent on another's, so its memory goes back to the writer's stream, which
    is ordered after the transfer only once the user's stream has waited for every
    stream of the loop.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        # by communication and the iteration that sends it: a value and its event
        self.handed_on: dict[tuple[Communicate, int], tuple[torch.Tensor, object]] = {}
        self.sent: list[torch.Tensor] = []

    def hand_on(self, key: tuple[Communicate, int], value: torch.Tensor) -> None:
        """Keep ``value`` (just written on the current stream) for the step of ``key``:
        the communication and the iteration that sends it."""
        written = None
        if self.cuda:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(self.device))
        self.handed_on[key] = (value, written)

    def step(self, key: tuple[Communicate, int], successor: int, received: torch.Tensor,
             predecessor: int, group) -> list:  # fmt: skip
        """Post the step of ``key``: its handed-on value to ``successor``, ``received``
        from ``predecessor`` (global ranks, as ``group`` names them), as one batch;
        returns its works."""
        value, written = self.handed_on.pop(key)
        if written is not None:
            torch.cuda.current_stream(self.device).wait_event(written)
        self.sent.append(value)
        return dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, value, successor, group),
                dist.P2POp(dist.irecv, received, predecessor, group),
            ]
        )

    def clear(self) -> None:
        """Forget the loop's values (after it, or after a run that raised)."""
        self.handed_on.clear()
        self.sent.clear()

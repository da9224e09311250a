"""Host IR, lowering, the stream-lowering planner, the per-rank executor and communicators.

``MultiDeviceExecutor`` (``overlap.executor``) runs a fusion on this rank; the planner
(``overlap.planner``) decides where communication overlaps compute; ``Communicator``
(``overlap.communicator``) holds the process groups, ``overlap.ucx`` point-to-point
transfers over UCX. See docs/multidevice.md.
"""

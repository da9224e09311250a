"""Host IR, lowering, the stream-lowering planner, the per-rank executor and communicators.

Not built yet: see the multi-device and stream-lowering issues.
"""

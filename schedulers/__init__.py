"""Per-segment schedulers: heuristics, Triton code generation and the kernel cache.

Not built yet: see the schedulers issue. Builds on ``fusion`` and ``sharding``.
"""

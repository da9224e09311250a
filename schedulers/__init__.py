"""Per-segment schedulers: heuristics, Triton code generation and the kernel cache.

The registry (``schedulers.registry``) cuts compute segments into kernels for the
normalization, reduction and pointwise schedulers. Builds on ``fusion`` and
``sharding``. See docs/schedulers.md.
"""

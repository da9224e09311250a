"""Per-segment schedulers: heuristics, Triton code generation and the kernel cache.

The registry (``schedulers.registry``) cuts compute segments into kernels for the
normalization, reduction and pointwise schedulers, each an implementation of the
``Scheduler`` protocol of ``schedulers.base``. Shared pieces: ``analysis`` (how tensors
map into a kernel's iteration space), ``codegen`` (writing Triton source),
``runtime`` (launch-time helpers), ``cache`` (compiled kernels) and ``hardware``
(device profiles). Builds on ``fusion`` and ``sharding``. See docs/schedulers.md.
"""

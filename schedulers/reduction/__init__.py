"""The reduction scheduler: a sum, max, min or mean with pointwise ops before and after.

The reduction's input space S is cut into iteration axes (kept) and reduced axes,
which must be the innermost axes (an *inner*, row reduction) or the outermost ones (an
*outer*, column reduction). Pointwise ops before the reduction (the prologue) run on
each tile as it is loaded; ops after it (the epilogue) run on the reduced values.

- Inner: each program takes ``block_rows`` rows and walks their reduced extent in
  tiles of ``block_reduce``, accumulating in float32 (int64 for integer sums).
- Outer: the reduced extent is split over the grid so there are a few waves of
  programs even when few columns remain; each program writes float32 partial results
  and a second kernel combines them in a fixed order: deterministic. With
  ``deterministic=False`` (sums only) partial sums are added atomically instead.

``block_reduce`` depends on the reduced extent; nothing depends on the iteration
extent, so a new batch size reuses the kernel.

Modules: ``analysis`` (the plan), ``heuristics`` (``ReductionParams`` and the tiled
strategy), ``tma`` (the TMA strategy), ``codegen`` (the kernels' source) and
``scheduler`` (``ReductionScheduler`` and its launcher).
"""

from schedulers.reduction.analysis import ReductionPlan
from schedulers.reduction.heuristics import ReductionParams
from schedulers.reduction.scheduler import ReductionLauncher, ReductionScheduler
from schedulers.reduction.tma import TmaTile, tma_outer_tile

__all__ = [
    "ReductionLauncher",
    "ReductionParams",
    "ReductionPlan",
    "ReductionScheduler",
    "TmaTile",
    "tma_outer_tile",
]

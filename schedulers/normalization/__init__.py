"""The inner persistent (normalization) scheduler: softmax, LayerNorm and RMSNorm forward.

It takes a group of exprs with one or more reductions over the same innermost axes
whose results are used back along the rows: ``x - max(x)``, ``x * rsqrt(mean(x*x))``.
Every tensor of the group is one of four kinds, by the axes of the space S (the
reductions' input shape) it runs along:

- *full*: rows and reduced columns (``x``, the output ``y``);
- *row*: the kept axes only (``mean``, ``rstd``; row outputs such as a saved mean);
- *column*: the reduced axes only (a LayerNorm ``weight``);
- *scalar*: neither.

Each program takes ``block_rows`` rows. When the row fits in registers
(``persistent``) the kernel loads every input once and runs straight through: each
reduction, the row values that follow from it, then the outputs. When it does not, the
kernel walks the row in steps of ``block_columns`` once per level of reductions (a
reduction whose input needs another's result is one level deeper) and once more for
the outputs, re-reading its inputs (from L2, mostly): Triton has no explicit
shared-memory buffer to stage a row in.

The reduced extent is a ``tl.constexpr`` (``COLUMNS``): a kernel is specialised on it
(a symbolic reduced extent cost 32 % in a measured Triton RMSNorm), never on the
number of rows, so a new batch size reuses it. Reductions accumulate in float32
(float64 for float64) and round once to their dtype, as the reference does.

Modules: ``analysis`` (the plan: each tensor's kind, the reductions' levels),
``heuristics`` (``NormalizationParams`` and the multi-wave strategy),
``warp_specialized`` (the warp-specialized strategy), ``split`` (the split strategy: a
row over programs), ``codegen`` (the kernels' source), ``exchange`` (a split row's
exchange of partial reductions, through global memory or a cluster's shared memory),
``combine`` (the kernel adding partial column sums), ``column_sums`` (the column walk:
the rows' values first, then strips walked down the rows) and ``scheduler``
(``NormalizationScheduler``: the choice between the strategies, and its launcher).
"""

from schedulers.normalization.analysis import NormalizationPlan
from schedulers.normalization.heuristics import (
    COLUMN_WALK,
    MULTIWAVE,
    SPLIT,
    STRATEGIES,
    WARP_SPECIALIZED,
    NormalizationParams,
)
from schedulers.normalization.scheduler import NormalizationLauncher, NormalizationScheduler
from schedulers.normalization.warp_specialized import WS_GAINS

__all__ = [
    "COLUMN_WALK",
    "MULTIWAVE",
    "SPLIT",
    "STRATEGIES",
    "WARP_SPECIALIZED",
    "WS_GAINS",
    "NormalizationLauncher",
    "NormalizationParams",
    "NormalizationPlan",
    "NormalizationScheduler",
]

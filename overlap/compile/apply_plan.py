"""Applying an overlap plan: the rows each chosen pipeline cuts become ``Stream`` axes.

The planner (``overlap.plan.planner.plan_overlap``) only decides; this pass writes its choices
into the fusion's IR, as parallel types: the contraction's output rows and the
communication's output along its split axis become ``Stream`` axes of the chosen chunk
count, and so do the rows of the other exprs the pipeline runs chunk by chunk (the
gathered rows' other matmuls). Stream lowering
(``overlap.compile.lowering``) then turns them into chunk loops, and takes
each communication's transport and chunk order from the same plan.
"""

from __future__ import annotations

from overlap.plan.cost_model import Pattern
from overlap.plan.planner import OverlapPlan


def apply_overlap_plan(plan: OverlapPlan) -> None:
    """Mark the rows of every pipelined pattern of ``plan`` as a Stream axis."""
    for decision in plan:
        if not decision.overlapped:
            continue
        chunks = decision.chosen.num_chunks
        decision.contraction.outputs[0].axis(decision.row).stream(chunks)
        for expr, row in decision.chunked:
            expr.outputs[0].axis(row).stream(chunks)
        comm = decision.communication
        gathered = decision.pattern is Pattern.ALLGATHER_MATMUL
        comm.output.axis(comm.in_dim if gathered else comm.out_dim).stream(chunks)

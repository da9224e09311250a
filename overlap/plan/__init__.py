"""Deciding the overlap: the planner, its cost model, the device figures it reads, and the
roof meter that holds a run's timeline against the plan.

Decides and measures; changes no IR and talks to no rank (never imports ``runtime`` or
``comm``).
"""

from overlap.plan.figures import HardwareFigures
from overlap.plan.planner import OverlapOptions, OverlapPlan, plan_overlap

__all__ = [
    "HardwareFigures",
    "OverlapOptions",
    "OverlapPlan",
    "plan_overlap",
]

"""Deciding the overlap: the planner, its cost model, the device figures it reads (the
host's cost of each kind of step among them), and the roof meter that holds a run's
timeline against the plan.

Decides and measures; changes no IR and talks to no rank (never imports ``runtime`` or
``comm``).
"""

from overlap.plan.figures import HardwareFigures, HostFigures
from overlap.plan.host_steps import HostStep
from overlap.plan.planner import OverlapOptions, OverlapPlan, plan_overlap

__all__ = [
    "HardwareFigures",
    "HostFigures",
    "HostStep",
    "OverlapOptions",
    "OverlapPlan",
    "plan_overlap",
]

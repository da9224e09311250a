"""Training: the placed backward of a fusion, ``TrainableFusion`` (a fusion as a
differentiable PyTorch callable) and ``parallelize`` (a PyTorch module in, by a
tensor-parallel plan), and checkpoints of a training job (``Checkpointer``: DCP,
asynchronous, resumed after a restart).
"""

from overlap.train.checkpoint import (
    Checkpointer,
    TrainingPosition,
    latest_checkpoint,
    load_checkpoint,
    resume_or_start,
    save_checkpoint,
)
from overlap.train.parallelize import ParallelModule, parallelize
from overlap.train.trainable import TrainableFusion

__all__ = [
    "Checkpointer",
    "ParallelModule",
    "TrainableFusion",
    "TrainingPosition",
    "latest_checkpoint",
    "load_checkpoint",
    "parallelize",
    "resume_or_start",
    "save_checkpoint",
]

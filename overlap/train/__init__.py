"""Training: the placed backward of a fusion, ``TrainableFusion`` (a fusion as a
differentiable PyTorch callable) and ``parallelize`` (a PyTorch module in, by a
tensor-parallel plan).
"""

from overlap.train.parallelize import ParallelModule, parallelize
from overlap.train.trainable import TrainableFusion

__all__ = ["ParallelModule", "TrainableFusion", "parallelize"]

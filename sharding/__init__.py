"""Device meshes, layouts, sharding propagation, resharding and segmentation.

Example::

    from sharding import DeviceMesh, Shard, Replicate, shard, shard_fusion

    mesh = DeviceMesh([0, 1])
    shard(x, mesh, [Shard(0)])          # annotate a few tensors of a fusion
    sharded, decisions = shard_fusion(fd.fusion)
    print(explain(sharded, decisions))  # which rule placed each tensor
    print(sharded)                      # with the communications inserted
"""

from sharding.annotate import pin, replicate, shard
from sharding.communication import Communication, CommunicationKind, LocalShard
from sharding.errors import ShardingError
from sharding.layout import (
    Layout,
    Partial,
    Placement,
    Replicate,
    Shard,
    layout_of,
    local_shape,
    split_range,
    split_sizes,
)
from sharding.mesh import DeviceMesh
from sharding.pieces import assemble, local_piece
from sharding.propagation import Decision, explain, propagate_shardings
from sharding.resharding import insert_reshardings, shard_fusion
from sharding.segmentation import Segment, segment_fusion

__all__ = [
    "Communication", "CommunicationKind", "Decision", "DeviceMesh", "Layout", "LocalShard",
    "Partial", "Placement", "Replicate", "Segment", "Shard", "ShardingError", "assemble",
    "explain", "insert_reshardings", "layout_of", "local_piece", "local_shape",
    "pin", "propagate_shardings", "replicate",
    "segment_fusion", "shard", "shard_fusion", "split_range", "split_sizes",
]  # fmt: skip

"""``MultiDeviceExecutor``: runs a sharded fusion's host program on this rank.

Construction (the same on every rank, no communication until the last step):
place every tensor and insert the communications (``sharding.shard_fusion``),
segment, lower to a host program, refuse meshes larger than the world, then
create the process groups the program needs (collectively).

``run(local_inputs)`` first checks every rank's inputs against the fusion:
the ranks exchange their inputs' shapes and dtypes (one small all-gather) and
each rank checks all of them, so a bad input on any rank raises the same
``InputError`` on every rank, before any communication of the program starts.
Then it runs the program: compute segments with the reference evaluator on
local pieces, communications through torch.distributed.

Example (on every rank)::

    executor = MultiDeviceExecutor(fd, Communicator())
    outputs = executor.run(executor.shard_inputs(full_inputs))
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusion.definition import FusionDefinition
from fusion.dtypes import float4_e2m1
from fusion.errors import InputError
from fusion.exprs import Expr
from fusion.fp4 import pack_fp4, unpack_fp4
from fusion.ir import ExtentConstraint, Fusion, Symbol, TensorView
from fusion.reference import Bindings, evaluate_expr, resolve
from overlap.communications import Pending, RankContext, start
from overlap.communicator import Communicator
from overlap.host_ir import (
    Allocate,
    Communicate,
    Deallocate,
    HostProgram,
    LaunchKernel,
    Wait,
)
from overlap.lowering import lower_to_host_program
from sharding.communication import LocalShard
from sharding.errors import ShardingError
from sharding.layout import Layout, Shard, layout_of, local_shape, split_range
from sharding.propagation import explain
from sharding.resharding import shard_fusion
from sharding.segmentation import segment_fusion


class MultiDeviceExecutor:
    """Runs ``fusion`` on this rank as part of every rank running it."""

    def __init__(self, fusion: Fusion | FusionDefinition, communicator: Communicator) -> None:
        fusion = fusion.fusion if isinstance(fusion, FusionDefinition) else fusion
        if not fusion.finalized:
            raise ShardingError("finish the fusion definition (leave its `with` block) first")
        self.communicator = communicator
        self.rank = communicator.rank
        self.fusion, self.decisions = shard_fusion(fusion)
        self._check_meshes_fit_the_world()
        self.segments = segment_fusion(self.fusion)
        self.program: HostProgram = lower_to_host_program(self.fusion, self.segments)
        communicator.prepare(team for c in self.program.communications for team in c.teams())

    def _check_meshes_fit_the_world(self) -> None:
        world = self.communicator.world_size
        for tensor in self.fusion.tensors:
            too_large = [r for r in tensor.mesh.ranks if r >= world]
            if too_large:
                raise ShardingError(
                    f"{tensor} is placed on {tensor.mesh}, but the world has {world} ranks "
                    f"(0..{world - 1}); rank {too_large[0]} does not exist"
                )

    # -----------------------------------------------------------------------
    # What users and tests need around a run

    def explain(self) -> str:
        """Which rule placed each tensor (see ``sharding.explain``)."""
        return explain(self.fusion, self.decisions)

    @property
    def communications(self) -> list:
        return self.program.communications

    def input_layouts(self) -> list[Layout]:
        return [layout_of(t) for t in self.fusion.inputs]

    def output_layouts(self) -> list[Layout]:
        return [layout_of(t) for t in self.fusion.outputs]

    def shard_inputs(self, full_inputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole inputs (None where an input is not on this rank)."""
        return [
            local_piece(value, tensor, self.rank)
            for value, tensor in zip(full_inputs, self.fusion.inputs, strict=True)
        ]

    def shard_outputs(self, full_outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """This rank's pieces of whole outputs: what ``run`` should return here."""
        return [
            local_piece(value, tensor, self.rank)
            for value, tensor in zip(full_outputs, self.fusion.outputs, strict=True)
        ]

    def gather_outputs(self, local_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The whole outputs, assembled from every rank's pieces (collective: call on all ranks).

        Pieces travel through ``all_gather_object`` (host memory): meant for checking and
        small results, not for the hot path.
        """
        cpu = [None if t is None else t.cpu() for t in local_outputs]
        everyone = self.communicator.all_gather_object(cpu)
        return [
            assemble({rank: pieces[position] for rank, pieces in enumerate(everyone)}, tensor)
            for position, tensor in enumerate(self.fusion.outputs)
        ]

    # -----------------------------------------------------------------------
    # Running

    def run(self, local_inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Run the program on this rank; returns this rank's output pieces (None off-mesh)."""
        bindings = self._check_inputs(local_inputs)
        ctx = RankContext(
            self.rank,
            self.communicator,
            lambda t: [resolve(e, bindings) for e in t.shape],
            lambda t: self._local_shape(t, bindings),
            _storage_dtype,
        )
        values: dict[TensorView, torch.Tensor] = {}
        for tensor, value in zip(self.fusion.inputs, local_inputs, strict=True):
            if self.rank in tensor.mesh:
                values[tensor] = unpack_fp4(value) if tensor.dtype is float4_e2m1 else value
        pending: dict[Communicate, Pending] = {}
        for instruction in self.program.instructions:
            if isinstance(instruction, LaunchKernel):
                if self.rank in instruction.segment.mesh:
                    for expr in instruction.segment.exprs:
                        self._compute(expr, values, ctx)
            elif isinstance(instruction, Communicate):
                comm = instruction.communication
                if self.rank in comm.participants():
                    pending[instruction] = start(comm, values.get(comm.inputs[0]), ctx)
            elif isinstance(instruction, Wait):
                if instruction.communicate in pending:
                    result = pending.pop(instruction.communicate).wait()
                    if result is not None:
                        values[instruction.communicate.communication.output] = result
            elif isinstance(instruction, Deallocate):
                values.pop(instruction.tensor, None)
            elif not isinstance(instruction, Allocate):  # buffers are allocated by `start`
                raise NotImplementedError(type(instruction).__name__)
        outputs: list[torch.Tensor | None] = []
        for tensor in self.fusion.outputs:
            if self.rank not in tensor.mesh:
                outputs.append(None)
                continue
            value = values[tensor]
            outputs.append(pack_fp4(value) if tensor.dtype is float4_e2m1 else value.contiguous())
        return outputs

    def _compute(self, expr: Expr, values: dict, ctx: RankContext) -> None:
        if isinstance(expr, LocalShard):
            (source,) = expr.inputs
            coordinate = expr.mesh.coords(self.rank)[expr.mesh_axis]
            parts = expr.mesh.shape[expr.mesh_axis]
            extent = values[source].shape[expr.dim]
            offset, size = split_range(extent, parts, coordinate)
            values[expr.output] = values[source].narrow(expr.dim, offset, size).contiguous()
            return
        evaluate_expr(expr, values, ctx.local_shape)

    def _local_shape(self, tensor: TensorView, bindings: Bindings) -> list[int]:
        shape = [resolve(e, bindings) for e in tensor.shape]
        return local_shape(layout_of(tensor), self.rank, shape)

    # -----------------------------------------------------------------------
    # Input checks, the same verdict on every rank

    def _check_inputs(self, local_inputs: Sequence[torch.Tensor | None]) -> Bindings:
        try:
            described = _describe_inputs(local_inputs, len(self.fusion.inputs))
        except InputError as error:
            described = str(error)
        everyone = self.communicator.all_gather_object(described)
        for rank, description in enumerate(everyone):
            if isinstance(description, str):
                raise InputError(f"rank {rank}: {description}")
        return check_local_inputs(self.fusion, everyone)


def _storage_dtype(tensor: TensorView) -> torch.dtype:
    """The torch dtype of a tensor as a rank holds it between ops (fp4: one byte per value)."""
    return torch.uint8 if tensor.dtype is float4_e2m1 else tensor.dtype.torch_dtype


def _describe_inputs(
    local_inputs: Sequence[torch.Tensor | None], count: int
) -> list[tuple[list[int], str] | None]:
    if not isinstance(local_inputs, (list, tuple)):
        raise InputError(f"local inputs must be a list, got {type(local_inputs).__name__}")
    if len(local_inputs) != count:
        raise InputError(f"the fusion takes {count} inputs, got {len(local_inputs)}")
    described = []
    for position, value in enumerate(local_inputs):
        if value is None:
            described.append(None)
        elif isinstance(value, torch.Tensor):
            described.append((list(value.shape), str(value.dtype)))
        else:
            raise InputError(
                f"input {position}: expected a torch.Tensor or None, got {type(value).__name__}"
            )
    return described


def check_local_inputs(fusion: Fusion, everyone: list[list]) -> Bindings:
    """Check every rank's described inputs (shape, dtype per input) and bind the symbols.

    A symbolic extent split over a mesh axis is the sum of the pieces along that axis.
    Raises ``InputError`` naming the rank, the input and the mismatch.
    """
    bindings: Bindings = {}
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        where = f"input {position} ({tensor})"
        expected_dtype = str(tensor.dtype.torch_dtype)
        shapes: dict[int, list[int]] = {}
        for rank in tensor.mesh.ranks:
            entry = everyone[rank][position]
            if entry is None:
                raise InputError(f"rank {rank}: {where} is on this rank but got None")
            shape, dtype = entry
            if dtype != expected_dtype:
                raise InputError(
                    f"rank {rank}: {where}: expected dtype {expected_dtype}, got {dtype}"
                )
            if len(shape) != tensor.ndim:
                raise InputError(
                    f"rank {rank}: {where}: expected rank {tensor.ndim}, got shape {shape}"
                )
            if tensor.dtype.is_packed:
                shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
            shapes[rank] = shape
        _bind_symbols(tensor, layout, shapes, bindings, where)
    for constraint in fusion.constraints:
        _check_constraint(constraint, bindings)
    for position, tensor in enumerate(fusion.inputs):
        layout = layout_of(tensor)
        whole = [resolve(e, bindings) for e in tensor.shape]
        for rank in tensor.mesh.ranks:
            shape, _ = everyone[rank][position]
            if tensor.dtype.is_packed:
                shape = shape[:-1] + [shape[-1] * tensor.dtype.values_per_storage_element]
            expected = local_shape(layout, rank, whole)
            if list(shape) != expected:
                raise InputError(
                    f"rank {rank}: input {position} ({tensor}) placed {layout}: expected the "
                    f"local shape {expected} (of the whole {whole}), got {list(shape)}"
                )
    return bindings


def _bind_symbols(
    tensor: TensorView, layout: Layout, shapes: dict[int, list[int]], bindings: Bindings, where: str
) -> None:
    for dim, extent in enumerate(tensor.shape):
        if not isinstance(extent, Symbol):
            continue
        mesh_axis = layout.mesh_axis_of(dim)
        first = tensor.mesh.ranks[0]
        if mesh_axis is None:
            value = shapes[first][dim]
        else:
            value = sum(shapes[r][dim] for r in tensor.mesh.team(first, mesh_axis))
        if extent in bindings and bindings[extent] != value:
            raise InputError(
                f"{where}: axis {dim} is {value} in all, but symbol {extent} is already "
                f"{bindings[extent]}"
            )
        bindings[extent] = value


def _check_constraint(constraint: ExtentConstraint, bindings: Bindings) -> None:
    lhs, rhs = resolve(constraint.lhs, bindings), resolve(constraint.rhs, bindings)
    if not constraint.holds(lhs, rhs):
        raise InputError(
            f"extents violate {constraint.lhs} {constraint.relation} {constraint.rhs} "
            f"({lhs} vs {rhs}), required by {constraint.reason}"
        )


def local_piece(value: torch.Tensor, tensor: TensorView, rank: int) -> torch.Tensor | None:
    """``rank``'s piece of the whole ``value`` of ``tensor`` (None if not on ``rank``).

    fp4 values (``float4_e2m1fn_x2``) are split on values, not bytes.
    """
    layout = layout_of(tensor)
    if rank not in layout.mesh:
        return None
    packed = tensor.dtype is float4_e2m1
    piece = unpack_fp4(value) if packed else value
    coords = layout.mesh.coords(rank)
    for mesh_axis, placement in enumerate(layout.placements):
        if isinstance(placement, Shard):
            extent = piece.shape[placement.dim]
            offset, size = split_range(extent, layout.mesh.shape[mesh_axis], coords[mesh_axis])
            piece = piece.narrow(placement.dim, offset, size)
    return pack_fp4(piece) if packed else piece.contiguous()


def assemble(pieces: dict[int, torch.Tensor | None], tensor: TensorView) -> torch.Tensor:
    """The whole value of ``tensor`` from its pieces by rank (the inverse of ``local_piece``).

    Replicated copies must agree; the first rank's copy is kept.
    """
    layout = layout_of(tensor)
    mesh = layout.mesh
    packed = tensor.dtype is float4_e2m1

    def along(mesh_axis: int, fixed: dict[int, int]) -> torch.Tensor:
        """Concatenate over mesh axes from ``mesh_axis`` on, the others fixed at ``fixed``."""
        if mesh_axis == mesh.ndim:
            rank = mesh.rank_at([fixed[a] for a in range(mesh.ndim)])
            piece = pieces[rank]
            if piece is None:
                raise ValueError(f"rank {rank} holds a piece of {tensor} but gave None")
            return unpack_fp4(piece) if packed else piece
        placement = layout.placements[mesh_axis]
        if not isinstance(placement, Shard):
            return along(mesh_axis + 1, {**fixed, mesh_axis: 0})
        parts = [
            along(mesh_axis + 1, {**fixed, mesh_axis: coordinate})
            for coordinate in range(mesh.shape[mesh_axis])
        ]
        return torch.cat(parts, placement.dim)

    whole = along(0, {})
    return pack_fp4(whole) if packed else whole

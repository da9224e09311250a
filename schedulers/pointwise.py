"""The pointwise scheduler: chains of elementwise ops, casts and broadcasts in one kernel.

Every output has one shape S; the kernel walks S as a flat index, ``block`` elements
per program, and each input is read through its own broadcast pattern (neighbouring
axes of S that no input tells apart are merged, so few extents are divided by). The
vector width is 128 bits over the widest dtype's bits: 4 float32, 8 bf16, 16 fp8 and
32 fp4 values per access. fp4 outputs are written a pair of values per byte.

Extents are runtime arguments Triton does not specialize on: one kernel serves every
batch size.

A dropout mask (``DropoutMaskOp``) is drawn in the kernel from the seed (loaded once) and
each element's global row-major index in the whole tensor: ``index_base + sum over
groups of coordinate * index_stride``, the base and strides runtime arguments the
launcher works out from where the rank's piece (or a loop's chunk) starts
(``PointwiseLauncher.at``). They are arguments, not constants, so every rank (and every
chunk) launches the same compiled kernel. A group's global index is linear in its
coordinate when only its first axis may be cut (by ranks or into chunks): the plan
starts a group at every axis of the mask that is split over devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from fusion.dtypes import float4_e2m1
from fusion.exprs import DropoutMaskOp, Expr
from fusion.ir import TensorView
from schedulers.analysis import (
    POINTWISE,
    Collapsed,
    NotSchedulable,
    collapse,
    group_sizes,
    group_strides,
    map_into_space,
    unit_stride_group,
)
from schedulers.base import (
    BoundLaunch,
    KernelSource,
    Launcher,
    LocalShape,
    Scheduler,
    Shapes,
    check_strategy,
    launch_nothing,
)
from schedulers.cache import ALIGN_ELEMENTS, AlignedVariants, forms_used
from schedulers.codegen import (
    COMPILE_OPTIONS,
    Emitter,
    Value,
    check_supported,
    kernel_source,
    memory_type,
    pointer_types,
)
from schedulers.hardware import HardwareProfile
from schedulers.runtime import as_bytes, cdiv, next_power_of_two

VECTOR_BITS = 128


@dataclass(frozen=True)
class PointwiseParams:
    """Launch configuration of a pointwise kernel (override any field to tune it)."""

    vector_width: int  # elements per 128-bit access of the widest dtype
    unroll: int  # vectors per thread per tensor
    num_warps: int
    block_columns: int = 0  # tiled kernels: columns per tile (0: a flat kernel)

    @property
    def block(self) -> int:
        """Elements per program."""
        return self.vector_width * 32 * self.num_warps * self.unroll

    def __str__(self) -> str:
        tile = f", block_columns={self.block_columns}" if self.block_columns else ""
        return (
            f"PointwiseParams(vector_width={self.vector_width}, unroll={self.unroll}, "
            f"num_warps={self.num_warps}, block={self.block}{tile})"
        )


@dataclass
class PointwisePlan:
    """What the kernel computes; independent of extents."""

    exprs: list[Expr]
    inputs: list[TensorView]
    outputs: list[TensorView]
    mappings: dict[TensorView, tuple[int | None, ...]]
    collapsed: Collapsed
    rank: int
    masks: tuple[DropoutMaskOp, ...] = ()  # dropout masks drawn in the kernel
    seeds: frozenset[int] = frozenset()  # inputs only masks read: loaded once, as scalars

    @property
    def space(self) -> TensorView:
        """The outputs' shape is the iteration space."""
        return self.outputs[0]

    @property
    def widest_bits(self) -> int:
        """The widest dtype of what the kernel streams (a seed, one scalar, is not)."""
        streamed = [t for i, t in enumerate(self.inputs) if i not in self.seeds]
        return max(t.dtype.bits for t in streamed + self.outputs)

    @property
    def broadcast(self) -> list[int]:
        """The inputs that do not cover every group of axes."""
        return [i for i, present in enumerate(self.collapsed.present) if not all(present)]

    @property
    def tiled(self) -> bool:
        """Two groups of axes and a broadcast input: 2-D tiles avoid per-element division."""
        return len(self.collapsed.groups) == 2 and bool(self.broadcast)


class PointwiseScheduler(Scheduler[PointwisePlan, PointwiseParams]):
    """Takes chains of elementwise ops, casts and broadcasts whose outputs share a shape."""

    name = "pointwise"
    strategies: tuple[str, ...] = ()  # one way to build its kernel

    def plan(
        self, exprs: list[Expr], inputs: list[TensorView], outputs: list[TensorView]
    ) -> PointwisePlan:
        """Analyse ``exprs``; raises ``NotSchedulable`` with the reason if it cannot."""
        for expr in exprs:
            if not isinstance(expr, (*POINTWISE, DropoutMaskOp)):
                raise NotSchedulable(f"{expr.op_name} is not pointwise")
        check_supported(exprs)
        shape = outputs[0].shape
        for out in outputs[1:]:
            if out.shape != shape:
                raise NotSchedulable(f"outputs of different shapes: {outputs[0]}, {out}")
        identity = tuple(range(len(shape)))
        mappings = map_into_space(exprs, {out: identity for out in outputs})
        masks = tuple(expr for expr in exprs if isinstance(expr, DropoutMaskOp))
        starts: set[int] = set()
        for mask in masks:
            if mappings[mask.output] != identity or mask.output.shape != shape:
                raise NotSchedulable(f"dropout_mask {mask.output} is broadcast in the kernel")
            axes = mask.output.logical_axes
            starts.update(d for d, axis in enumerate(axes) if axis.parallel_type.is_device)
        collapsed = collapse(len(shape), [mappings[t] for t in inputs], frozenset(starts))
        seeds = frozenset(
            i
            for i, tensor in enumerate(inputs)
            if all(isinstance(use, DropoutMaskOp) for use in tensor.uses if use in exprs)
        )
        return PointwisePlan(exprs, inputs, outputs, mappings, collapsed, len(shape), masks, seeds)

    def heuristics(
        self,
        plan: PointwisePlan,
        hardware: HardwareProfile,
        shape: list[int],
        strategy: str | None = None,
    ) -> PointwiseParams:
        """Sizes in bits: a 128-bit vector of the widest dtype, four of them per thread.

        With an input broadcast over two groups of axes (``x * w[None, :]``), programs
        take 2-D tiles, as wide as the inner group (a power of two up to 1024, which
        depends on that extent only), so no element divides its index.
        """
        check_strategy(self, strategy)
        vector_width = VECTOR_BITS // plan.widest_bits
        # Measured on H200 (benchmarks/kernels.py --sweep): 4 warps of 4 vectors a thread
        # 0.86-0.93 of copy, 8 warps 0.83-0.91.
        params = PointwiseParams(vector_width=vector_width, unroll=4, num_warps=4)
        if plan.tiled:
            inner = group_sizes(plan.collapsed, shape)[1]
            columns = min(next_power_of_two(max(inner, 2)), 1024, params.block)
            params = replace(params, block_columns=columns)
        return params

    def kernels(
        self, plan: PointwisePlan, params: PointwiseParams, shape: list[int], aligned: bool = False
    ) -> list[KernelSource]:
        """The one kernel a launch runs (its source holds no extent: ``shape`` is not read)."""
        pointers = pointer_types(plan.inputs, plan.outputs)
        return [KernelSource("pointwise_kernel", source(plan, params, aligned),
                             constants(plan, params), params.num_warps, pointers)]  # fmt: skip

    def launcher(
        self,
        plan: PointwisePlan,
        params: PointwiseParams,
        hardware: HardwareProfile,
        local_shape: LocalShape,
    ) -> PointwiseLauncher:
        keywords = {**constants(plan, params), "num_warps": params.num_warps, **COMPILE_OPTIONS}
        variants = AlignedVariants(lambda aligned: source(plan, params, aligned),
                                   "pointwise_kernel", keywords)  # fmt: skip
        groups = len(plan.collapsed.groups)
        names = (
            ["numel"]
            + [f"size{g}" for g in range(groups)]
            + [f"stride{i}_{g}" for i in range(len(plan.inputs)) for g in range(groups)]
            + _index_arguments(plan)
        )
        return PointwiseLauncher(plan, params, variants, names, aligned_arguments(plan, params))


# -- code ------------------------------------------------------------------------------


def aligned_arguments(plan: PointwisePlan, params: PointwiseParams) -> list[str]:
    """The runtime arguments an ``aligned`` kernel knows are multiples of
    ``ALIGN_ELEMENTS``: the pitches from row to row and the extent the mask compares
    against (a mask that may change inside a vector forbids vector accesses too).
    Unit strides never appear in the source."""
    names = ["size1"] if plan.tiled and params.block_columns > 0 else ["numel"]
    for i, tensor in enumerate(plan.inputs):
        if i not in plan.broadcast:
            continue
        unit = unit_stride_group(plan.collapsed, plan.mappings[tensor])
        names += [
            f"stride{i}_{g}"
            for g, present in enumerate(plan.collapsed.present[i])
            if present and g != unit
        ]
    return names


def source(plan: PointwisePlan, params: PointwiseParams, aligned: bool = False) -> str:
    """The kernel's Triton source (the cache key: no extent appears in it).

    ``aligned``: every one of ``aligned_arguments`` is a multiple of
    ``ALIGN_ELEMENTS``. The kernel takes them divided by it and multiplies them back,
    so Triton can prove that rows start on 128-bit boundaries and that masks are
    uniform over a vector, and issues vector loads and stores (a fact of the extents,
    not an extent: it is part of the cache key; at most two kernels).
    """
    emit = Emitter()
    groups = len(plan.collapsed.groups)
    inputs = [f"in{i}" for i in range(len(plan.inputs))]
    outputs = [f"out{i}" for i in range(len(plan.outputs))]
    sizes = [f"size{g}" for g in range(groups)]
    strides = [[f"stride{i}_{g}" for g in range(groups)] for i in range(len(plan.inputs))]
    runtime = ["numel", *sizes, *(s for row in strides for s in row), *_index_arguments(plan)]
    tiled = plan.tiled and params.block_columns > 0
    emit.line("pid = tl.program_id(0).to(tl.int64)")
    if aligned:
        known = aligned_arguments(plan, params)
        runtime = [f"{name}_{ALIGN_ELEMENTS}" if name in known else name for name in runtime]
        for name in known:
            emit.line(f"{name} = {name}_{ALIGN_ELEMENTS} * {ALIGN_ELEMENTS}")
    if tiled:
        emit.line("column_blocks = tl.cdiv(size1, BLOCK_COLUMNS)")
        emit.line("rows = (pid // column_blocks) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
        emit.line("columns = (pid % column_blocks) * BLOCK_COLUMNS + tl.arange(0, BLOCK_COLUMNS)")
        emit.line("mask = (rows < size0)[:, None] & (columns < size1)[None, :]")
        emit.line("offs = rows[:, None] * size1 + columns[None, :]")
        coordinates = ["rows", "columns"]
    else:
        emit.line("offs = pid * BLOCK + tl.arange(0, BLOCK)")
        emit.line("mask = offs < numel")
        coordinates = [f"c{g}" for g in range(groups)]
        if plan.broadcast or plan.masks:
            emit.line("rest = offs")
            for g in reversed(range(groups)):
                if g == 0:
                    emit.line("c0 = rest")  # the outermost coordinate needs no remainder
                    continue
                emit.line(f"c{g} = rest % {sizes[g]}")
                emit.line(f"rest = rest // {sizes[g]}")
    if plan.masks:
        emit.element_index = _global_index(emit, coordinates, tiled)
    values: dict[TensorView, Value] = {}
    for i, tensor in enumerate(plan.inputs):
        if i in plan.seeds:  # one value for the whole kernel
            values[tensor] = Value(emit.assign(f"tl.load({inputs[i]})"), tensor.dtype)
            continue
        if i not in plan.broadcast:
            if tensor.dtype is float4_e2m1 and not tiled:
                values[tensor] = _load_packed(emit, inputs[i], tensor)
                continue
            index = "offs"
        else:
            present = plan.collapsed.present[i]
            unit = unit_stride_group(plan.collapsed, plan.mappings[tensor])
            terms = [
                coordinates[g] if g == unit else f"{coordinates[g]} * {strides[i][g]}"
                for g in range(groups)
                if present[g]
            ]
            if tiled and present[0] and present[1]:
                index = emit.assign(f"({terms[0]})[:, None] + ({terms[-1]})[None, :]", "idx")
            elif tiled:
                # Read once per row or column of the tile, not once per element: a
                # vector along the present axis, widened to the tile by broadcasting.
                along, mask = (("rows", "rows < size0") if present[0] else
                               ("columns", "columns < size1"))  # fmt: skip
                index = terms[0] if terms else f"{along} * 0"
                value = emit.load(tensor, inputs[i], emit.assign(index, "idx"), mask)
                expand = "[:, None]" if present[0] else "[None, :]"
                values[tensor] = Value(emit.assign(f"{value.name}{expand}"), value.dtype)
                continue
            else:
                index = emit.assign(" + ".join(terms) if terms else "offs * 0", "idx")
        values[tensor] = emit.load(tensor, inputs[i], index, "mask")
    emit.exprs(plan.exprs, values)
    for i, tensor in enumerate(plan.outputs):
        value = values[tensor]
        if tiled:  # an output computed from broadcast inputs alone is narrower than a tile
            full = f"tl.broadcast_to({value.name}, (BLOCK_ROWS, BLOCK_COLUMNS))"
            value = Value(emit.assign(full), value.dtype)
        if tensor.dtype is not float4_e2m1:
            emit.line(f"tl.store({outputs[i]} + offs, {emit.stored(value)}, mask=mask)")
        elif tiled:
            emit.line(
                f"lo{i}, hi{i} = tl.split("
                f"tl.reshape({value.name}, (BLOCK_ROWS, BLOCK_COLUMNS // 2, 2)))"
            )
            emit.line(
                "pairs = (pid % column_blocks) * (BLOCK_COLUMNS // 2) "
                "+ tl.arange(0, BLOCK_COLUMNS // 2)"
            )
            emit.line(
                f"tl.store({outputs[i]} + rows[:, None] * (size1 // 2) + pairs[None, :], "
                f"(lo{i} | (hi{i} << 4)).to(tl.uint8), "
                "mask=(rows < size0)[:, None] & (pairs < size1 // 2)[None, :])"
            )
        else:
            emit.line(f"lo{i}, hi{i} = tl.split(tl.reshape({value.name}, (BLOCK // 2, 2)))")
            emit.line("pairs = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)")
            emit.line(
                f"tl.store({outputs[i]} + pairs, (lo{i} | (hi{i} << 4)).to(tl.uint8), "
                "mask=pairs < numel // 2)"
            )
    constexprs = ["BLOCK", "BLOCK_ROWS", "BLOCK_COLUMNS"] if tiled else ["BLOCK"]
    comment = f"# {params}; memory types: " + ", ".join(
        memory_type(t.dtype) for t in plan.inputs + plan.outputs
    )
    if aligned:
        comment += f"; {', '.join(known)} are multiples of {ALIGN_ELEMENTS} elements"
    return kernel_source("pointwise_kernel", [*inputs, *outputs], runtime, constexprs,
                         emit.lines, comment)  # fmt: skip


def _index_arguments(plan: PointwisePlan) -> list[str]:
    """The runtime arguments of a kernel drawing dropout masks: where the piece starts in
    the whole tensor's row-major order, and the whole tensor's stride along each group
    but the innermost (whose stride is 1)."""
    if not plan.masks:
        return []
    return ["index_base", *(f"index_stride{g}" for g in range(len(plan.collapsed.groups) - 1))]


def _global_index(emit: Emitter, coordinates: list[str], tiled: bool) -> str:
    """The variable of each element's global row-major index (int64), from its groups'
    coordinates (``rows`` and ``columns`` in a tile, ``c<g>`` in a flat kernel)."""
    if tiled:
        rows, columns = coordinates
        return emit.assign(f"index_base + {rows}[:, None] * index_stride0 + {columns}[None, :]",
                           "index")  # fmt: skip
    terms = [f"{c} * index_stride{g}" for g, c in enumerate(coordinates[:-1])]
    return emit.assign(" + ".join(["index_base", *terms, coordinates[-1]]), "index")


def index_arguments(plan: PointwisePlan, shape: list[int], origin: list[int] | None) -> list[int]:
    """The values of ``_index_arguments`` for a launch over ``shape`` (the local extents
    of the iteration space) starting at ``origin`` (None: at the start) of the whole
    tensor the plan's masks have. Raises ``ValueError`` where an element's global index
    is not linear in its group's coordinate (an axis cut inside a group)."""
    if not plan.masks:
        return []
    whole = [int(extent) for extent in plan.masks[0].output.shape]
    origin = [0] * len(whole) if origin is None else origin
    strides = [math.prod(whole[d + 1 :]) for d in range(len(whole))]
    for group in plan.collapsed.groups:
        cut = [d for d in group[1:] if shape[d] != whole[d]]
        if cut:
            raise ValueError(
                f"a dropout mask over {whole} drawn on a piece of extents {shape}: axis "
                f"{cut[0]} is cut inside the group of axes {group}"
            )
    base = sum(o * s for o, s in zip(origin, strides, strict=True))
    return [base, *(strides[group[-1]] for group in plan.collapsed.groups[:-1])]


def cuts_inside_a_group(plan: PointwisePlan, dim: int) -> bool:
    """Whether cutting axis ``dim`` of the space (a loop's chunks) cuts inside a group of
    merged axes: the kernel's global indices (``index_arguments``) then do not hold."""
    return any(dim in group[1:] for group in plan.collapsed.groups)


def constants(plan: PointwisePlan, params: PointwiseParams) -> dict[str, int]:
    """The kernel's ``tl.constexpr`` arguments: tile sizes, never an extent."""
    if not (plan.tiled and params.block_columns > 0):
        return {"BLOCK": params.block}
    rows = max(1, params.block // params.block_columns)
    return {"BLOCK": params.block, "BLOCK_ROWS": rows, "BLOCK_COLUMNS": params.block_columns}


def _load_packed(emit: Emitter, pointer: str, tensor: TensorView) -> Value:
    """A flat fp4 input read as whole bytes, both values of each at once."""
    emit.line("pair_offs = pid * (BLOCK // 2) + tl.arange(0, BLOCK // 2)")
    byte = emit.assign(f"tl.load({pointer} + pair_offs, mask=pair_offs < numel // 2, other=0)")
    codes = emit.assign(f"tl.reshape(tl.join({byte} & 15, {byte} >> 4), (BLOCK,))")
    return Value(codes, tensor.dtype)


@dataclass(frozen=True)
class PointwiseLauncher(Launcher):
    """Launches a pointwise kernel: one program per ``block`` elements of S (or per
    tile of ``block_rows`` x ``block_columns`` when tiled), in the form the extents
    allow."""

    plan: PointwisePlan
    params: PointwiseParams
    variants: AlignedVariants
    names: list[str]  # the runtime arguments: numel, the groups' sizes, the strides
    known: list[str]  # those the aligned form knows are multiples (aligned_arguments)
    origin: list[int] | None = None  # where the launch's piece starts (dropout masks)

    def at(self, origin: list[int]) -> PointwiseLauncher:
        """This launcher for the piece (or chunk) that starts at ``origin`` of the whole
        tensor its dropout masks are drawn over (a rank's, a loop chunk's)."""
        return replace(self, origin=list(origin))

    def __call__(
        self, inputs: list[torch.Tensor], targets: list[torch.Tensor], shapes: Shapes
    ) -> None:
        self.bind(shapes)(inputs, targets)

    def bind(self, shapes: Shapes) -> BoundLaunch:
        """The launch for these shapes: its grid, runtime arguments and kernel form
        worked out once; a launch passes the tensors (fp8 and fp4 as bytes)."""
        plan, params = self.plan, self.params
        shape = shapes[plan.outputs[0]]
        numel = math.prod(shape)
        if numel == 0:
            return launch_nothing
        sizes = group_sizes(plan.collapsed, shape)
        strides = [
            stride
            for tensor in plan.inputs
            for stride in group_strides(plan.collapsed, plan.mappings[tensor], shapes[tensor])
        ]
        indices = index_arguments(plan, shape, self.origin)
        runtime = dict(zip(self.names, [numel, *sizes, *strides, *indices], strict=True))
        kernel, arguments = self.variants.bind(runtime, self.known)
        if plan.tiled and params.block_columns > 0:
            block_rows = max(1, params.block // params.block_columns)
            grid = (cdiv(sizes[0], block_rows) * cdiv(sizes[1], params.block_columns),)
        else:
            grid = (cdiv(numel, params.block),)

        launch_kernel = kernel.with_scalars(*arguments)

        def launch(inputs: list[torch.Tensor], targets: list[torch.Tensor]) -> None:
            launch_kernel(grid, *[as_bytes(t) for t in inputs], *[as_bytes(t) for t in targets])

        return launch

    def forms(self) -> list[str]:
        return forms_used([self.variants])

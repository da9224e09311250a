"""How compute runs on a rank: generated kernels, cuBLAS contractions, the evaluator.

``ComputeSteps`` builds, for one ``RankProgram``, the closure of each expr or kernel of a
``LaunchKernel``: a generated kernel with its launch configuration chosen now (the
heuristics', or the user's ``kernel_params``) and, on CUDA, compiled now (while the
ranks can still agree the run may start); a contraction through cuBLAS; attention and
an ATen op without a translation (``TorchOp``) through PyTorch; anything else through
the reference evaluator on local pieces. A local shard is taken as a view; a
partial max/min over an empty piece is the identity. The closures read and write the
program's values, which every run replaces.
"""

from __future__ import annotations

import torch

from fusion.exprs import (
    AttentionGradOp,
    AttentionOp,
    DropoutMaskOp,
    Expr,
    IotaOp,
    LinearOp,
    MatmulOp,
    ReductionOp,
    TorchOp,
)
from fusion.ir import TensorView
from fusion.random import dropout_mask
from fusion.reference import attention_grads, attention_value, expr_evaluator
from fusion.storage import (
    is_packed,
    logical_shape,
    packed,
    storage_dtype,
    storage_shape,
    unpacked,
)
from fusion.torch_ops import run_torch_op
from overlap.comm.communications import identity
from overlap.diag import progress
from overlap.ir import LaunchKernel
from schedulers.pointwise import PointwisePlan, cuts_inside_a_group
from schedulers.runtime import allocator, contiguous_strides
from sharding.communication import LocalShard
from sharding.layout import layout_of, split_range
from sharding.pieces import local_piece, piece_origin

# A kernel's first launch that took this long compiled it (progress says so); a shorter
# one found it in Triton's cache and passes silently.
COMPILED_S = 0.25


class ComputeSteps:
    """The compute closures of one rank program (``program``: a ``RankProgram``)."""

    def __init__(self, program) -> None:
        self.program = program

    def holds_an_empty_piece(self, plan) -> bool:
        return any(0 in self.program.local_shape(t) for t in [*plan.inputs, *plan.outputs])

    def generated(
        self, kernel: LaunchKernel, aliases: dict[TensorView, object], for_empty: list | None
    ) -> object:
        """A generated kernel: heuristics (or the user's override) pick its params now.

        In a chunk loop, ``for_empty`` computes the same with the evaluator, for a chunk
        that turns out empty. Outside loops (``None``) the shapes are known now: an empty
        piece never gets here, and a CUDA kernel is compiled now."""
        program = self.program
        scheduler, plan = kernel.scheduler, kernel.analysis
        hardware, shape_of = program.setup.hardware, program.local_shape
        override = program.setup.kernel_params.get(kernel.name)
        if isinstance(override, str):  # a strategy, forced
            params = scheduler.configure(plan, hardware, shape_of, strategy=override)
        else:
            params = override or scheduler.configure(plan, hardware, shape_of)
        launch = scheduler.launcher(plan, params, hardware, shape_of)
        if isinstance(plan, PointwisePlan) and plan.masks:  # drawn from the piece's indices
            mask, chunk = plan.masks[0].output, aliases.get(plan.masks[0].output)
            cut = program.chunk_offsets.get(chunk)
            if cut is not None and cuts_inside_a_group(plan, cut[0]):
                # a loop's chunks cut an axis the kernel merged with the one before: the
                # chunk's global indices are not linear in the kernel's coordinates, and
                # the evaluator draws it (device splits start groups: never the case there)
                return lambda: [compute() for compute in for_empty]
            launch = launch.at(self.origin(mask, chunk))
        program.chosen_params[kernel.name] = params
        program.kernel_forms.setdefault(kernel.name, []).append(launch.forms)
        device = program.ctx.device
        # the first launch compiles the kernel (Triton's JIT): with progress on, say so
        # and wait for it, so the time printed is the compile's
        unannounced = progress.enabled()
        if for_empty is None and device.type == "cuda":
            self._warm_up(kernel, launch)
            unannounced = False

        if for_empty is None and not aliases:
            return self._bound(kernel, launch, unannounced)
        return self._chunk(kernel, launch, aliases, for_empty, unannounced)

    def _chunk(self, kernel: LaunchKernel, launch, aliases: dict, for_empty, unannounced: bool):
        """A kernel in a chunk loop (or writing into another tensor's chunk): its shapes
        are its chunk's, the same at every run of this program (its inputs are checked
        at each run), so its first launch binds them (``Launcher.bind``) and says
        which targets it writes in place. A chunk that turns out empty runs
        ``for_empty`` (the evaluator) instead; a chunk view that is not contiguous is
        written through a buffer of its own, copied in after the launch."""
        program, plan = self.program, kernel.analysis
        device = program.ctx.device
        sources = [aliases.get(t, t) for t in plan.inputs]
        # each output's value: a chunk view to write into, or a value of its own
        destinations = [(tensor, aliases.get(tensor, tensor), tensor in aliases)
                        for tensor in plan.outputs]  # fmt: skip
        bound: list = []  # the launch bound at the first run, and how each target is held

        def bind(inputs: list) -> None:
            if for_empty is not None and any(value.numel() == 0 for value in inputs):
                bound.append(None)
                return
            shapes = {t: logical_shape(t, v) for t, v in zip(plan.inputs, inputs, strict=True)}
            held = []  # None: written in place; else a buffer's shape, strides and dtype
            for tensor, key, into_chunk in destinations:
                destination = program.values.get(key) if into_chunk else None
                shape = self._logical_shape_of(tensor, destination)
                shapes[tensor] = shape
                if destination is not None and destination.is_contiguous():
                    held.append(None)
                else:
                    storage = tuple(storage_shape(tensor, shape))
                    held.append((storage, contiguous_strides(storage), storage_dtype(tensor)))
            bound.append((launch.bind(shapes), held, allocator(device)))

        def run() -> None:
            nonlocal unannounced
            values = program.values
            inputs = [values[key].contiguous() for key in sources]
            if not bound:
                bind(inputs)
            if bound[0] is None:
                for compute in for_empty:
                    compute()
                return
            launched, held, allocate = bound[0]
            targets = [values[key] if buffer is None else allocate(*buffer)
                       for (_, key, _), buffer in zip(destinations, held, strict=True)]  # fmt: skip
            if unannounced:
                unannounced = False
                self._announced(kernel, lambda: launched(inputs, targets))
            else:
                launched(inputs, targets)
            for (_, key, into_chunk), target, buffer in zip(destinations, targets, held,
                                                            strict=True):  # fmt: skip
                if buffer is None:
                    continue
                destination = values.get(key) if into_chunk else None
                if destination is not None:
                    destination.copy_(target)
                else:
                    values[key] = target

        return run

    def _bound(self, kernel: LaunchKernel, launch, unannounced: bool) -> object:
        """A kernel outside loops, reading and writing values of its own: every run has
        this program's shapes (the rank program checks its inputs at each run), so its
        launch is bound to them (``Launcher.bind``) and its targets' shapes known, once."""
        program, plan = self.program, kernel.analysis
        shapes = {t: program.local_shape(t) for t in [*plan.inputs, *plan.outputs]}
        held = []  # each target's shape, strides and dtype
        for tensor in plan.outputs:
            shape = tuple(storage_shape(tensor, shapes[tensor]))
            held.append((shape, contiguous_strides(shape), storage_dtype(tensor)))
        bound, allocate = launch.bind(shapes), allocator(program.ctx.device)
        inputs_of, outputs_of = plan.inputs, plan.outputs

        def run() -> None:
            nonlocal unannounced
            values = program.values
            inputs = [values[t].contiguous() for t in inputs_of]
            targets = [allocate(*target) for target in held]
            if unannounced:
                unannounced = False
                self._announced(kernel, lambda: bound(inputs, targets))
            else:
                bound(inputs, targets)
            values.update(zip(outputs_of, targets, strict=True))

        return run

    def _announced(self, kernel: LaunchKernel, launch) -> None:
        """A kernel's first ``launch``, said by progress (it compiles the kernel) and
        waited for, so that the time printed is the compile's."""
        device = self.program.ctx.device
        with progress.step(f"rank {self.program.rank}: compiled {kernel.name} "
                           f"[{kernel.scheduler.name}]", COMPILED_S):  # fmt: skip
            launch()
            if device.type == "cuda":
                torch.cuda.synchronize(device)

    def _warm_up(self, kernel: LaunchKernel, launch) -> None:
        """Launch ``kernel`` once on zeros of this rank's shapes, so that Triton compiles
        it now, while the ranks can still agree that the run may start: a kernel the
        device refuses on one rank (its resources at its local shapes) then fails every
        rank before any collective, not this rank alone in the middle of the run."""
        plan, device = kernel.analysis, self.program.ctx.device
        shapes = {t: self.program.local_shape(t) for t in [*plan.inputs, *plan.outputs]}

        def zeros(tensor: TensorView) -> torch.Tensor:
            shape = storage_shape(tensor, shapes[tensor])
            return torch.zeros(shape, dtype=storage_dtype(tensor), device=device)

        inputs, targets = [zeros(t) for t in plan.inputs], [zeros(t) for t in plan.outputs]
        self._announced(kernel, lambda: launch(inputs, targets, shapes))

    def _logical_shape_of(self, tensor: TensorView, destination) -> list[int]:
        if destination is not None:
            return logical_shape(tensor, destination)
        return self.program.local_shape(tensor)

    def evaluated(self, expr: Expr, aliases: dict[TensorView, object]):
        values = self.program  # read through program.values: it is replaced on every run

        def read(tensor: TensorView) -> torch.Tensor:
            return values.values[aliases.get(tensor, tensor)]

        outputs = [(out, aliases.get(out, out), out in aliases) for out in expr.outputs]
        if isinstance(expr, LocalShard):
            (source,) = expr.inputs
            coordinate = expr.mesh.coords(self.program.rank)[expr.mesh_axis]
            extent = self.program.local_shape(source)[expr.dim]
            offset, size = split_range(extent, expr.mesh.shape[expr.mesh_axis], coordinate)
            ((_, key, _),) = outputs

            def shard_locally() -> None:
                whole = unpacked(source, read(source))
                piece = whole.narrow(expr.dim, offset, size).contiguous()
                values.values[key] = packed(source, piece)

            return shard_locally
        if isinstance(expr, IotaOp):
            return self._iota(expr, outputs)
        if isinstance(expr, DropoutMaskOp):
            return self._dropout_mask(expr, read, outputs)
        if _partial_extreme(expr) and self._reduces_nothing_here(expr):
            # this rank's piece of the reduced axis is empty: the identity, which leaves
            # the other ranks' partial results as they are (chunk loops cut kept axes only)
            ((out, key, _),) = outputs
            dtype, device = storage_dtype(out), self.program.ctx.device

            def identity_here() -> None:
                shape = [e for d, e in enumerate(read(expr.inputs[0]).shape) if d not in expr.dims]
                values.values[key] = identity(torch.empty(shape, dtype=dtype, device=device),
                                              expr.op_name)  # fmt: skip

            return identity_here
        return self._evaluated_plainly(expr, aliases)

    def _iota(self, expr: IotaOp, outputs):
        """This rank's indices: its piece of the whole iota (each piece its global ones)."""
        ((out, key, into_chunk),) = outputs
        if into_chunk:
            raise NotImplementedError(f"iota {out}: chunked by a stream loop")
        program = self.program
        (extent,) = program.ctx.global_shape(out)
        whole = torch.arange(extent, dtype=out.dtype.torch_dtype, device=program.ctx.device)
        piece = local_piece(whole, out, program.rank)

        def index_here() -> None:
            program.values[key] = piece

        return index_here

    def origin(self, tensor: TensorView, slot: object = None) -> list[int]:
        """Where what this rank computes of ``tensor`` starts in the whole tensor, per
        axis: its piece's offsets, plus, for ``slot`` a chunk of it in a loop, the
        chunk's offset in the piece."""
        program = self.program
        origin = piece_origin(tensor, program.rank, program.ctx.global_shape(tensor))
        if slot in program.chunk_offsets:
            dim, offset = program.chunk_offsets[slot]
            origin[dim] += offset
        return origin

    def _dropout_mask(self, expr: DropoutMaskOp, read, outputs):
        """This rank's piece (or chunk) of the mask, drawn from its own elements' global
        indices: no rank draws the whole mask."""
        ((out, key, into_chunk),) = outputs
        program = self.program
        shape = program.ctx.global_shape(out)
        origin = self.origin(out, key if into_chunk else None)

        def draw() -> None:
            extents = program.values[key].shape if into_chunk else program.local_shape(out)
            mask = dropout_mask(read(expr.inputs[0]), shape, expr.p, origin, list(extents))
            if into_chunk:
                program.values[key].copy_(mask)
            else:
                program.values[key] = mask

        return draw

    def _reduces_nothing_here(self, expr: ReductionOp) -> bool:
        shape = self.program.local_shape(expr.inputs[0])
        return any(shape[d] == 0 for d in expr.dims)

    def _evaluated_plainly(self, expr: Expr, aliases: dict[TensorView, object]):
        values = self.program

        def read(tensor: TensorView) -> torch.Tensor:
            return values.values[aliases.get(tensor, tensor)]

        outputs = [(out, aliases.get(out, out), out in aliases) for out in expr.outputs]
        if isinstance(expr, (AttentionOp, AttentionGradOp, TorchOp)):
            return self._by_torch(expr, read, outputs)
        if isinstance(expr, (MatmulOp, LinearOp)):
            ((_, key, into_chunk),) = outputs
            operands, contraction = [aliases.get(t, t) for t in expr.inputs], _contraction(expr)

            def contract() -> None:
                held = values.values
                destination = held.get(key) if into_chunk else None
                result = contraction([held[t] for t in operands], destination)
                if destination is None:
                    held[key] = result
                elif result.data_ptr() != destination.data_ptr():
                    destination.copy_(result)

            return contract

        run = expr_evaluator(expr)
        # The reference evaluator holds fp4 unpacked, one code per byte.
        sources = [(t, aliases.get(t, t), is_packed(t)) for t in expr.inputs]
        results = [(out, key, into_chunk, is_packed(out)) for out, key, into_chunk in outputs]
        chunked = [(out, key) for out, key, into_chunk in outputs if into_chunk]

        def evaluate() -> None:
            held = values.values
            local = {t: unpacked(t, held[key]) if packs else held[key] for t, key, packs in sources}
            destinations = {out: held.get(key) for out, key in chunked}

            def shape_of(tensor: TensorView) -> list[int]:
                if tensor in local:
                    return list(local[tensor].shape)
                destination = destinations.get(tensor)
                if destination is not None:
                    return logical_shape(tensor, destination)
                return self.program.local_shape(tensor)

            run(local, shape_of)
            for out, key, into_chunk, packs in results:
                result = packed(out, local[out]) if packs else local[out]
                if into_chunk and destinations[out] is not None:
                    destinations[out].copy_(result)
                else:
                    held[key] = result

        return evaluate

    def _by_torch(self, expr: Expr, read, outputs):
        """Attention (or its gradients) by torch's kernels, natively in its dtype; an
        ATen op without a translation by itself, on this rank's device."""
        values, device = self.program, self.program.ctx.device

        def results_of(operands: list) -> list:
            if isinstance(expr, TorchOp):
                return run_torch_op(expr, operands, device)
            mask = [] if expr.has_mask else [None]
            if isinstance(expr, AttentionOp):
                return [attention_value(*operands, *mask, expr.causal, expr.scale)]
            return attention_grads(*operands, *mask, expr.causal, expr.scale)

        def run() -> None:
            results = results_of([read(t) for t in expr.inputs])
            for (_, key, into_chunk), result in zip(outputs, results, strict=True):
                destination = values.values.get(key) if into_chunk else None
                if destination is None:
                    values.values[key] = result
                else:
                    destination.copy_(result)

        return run


def _partial_extreme(expr: Expr) -> bool:
    """A max or min over an axis split across ranks (its result a partial max/min)."""
    if not isinstance(expr, ReductionOp) or expr.op_name not in ("max", "min"):
        return False
    layout = layout_of(expr.output)
    return layout is not None and layout.is_partial


def _contraction(expr: Expr):
    """``contract(operands, out)``: ``expr`` (a matmul or linear) through cuBLAS, natively
    in its dtype (fp32 accumulation), into ``out`` where that is a contiguous matrix
    (and the operands are matrices), else into a new tensor."""
    if isinstance(expr, MatmulOp):
        matrices = all(t.ndim == 2 for t in expr.inputs)

        def matmul(operands: list, out: torch.Tensor | None) -> torch.Tensor:
            a, b = operands
            if matrices and out is not None and out.is_contiguous():
                return torch.mm(a, b, out=out)
            return torch.matmul(a, b)

        return matmul
    matrix = expr.inputs[0].ndim == 2

    def linear(operands: list, out: torch.Tensor | None) -> torch.Tensor:
        x, weight, *bias = operands
        if matrix and out is not None and out.is_contiguous():
            if bias:
                return torch.addmm(bias[0], x, weight.t(), out=out)
            return torch.mm(x, weight.t(), out=out)
        return torch.nn.functional.linear(x, weight, bias[0] if bias else None)

    return linear

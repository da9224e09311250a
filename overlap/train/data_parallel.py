"""``GradientReducer``: parameter gradients averaged over the data-parallel replicas while
the backward runs, as PyTorch's DDP does.

The parameters are cut into buckets of about ``bucket_mb`` (one dtype each) in the order
their gradients come: a backward program's own (``listener``), else the reverse order of
registration (a backward produces the last layers' gradients first). A bucket is
posted once its last gradient is made, in bucket order (as DDP does: the ranks post
their all-reduces alike whatever order the gradients come in, a bucket waiting for the
ones before it): its gradients flattened into one buffer in the bucket's order, divided
by the number of replicas, summed over the replicas by an asynchronous all-reduce on the
replica group (``Communicator.replica_group``), while the rest of the backward runs. On
CUDA the flattening and the all-reduce are queued on a side stream, which waits for the
compute stream first (the gradients are queued there, or joined into it), so the compute
stream goes on. When the backward ends, any bucket some
of whose parameters got no gradient (the same ones on every rank: SPMD) is posted, every
bucket waited for, and the averages copied back into the gradients.

Two ways of hearing of a gradient:

- **Inside a backward program** (``listener``): ``parallelize`` hands the backward
  executors of its ``TrainableFusion`` a listener (``overlap.runtime.listeners``), which
  the program tells of each parameter's gradient as soon as it has issued the work that
  makes it: the bucket is posted there, between the program's own steps, while the rest
  of its backward runs, and the averages are written over the gradients before the
  program returns them (autograd then accumulates averages). A program replayed from a
  CUDA graph replays the all-reduces it captured, on the side stream, beside its kernels.
- **From autograd** (any other parameter): a hook on each parameter
  (``register_post_accumulate_grad_hook``) counts the gradients of its bucket as
  autograd accumulates them; the first hook of a backward queues a callback that
  autograd runs when that backward ends, which posts what is left and waits.

With a timeline (the program's, when a run records one, or ``timeline`` set on the
reducer), each bucket's all-reduce is a span on the lane ``data parallel comm``
(``overlap.diag.timeline.DATA_PARALLEL_LANE``), from its post to its end (on CUDA, on the
side stream); the roof meter (``explain_overlap``) measures it against the backward's
kernels.

Gradients accumulated over several backwards (micro-batches) stay right: each backward's
gradients are averaged before they are added, and a sum of averages is the average of
the sums. Each backward pays its all-reduces; the result is the same.

Example (on every rank; ``parallelize(..., data_parallel=...)`` builds one)::

    reducer = GradientReducer(list(module.parameters()), team.replica_group, team.replicas)
    loss.backward()  # gradients averaged over the replicas when it returns
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from overlap.diag.timeline import DATA_PARALLEL_LANE, SpanRecorder

DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients are all-reduced together (one dtype)."""

    index: int  # in posting order
    parameters: list[torch.nn.Parameter]
    # this backward's gradients so far, by parameter (a program's outputs, or .grad)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)
    pending: tuple | None = None  # (work, flat buffer, gradients, span, its recorder)
    posted: int = 0  # times posted so far

    @property
    def complete(self) -> bool:
        """Every gradient of the bucket is made in this backward."""
        return len(self.grads) == len(self.parameters)

    def ordered(self) -> list[torch.Tensor]:
        """This backward's gradients in the bucket's order (the same on every replica)."""
        return [self.grads[id(p)] for p in self.parameters if id(p) in self.grads]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local piece (its gradient is a DTensor placed as the parameter)."""
    return getattr(tensor, "_local_tensor", tensor)


class GradientReducer:
    """Averages ``parameters``' gradients over ``group`` (``replicas`` ranks) during the
    backward (see the module); ``bucket_mb``: a bucket's size in MiB."""

    def __init__(
        self,
        parameters: Sequence[torch.nn.Parameter],
        group: dist.ProcessGroup,
        replicas: int,
        bucket_mb: float = DEFAULT_BUCKET_MB,
    ) -> None:
        self.group, self.replicas, self.bucket_mb = group, replicas, bucket_mb
        self.parameters = [p for p in parameters if p.requires_grad]
        for parameter in self.parameters:
            parameter.register_post_accumulate_grad_hook(self._accumulated)
        self.buckets: list[Bucket] = []
        self._fill(list(reversed(self.parameters)))
        self._in_program: set[int] = set()  # parameters a backward program tells of
        device = _local(parameters[0]).device if parameters else torch.device("cpu")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._finishing = False  # a callback is queued for the running backward
        self._next = 0  # the first bucket not posted in this backward
        self.timeline: SpanRecorder | None = None  # records the all-reduces where set

    def _fill(self, order: Sequence[torch.nn.Parameter]) -> None:
        """The buckets: the parameters in ``order`` (the order their gradients come),
        about ``bucket_mb`` MiB and one dtype a bucket."""
        self.buckets = []
        limit_bytes, filled_bytes, dtype = self.bucket_mb * 2**20, 0.0, None
        for parameter in order:
            local = _local(parameter)
            size_bytes = local.numel() * local.element_size()
            if not self.buckets or filled_bytes + size_bytes > limit_bytes or local.dtype != dtype:
                self.buckets.append(Bucket(len(self.buckets), []))
                filled_bytes, dtype = 0.0, local.dtype
            self.buckets[-1].parameters.append(parameter)
            filled_bytes += size_bytes
        self._bucket_of = {id(p): b for b in self.buckets for p in b.parameters}

    @property
    def posted(self) -> int:
        """All-reduces posted so far (one per bucket per backward; a replayed CUDA graph's
        are not counted)."""
        return sum(bucket.posted for bucket in self.buckets)

    def listener(
        self, parameters: Sequence[torch.nn.Parameter | None], order: Sequence[int]
    ) -> ProgramReducer:
        """The listener of a backward program whose output ``j`` is the gradient of
        ``parameters[j]`` (None: an output not reduced here, an activation's gradient),
        made in ``order`` (output positions; ``listeners.production_order``): the buckets
        are cut again in that order (the same on every replica: it is the fusion's), the
        other parameters after them; autograd's hooks leave these to the program."""
        made = [parameters[j] for j in order if parameters[j] is not None]
        self._in_program.update(id(p) for p in made)
        rest = [p for p in reversed(self.parameters) if id(p) not in self._in_program]
        known = {id(p) for p in self.parameters}
        self._fill([p for p in made if id(p) in known] + rest)
        return ProgramReducer(self, parameters)

    def _accumulated(self, parameter: torch.nn.Parameter) -> None:
        if id(parameter) in self._in_program:
            return  # averaged by the program that made it
        if not self._finishing:
            self._finishing = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self.gradient_made(parameter, _local(parameter.grad), self.timeline)

    def gradient_made(
        self, parameter: torch.nn.Parameter, grad: torch.Tensor, timeline: SpanRecorder | None
    ) -> None:
        """``parameter``'s gradient ``grad`` is made (once the current stream's work so
        far is done): the buckets complete by now are posted, in order."""
        self._bucket_of[id(parameter)].grads[id(parameter)] = grad
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._post(self.buckets[self._next], timeline)
            self._next += 1

    def _post(self, bucket: Bucket, timeline: SpanRecorder | None) -> None:
        grads = bucket.ordered()
        if not grads:
            return
        side, elements = self._stream, sum(g.numel() for g in grads)
        flat = torch.empty(elements, dtype=grads[0].dtype, device=grads[0].device)
        if side is not None:
            # made on the compute stream, which waits for the side stream before it reads
            # the averages and lets it go: no other stream reuses it before that
            side.wait_stream(torch.cuda.current_stream(side.device))
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            span = None
            if timeline is not None:
                detail = f"Allreduce {len(grads)} gradients, {elements} elements"
                span = timeline.start(DATA_PARALLEL_LANE, f"bucket {bucket.index}", detail)
            torch.cat([g.reshape(-1) for g in grads], out=flat)
            flat.div_(self.replicas)  # gloo has no average: summed after dividing
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            if side is not None:  # the side stream waits for it, the host does not
                work.wait()
                if span is not None:
                    timeline.stop(span)
                work = span = None
        bucket.pending, bucket.posted = (work, flat, grads, span, timeline), bucket.posted + 1

    def finish(self, timeline: SpanRecorder | None = None) -> None:
        """Post what is left (recorded on ``timeline``, or the reducer's), wait for every
        bucket and copy the averages into the gradients (autograd calls it when a backward
        that produced some ends, a program at its last step)."""
        recorder = timeline if timeline is not None else self.timeline
        for bucket in self.buckets[self._next :]:
            self._post(bucket, recorder)
        if self._stream is not None:
            torch.cuda.current_stream(self._stream.device).wait_stream(self._stream)
        for bucket in self.buckets:
            if bucket.pending is not None:
                work, flat, grads, span, spans = bucket.pending
                if work is not None:
                    work.wait()
                if span is not None:
                    spans.stop(span)
                offset = 0
                for grad in grads:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
            bucket.pending = None
            bucket.grads.clear()
        self._finishing, self._next = False, 0


class ProgramReducer:
    """A backward program's listener (``overlap.runtime.listeners.OutputListener``):
    each parameter's gradient handed to its ``GradientReducer`` as the program issues it,
    every bucket finished before the program returns (see the module)."""

    def __init__(
        self, reducer: GradientReducer, parameters: Sequence[torch.nn.Parameter | None]
    ) -> None:
        self.reducer, self.parameters = reducer, list(parameters)

    def ready(self, position: int, value: torch.Tensor, timeline: SpanRecorder | None) -> None:
        """Output ``position`` is issued (see ``OutputListener``)."""
        parameter = self.parameters[position]
        if parameter is not None:
            recorder = timeline if timeline is not None else self.reducer.timeline
            self.reducer.gradient_made(parameter, value, recorder)

    def finish(self, timeline: SpanRecorder | None) -> None:
        """The program's last step is issued: every bucket's averages in its gradients."""
        self.reducer.finish(timeline)

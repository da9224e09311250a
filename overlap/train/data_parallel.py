"""``GradientReducer``: parameter gradients averaged over the data-parallel replicas while
the backward runs, as PyTorch's DDP does.

The parameters are cut into buckets of about ``bucket_mb`` (one dtype each), in reverse
order of registration: a backward produces the last layers' gradients first. A hook on
each parameter (``register_post_accumulate_grad_hook``) counts the gradients of its
bucket; when the bucket's last one is accumulated, the bucket is posted (in bucket order,
as DDP does: the ranks post their all-reduces alike whatever order autograd accumulates
the gradients in, a bucket waiting for the ones before it): its gradients
flattened into one buffer, divided by the number of replicas, summed over the replicas
by an asynchronous all-reduce on the replica group (``Communicator.replica_group``), while
the rest of the backward runs. On CUDA the flattening and the all-reduce are queued on a
side stream, which waits for the gradients first, so the compute stream goes on. The first
hook of a backward queues a callback that autograd runs when that backward ends: it posts
any bucket some of whose parameters got no gradient (the same ones on every rank: SPMD),
waits for every bucket and copies the averages back into the gradients; the optimizer's
step, after ``backward()`` returns, reads the averages.

With a ``timeline`` (``overlap.diag.timeline.Timeline``, set on the reducer), each
bucket's all-reduce is a span on the lane ``data parallel comm``, from its post (on CUDA, on the
side stream) to the moment the compute stream may read the average, as a program's
communications are.

Gradients accumulated over several backwards (micro-batches) stay right: what an earlier
backward left is already the same on every replica, and the average of equal values is
that value. Each backward pays its all-reduces; the result is the same.

Example (on every rank; ``parallelize(..., data_parallel=...)`` builds one)::

    reducer = GradientReducer(list(module.parameters()), team.replica_group, team.replicas)
    loss.backward()  # gradients averaged over the replicas when it returns
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from overlap.diag.timeline import SpanRecorder

DEFAULT_BUCKET_MB = 25.0  # DDP's bucket_cap_mb
LANE = "data parallel comm"  # the timeline's lane of the all-reduces (a communication)


@dataclass(eq=False)
class Bucket:
    """Parameters whose gradients are all-reduced together (one dtype)."""

    index: int  # in posting order
    parameters: list[torch.nn.Parameter]
    ready: int = 0  # of its parameters' gradients accumulated in this backward
    pending: tuple | None = None  # (work, flat buffer, gradients, span) once posted
    posted: int = 0  # times posted so far

    @property
    def complete(self) -> bool:
        """Every gradient of the bucket is accumulated in this backward."""
        return self.ready == len(self.parameters)


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
        self.group, self.replicas = group, replicas
        self.buckets: list[Bucket] = []
        limit_bytes, filled_bytes, dtype = bucket_mb * 2**20, 0.0, None
        for parameter in reversed([p for p in parameters if p.requires_grad]):
            local = _local(parameter)
            size_bytes = local.numel() * local.element_size()
            if not self.buckets or filled_bytes + size_bytes > limit_bytes or local.dtype != dtype:
                self.buckets.append(Bucket(len(self.buckets), []))
                filled_bytes, dtype = 0.0, local.dtype
            self.buckets[-1].parameters.append(parameter)
            filled_bytes += size_bytes
            parameter.register_post_accumulate_grad_hook(self._accumulated)
        self._bucket_of = {id(p): b for b in self.buckets for p in b.parameters}
        device = _local(parameters[0]).device if parameters else torch.device("cpu")
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._finishing = False  # a callback is queued for the running backward
        self._next = 0  # the first bucket not posted in this backward
        self.timeline: SpanRecorder | None = None  # records the all-reduces where set

    @property
    def posted(self) -> int:
        """All-reduces posted so far (one per bucket per backward)."""
        return sum(bucket.posted for bucket in self.buckets)

    def _accumulated(self, parameter: torch.nn.Parameter) -> None:
        if not self._finishing:
            self._finishing = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        self._bucket_of[id(parameter)].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._post(self.buckets[self._next])
            self._next += 1

    def _post(self, bucket: Bucket) -> None:
        grads = [_local(p.grad) for p in bucket.parameters if p.grad is not None]
        if not grads:
            return
        if self._stream is not None:
            # the side stream reads the gradients once the compute stream has made them
            self._stream.wait_stream(torch.cuda.current_stream(self._stream.device))
        side = (
            torch.cuda.stream(self._stream)
            if self._stream is not None
            else contextlib.nullcontext()
        )
        with side:
            span = None
            if self.timeline is not None:
                elements = sum(g.numel() for g in grads)
                detail = f"Allreduce {len(grads)} gradients, {elements} elements"
                span = self.timeline.start(LANE, f"bucket {bucket.index}", detail)
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(self.replicas)  # gloo has no average: summed after dividing
            work = dist.all_reduce(flat, group=self.group, async_op=True)
        bucket.pending, bucket.posted = (work, flat, grads, span), bucket.posted + 1

    def finish(self) -> None:
        """Post what is left, wait for every bucket and copy the averages into the
        gradients (autograd calls it when a backward that produced some ends)."""
        for bucket in self.buckets[self._next :]:
            if bucket.ready:
                self._post(bucket)
        for bucket in self.buckets:
            if bucket.pending is not None:
                work, flat, grads, span = bucket.pending
                work.wait()
                if self._stream is not None:
                    current = torch.cuda.current_stream(self._stream.device)
                    current.wait_stream(self._stream)
                    flat.record_stream(current)
                if span is not None:
                    self.timeline.stop(span)
                offset = 0
                for grad in grads:
                    grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
                    offset += grad.numel()
            bucket.pending, bucket.ready = None, 0
        self._finishing, self._next = False, 0

"""Dropout fused into the kernel before it (``x * w`` then dropout) against the mask held
in memory, as a fraction of a copy.

    python benchmarks/dropout.py            # on one GPU, 16384x4096 bf16; results/dropout.json
    python benchmarks/dropout.py --smoke    # a tiny shape on CPU (Triton's interpreter)

Providers (ms per call, GB/s of the activation read and written once, fraction of a
measured 1 GiB device-to-device copy):

- ``ours``: the captured ``nn.Dropout(x * w)`` with generated kernels (replayed from a
  CUDA graph): one kernel, the mask drawn in registers (``fusion.random``'s bits: the
  dropped elements checked bitwise against the reference evaluator first);
- ``ours_no_dropout``: the same module in eval mode (``x * w`` alone): the floor;
- ``mask_in_memory``: what the program ran before the mask was fused, in eager PyTorch:
  ``x * w``, the whole float32 mask made by ``fusion.random.dropout_mask`` and written
  out, then read back by the multiply;
- ``eager``: PyTorch's own ``F.dropout(x * w)`` (other bits: its Philox generator);
- ``copy``: a copy of the same bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
if "--smoke" in sys.argv:
    import os

    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.kernels import benchmark_parser, copy_gbps, write_results  # noqa: E402
from benchmarks.timing import time_rounds  # noqa: E402
from fusion.capture import capture  # noqa: E402
from fusion.random import dropout_mask  # noqa: E402
from fusion.reference import evaluate  # noqa: E402
from fusion.testing import assert_close  # noqa: E402
from overlap import MultiDeviceExecutor  # noqa: E402

P = 0.1


class ScaledDropout(torch.nn.Module):
    """``dropout(x * weight)``: a transformer's scaled activation, then dropout."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden))
        self.drop = torch.nn.Dropout(P)

    def forward(self, x):
        return self.drop(x * self.weight)


def main() -> None:
    parser = benchmark_parser(__doc__, "dropout", iterations=40)
    args = parser.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    rows_count, hidden = (33, 65) if args.smoke else (16384, 4096)
    torch.manual_seed(0)
    module = ScaledDropout(hidden).to(torch.bfloat16)
    x = torch.randn(rows_count, hidden).to(torch.bfloat16)
    graphed = device.type == "cuda"
    functions, seed = {}, 1234
    for name, mode in (("ours", True), ("ours_no_dropout", False)):
        captured = capture(module.train(mode), [x])
        inputs = captured.inputs(module, x, seed=seed if captured.seeded else None)
        (expected,) = evaluate(captured.fd.fusion, inputs)
        executor = MultiDeviceExecutor(captured.fd, kernels="generated", cuda_graph=graphed)
        on_device = [t.to(device) for t in inputs]
        (ours,) = executor.run(on_device)
        # the same elements dropped, bitwise; the values as the tests compare them
        if not torch.equal(ours.cpu() == 0, expected == 0):
            raise SystemExit(f"{name}: the kernel drew other bits than the reference")
        assert_close(ours.cpu(), expected)
        print(f"{name}: {executor.kernel_report()}", flush=True)
        functions[name] = lambda e=executor, i=on_device: e.run(i)
    x_here, weight = x.to(device), module.weight.detach().to(device)
    seed_here = torch.tensor([seed], device=device)

    def mask_in_memory():
        mask = dropout_mask(seed_here, [rows_count, hidden], P)
        return ((x_here * weight).float() * mask).bfloat16()

    functions["mask_in_memory"] = mask_in_memory
    functions["eager"] = lambda: F.dropout(x_here * weight, P, training=True)
    nbytes = 2 * x.numel() * x.element_size() + weight.numel() * weight.element_size()
    if device.type == "cuda":
        source = torch.empty(nbytes // 2, dtype=torch.uint8, device=device)
        target = torch.empty_like(source)
        functions["copy"] = lambda: target.copy_(source)
    copy = copy_gbps(device)
    times = time_rounds(functions, device, args.rounds, args.iterations, settle=True)
    rows = []
    for provider, ms in times.items():
        gbps = nbytes / (ms * 1e6)
        rows.append({"case": "scaled_dropout", "shape": [rows_count, hidden],
                     "dtype": "bfloat16", "p": P, "bytes": nbytes, "provider": provider,
                     "ms": ms, "gbps": gbps, "frac_copy": gbps / copy})  # fmt: skip
        print(f"{provider:<16} {ms:8.3f} ms {gbps:8.1f} GB/s {gbps / copy:6.2f} of copy")
    if not args.smoke:
        write_results(args.out, device, copy, rows)


if __name__ == "__main__":
    main()

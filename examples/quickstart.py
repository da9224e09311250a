"""Quick start: define a fusion, print it, run it at two batch sizes, check it by hand.

Run: python examples/quickstart.py
(``overlap dump examples/quickstart.py`` prints the program it compiles to.)
"""

import torch
import torch.nn.functional as F

from fusion import DataType, FusionDefinition, from_fp4
from fusion.testing import assert_close


def fusion(world_size: int = 1) -> FusionDefinition:
    """y = silu(x) * scale, and y cast to fp4. One device's fusion: every rank would run it
    whole, whatever ``world_size``."""
    with FusionDefinition("scaled_silu_fp4") as fd:
        x = fd.define_tensor(["batch", 256], DataType.bfloat16)  # "batch" is bound when it runs
        scale = fd.define_tensor([256], DataType.bfloat16)
        y = fd.ops.silu(x) * fd.ops.broadcast(scale, [True, False])
        fd.add_output(y)
        fd.add_output(fd.ops.cast(y, DataType.float4_e2m1))  # fp4, packed two values per byte
    return fd


if __name__ == "__main__":
    fd = fusion()
    print(fd)
    for batch in (3, 1000):
        x_in = torch.randn(batch, 256, dtype=torch.bfloat16)
        scale_in = torch.rand(256, dtype=torch.bfloat16)
        y_out, y_fp4 = fd.execute([x_in, scale_in])
        assert_close(y_out, F.silu(x_in) * scale_in)
        error = (from_fp4(y_fp4) - y_out.float()).abs().max()
        print(
            f"batch {batch}: y {tuple(y_out.shape)} {y_out.dtype}; fp4 {tuple(y_fp4.shape)} "
            f"{y_fp4.dtype}; max fp4 rounding error {error:.3f}"
        )

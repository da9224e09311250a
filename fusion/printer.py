"""Readable text of a fusion: its inputs, every expr, its outputs and constraints.

Example::

    Fusion mlp: 2 inputs, 3 exprs, 1 output
    inputs:
      T0_bf16[iS0{batch}, iS1{1024}]
      T1_bf16[iS2{4096}, iS3{1024}]
    exprs:
      T2_bf16[iS4{batch}, iS5{4096}, rS6{1024}] = linear(T0, T1)
      ...
    outputs:
      T4_bf16[iS10{batch}, iS11{4096}]

An ATen op captured without a translation prints as ``T5 = torch_op[aten.cumsum.default](T3,
dim=1)``, and a last line names every such op: ``fell back to torch: aten.cumsum.default
(...)``: PyTorch runs it, split as torch's DTensor strategy splits it where torch has one
(``sharding.torch_strategy``), else its tensors whole on every rank; once placed, the
line says how each op's output is split (``aten.cumsum.default (split on axis 0)``).

Once tensors are placed on device meshes, the meshes are listed first and each
line ends with the mesh of its tensor (``@M0``). ``LEGEND`` says how to read it (the
demo prints it; docs/guide.md carries it).
"""

from __future__ import annotations

from fusion.exprs import TorchOp
from fusion.ir import Fusion, TensorView
from fusion.torch_ops import fell_back

# How to read the printed IR: Axis.__str__ and TensorView.__str__ (fusion/ir.py) write
# what it describes.
LEGEND = (
    "How to read it: T3_bf16[...] is tensor T3, of dtype bf16, and its axes. An axis such "
    "as iDIDx0{512} reads: its iteration type (i iterated; r reduced, as a matmul's "
    "contraction axis; b broadcast), its parallel type (S serial, whole on every device; "
    "DIDx split over the devices of the mesh's first axis, DIDy and DIDz its second and "
    "third; Stream cut into chunks that run on separate streams; DIDx|Stream both), its "
    "id (0, unique in the fusion) and, in braces, its whole extent (each device holds its "
    "share of a split axis; {batch} is a symbolic extent). A reduced axis split over the "
    "devices (rDIDx) holds partial sums. @M0: the device mesh the tensor is placed on, "
    "listed under meshes."
)


def count(number: int, noun: str) -> str:
    """``3 inputs``, ``1 output``."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def fusion_to_text(fusion: Fusion) -> str:
    """The fusion as text, one tensor or expr per line."""
    meshes: list[object] = []
    for tensor in fusion.tensors:
        if tensor.mesh is not None and tensor.mesh not in meshes:
            meshes.append(tensor.mesh)

    def placed(line: str, tensor: TensorView) -> str:
        return line if tensor.mesh is None else f"{line}  @M{meshes.index(tensor.mesh)}"

    title = "Fusion" if fusion.name is None else f"Fusion {fusion.name}"
    lines = [
        f"{title}: {count(len(fusion.inputs), 'input')}, {count(len(fusion.exprs), 'expr')}, "
        f"{count(len(fusion.outputs), 'output')}"
    ]
    if meshes:
        lines.append("meshes:")
        lines.extend(f"  M{index} = {mesh}" for index, mesh in enumerate(meshes))
    lines.append("inputs:")
    lines.extend(placed(f"  {tensor}", tensor) for tensor in fusion.inputs)
    lines.append("exprs:")
    lines.extend(placed(f"  {expr}", expr.outputs[0]) for expr in fusion.exprs)
    lines.append("outputs:")
    lines.extend(placed(f"  {tensor}", tensor) for tensor in fusion.outputs)
    if fusion.constraints:
        lines.append("constraints:")
        lines.extend(f"  {constraint}" for constraint in fusion.constraints)
    lines.extend(_fallbacks(fusion, placed=bool(meshes)))
    return "\n".join(lines)


def _fallbacks(fusion: Fusion, placed: bool) -> list[str]:
    """The last line: each op left to PyTorch, with how its output is split where the
    fusion is placed (``sharding.torch_strategy`` chose it), else how it will be."""
    if not placed:
        fallbacks = fell_back(fusion)
        if not fallbacks:
            return []
        return [f"fell back to torch: {', '.join(fallbacks)} (placed by torch's DTensor "
                "strategy where it has one, else replicated)"]  # fmt: skip
    described = []
    for expr in fusion.exprs:
        if isinstance(expr, TorchOp):
            output = expr.outputs[0]
            split = [d for d, a in enumerate(output.logical_axes) if a.parallel_type.is_device]
            where = f"split on axis {split[0]}" if split else "whole on every rank"
            if output.mesh is None:  # annotated fusion, not propagated yet
                where = "not placed yet"
            name = str(expr.target) if expr.vjp is None else f"{expr.target} backward"
            described.append(f"{name} ({where})")
    if not described:
        return []
    return [f"fell back to torch: {', '.join(dict.fromkeys(described))}"]

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

Once tensors are placed on device meshes, the meshes are listed first and each
line ends with the mesh of its tensor (``@M0``).
"""

from __future__ import annotations

from fusion.ir import Fusion, TensorView


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
    return "\n".join(lines)

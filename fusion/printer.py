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
"""

from __future__ import annotations

from fusion.ir import Fusion


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def fusion_to_text(fusion: Fusion) -> str:
    """The fusion as text, one tensor or expr per line."""
    title = "Fusion" if fusion.name is None else f"Fusion {fusion.name}"
    lines = [
        f"{title}: {_count(len(fusion.inputs), 'input')}, {_count(len(fusion.exprs), 'expr')}, "
        f"{_count(len(fusion.outputs), 'output')}",
        "inputs:",
        *(f"  {tensor}" for tensor in fusion.inputs),
        "exprs:",
        *(f"  {expr}" for expr in fusion.exprs),
        "outputs:",
        *(f"  {tensor}" for tensor in fusion.outputs),
    ]
    if fusion.constraints:
        lines.append("constraints:")
        lines.extend(f"  {constraint}" for constraint in fusion.constraints)
    return "\n".join(lines)

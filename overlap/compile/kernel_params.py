"""Checking the user's ``kernel_params`` against the program's generated kernels.

``kernel_params`` names generated kernels (``{"k0": params}``, or a strategy of the
kernel's scheduler, ``{"k0": "warp_specialized"}``). A name the program has no generated
kernel for, or a strategy its scheduler lacks, is refused at compile time on every rank
alike, never ignored: a typo would otherwise leave the heuristics' choice in place
silently. Where the program evaluates compute (``kernels="auto"`` off CUDA), the names
are those the same lowering gives its generated kernels (``lower_naming_kernels``).
"""

from __future__ import annotations

from collections.abc import Mapping


def check_kernel_params(
    kernel_params: Mapping[str, object], generated: Mapping[str, object]
) -> None:
    """Every kernel named in ``kernel_params`` is one of ``generated`` (scheduler by
    kernel name), and a strategy named there is one its scheduler has; ``ValueError``
    otherwise."""
    for name, override in kernel_params.items():
        scheduler = generated.get(name)
        if scheduler is None:
            raise ValueError(
                f"kernel_params[{name!r}] = {override!r}: this program has no generated "
                f"kernel {name!r} (generated: {sorted(generated) or 'none'}; see "
                "print(executor.program))"
            )
        if not isinstance(override, str):
            continue
        strategies = scheduler.strategies
        if override not in strategies and override != "auto":  # "auto": the heuristics'
            raise ValueError(
                f"kernel_params[{name!r}] = {override!r}: the {scheduler.name} "
                f"scheduler's strategies are {list(strategies)} (or 'auto')"
            )

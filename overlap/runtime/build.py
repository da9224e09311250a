"""A fusion compiled for the device this rank runs on, checked against it.

``compile_for_device`` is what an executor compiles at construction (alone, before the
ranks agree on the outcome): the user's choice of kernels checked against the device
(generated kernels on CPU need Triton's interpreter, and on CUDA must not run in it),
the figures of this device (``planning_figures``), a ``CompiledProgram`` given
instead of a fusion checked against the world and the device, a copy-engine program
refused off CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fusion.definition import FusionDefinition
from fusion.ir import Fusion
from overlap.comm.communicator import Communicator
from overlap.comm.measure import device_figures
from overlap.compile.kernel_params import check_kernel_params
from overlap.compile.pipeline import CompiledProgram, compile_program
from overlap.ir import Transport
from overlap.plan.figures import HardwareFigures
from overlap.plan.planner import OverlapOptions, copy_engine_refused
from schedulers.runtime import interpreted
from sharding.errors import ShardingError
from sharding.layout import is_placed

KERNELS = ("auto", "generated", "reference")


def rank_device(communicator: Communicator | None) -> torch.device:
    """Where this rank runs: its communicator's device; alone, the GPU when there is one."""
    if communicator is not None:
        return communicator.device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def is_sharded(fusion: Fusion | FusionDefinition | CompiledProgram) -> bool:
    """Whether ``fusion`` places a tensor on a device mesh (runs over several ranks)."""
    if isinstance(fusion, CompiledProgram):
        return fusion.sharded
    return is_placed(fusion.fusion if isinstance(fusion, FusionDefinition) else fusion)


def planning_figures(
    fusion: Fusion | FusionDefinition | CompiledProgram,
    device: torch.device,
    communicator: Communicator | None,
    figures: HardwareFigures | None,
) -> HardwareFigures | None:
    """The figures the planner plans ``fusion`` with here: the user's, else this
    device's (``overlap.comm.measure.device_figures``: recorded, or measured with the
    peers once and kept); None for a ``CompiledProgram`` (already planned). Collective
    for a placed fusion on GPUs: called on every rank before anything that may fail on
    one rank alone."""
    if figures is not None or isinstance(fusion, CompiledProgram):
        return figures
    return device_figures(device, communicator if is_sharded(fusion) else None)


def compile_for_device(
    fusion: Fusion | FusionDefinition | CompiledProgram,
    device: torch.device,
    communicator: Communicator | None,
    options: OverlapOptions | None,
    figures: HardwareFigures | None,
    kernels: str,
    cuda_graph: bool,
    kernel_params: Mapping[str, object] | None,
) -> CompiledProgram:
    """``fusion`` compiled (or a ``CompiledProgram`` checked) for this rank's ``device``
    in the communicator's world, planned with ``figures`` (``planning_figures``);
    ``ValueError``/``ShardingError`` where it cannot run."""
    generated = _generates(kernels, device)
    if is_sharded(fusion) and communicator is None:
        raise ShardingError("a fusion placed on device meshes needs a Communicator")
    world = communicator.world_size if communicator else 1
    kernel_params = dict(kernel_params or {})
    # kernels="reference" generates nothing: params named for generated kernels are
    # refused; "auto" off CUDA checks them against the kernels it would generate
    if kernels == "reference":
        check_kernel_params(kernel_params, {})
    if isinstance(fusion, CompiledProgram):
        compiled = fusion
        if options is not None or figures is not None:
            raise ValueError(
                "a CompiledProgram is already planned: give options and figures to compile_program"
            )
        if compiled.schedule != generated:
            raise ValueError(
                f"kernels={kernels!r} {'generates' if generated else 'evaluates'} compute "
                f"on {device.type}, but the program was compiled with "
                f"schedule={compiled.schedule}: compile it as this rank runs it"
            )
        _check_compiled_params(compiled, kernels, kernel_params)
    else:
        replayed = cuda_graph and device.type == "cuda"
        compiled = compile_program(fusion, world, options, figures, schedule=generated,
                                   replayed=replayed, kernel_params=kernel_params)  # fmt: skip
    if compiled.world_size > world:
        raise ShardingError(
            f"the program was compiled for {compiled.world_size} ranks; this world has {world}"
        )
    if Transport.COPY_ENGINE in compiled.host.transports() and device.type != "cuda":
        name = compiled.host.fusion.name or "the fusion"
        raise copy_engine_refused(f"{name} is planned with it and this rank runs on {device}")
    return compiled


def _check_compiled_params(
    compiled: CompiledProgram, kernels: str, kernel_params: Mapping[str, object]
) -> None:
    """``kernel_params`` given with a ``CompiledProgram``: checked against the kernels it
    generates (or, evaluating, was checked to name at compile time). A program that
    evaluates and was compiled without them cannot tell its would-be kernels' names:
    refused, never ignored."""
    if not kernel_params:
        return
    if not compiled.schedule and not compiled.generated:
        raise ValueError(
            f"kernel_params {sorted(kernel_params)}: this CompiledProgram evaluates compute "
            "and was compiled without kernel_params, so it cannot check their names: give "
            "them to compile_program(..., kernel_params=...)"
        )
    check_kernel_params(kernel_params, compiled.generated)


def _generates(kernels: str, device: torch.device) -> bool:
    """Whether compute runs as generated kernels here; refuses a setting that cannot."""
    if kernels not in KERNELS:
        raise ValueError(f"kernels must be auto, generated or reference, got {kernels!r}")
    if kernels == "generated" and device.type != "cuda" and not interpreted():
        raise ValueError(
            "generated kernels on CPU run in Triton's interpreter: set "
            "TRITON_INTERPRET=1 before starting Python"
        )
    generated = kernels == "generated" or (kernels == "auto" and device.type == "cuda")
    if generated and device.type == "cuda" and interpreted():
        raise ValueError("TRITON_INTERPRET=1 would run generated kernels in Triton's CPU "
                         "interpreter, not compiled: unset it on GPUs")  # fmt: skip
    return generated

"""Look at generated kernels as the GPU will run them, on a machine without one.

Triton compiles for a named architecture without a device (its wheel carries
``ptxas``), so the PTX of a generated kernel can be read anywhere. What matters most
for a memory-bound kernel is the width of its global loads and stores: a 16-bit
``ld.global.b16`` per element moves a fraction of what a 128-bit ``ld.global.v4.b32``
does. ``access_widths`` counts them; tests assert that aligned kernels use 128-bit
accesses, so a change that loses vectorization fails on CPU.

Compiling needs a real (not interpreted) Triton: run it in a process without
``TRITON_INTERPRET=1``. ``python benchmarks/kernel_ptx.py`` prints the widths of the
benchmark kernels (``benchmarks/kernels.py``) for sm_90.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from schedulers.base import Scheduler
from schedulers.codegen import COMPILE_OPTIONS
from schedulers.runtime import interpreted

_POINTERS = {
    "tl.float64": "*fp64",
    "tl.float32": "*fp32",
    "tl.bfloat16": "*bf16",
    "tl.float16": "*fp16",
    "tl.int64": "*i64",
    "tl.int32": "*i32",
    "tl.int8": "*i8",
    "tl.uint8": "*u8",
    "tl.int1": "*i1",
}
_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
# An asynchronous copy from global to shared memory (a pipelined loop's loads): its size
# in bytes is the third operand.
_ASYNC_COPY = re.compile(r"\bcp\.async\.\w+\.shared\.global\s*\[[^\]]*\],\s*\[[^\]]*\],\s*(\w+)")


def _require_compiler() -> None:
    if interpreted():
        raise RuntimeError(
            "schedulers.ptx compiles kernels: run it in a process without TRITON_INTERPRET=1"
        )


def _load(source: str, name: str, folder: Path):
    path = folder / f"ptx_{abs(hash(source)):x}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def compiled(
    source: str,
    name: str,
    pointers: dict[str, str],
    constants: dict[str, int],
    num_warps: int,
    arch: int = 90,
    descriptors: dict[str, str] | None = None,
    integers: str = "i64",
    options: dict | None = None,
) -> dict:
    """Kernel ``name`` in ``source`` compiled for ``sm_<arch>``: its assembly by kind
    (``"ptx"``, ``"cubin"``).

    ``pointers``: pointer argument -> Triton element type (``"tl.bfloat16"``); they are
    taken 16-byte aligned, as Triton assumes for a tensor whose address allows it.
    ``descriptors``: TMA descriptor argument -> its Triton type
    (``"tensordesc<bf16[1, 8192]>"``, a block of one row of 8192).
    Other non-constexpr arguments are 64-bit integers no fact is known of (as
    ``do_not_specialize`` makes them), or of type ``integers`` (``"i32"``: as Triton
    launches an integer argument below 2**31; TMA offsets must be 32-bit).
    ``options``: compile options beyond ``COMPILE_OPTIONS`` (``KernelSource.options``:
    ``enable_fp_fusion`` for a normalization kernel whose params say ``contract``).
    """
    _require_compiler()
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    with tempfile.TemporaryDirectory(prefix="overlap_ptx_") as folder:
        kernel = _load(source, name, Path(folder))
        signature = {}
        descriptors = descriptors or {}
        for argument in kernel.arg_names:
            if argument in descriptors:
                signature[argument] = descriptors[argument]
            elif argument in pointers:
                signature[argument] = _POINTERS[pointers[argument]]
            elif argument in constants:
                signature[argument] = "constexpr"
            else:
                signature[argument] = integers
        names = kernel.arg_names
        aligned = {(names.index(a),): [["tt.divisibility", 16]] for a in names
                   if a in pointers and a not in descriptors}  # fmt: skip
        fixed = {(names.index(a),): value for a, value in constants.items()}
        result = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=fixed, attrs=aligned),
            target=GPUTarget("cuda", arch, 32),
            options={"num_warps": num_warps, **COMPILE_OPTIONS, **(options or {})},
        )
        return result.asm


def registers(cubin: bytes) -> int:
    """The registers a thread of the kernel in ``cubin`` (``compiled(...)["cubin"]``)
    takes, what bounds how many of its programs an SM holds: read by the ``cuobjdump``
    that Triton's wheel carries."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory(prefix="overlap_cubin_") as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        usage = subprocess.run([str(tool), "-res-usage", str(path)], capture_output=True,
                               text=True, check=True).stdout  # fmt: skip
    found = re.search(r"\bREG:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no register count: {usage[-500:]}")
    return int(found.group(1))


def access_widths(ptx: str) -> dict[str, dict[int, int]]:
    """Global loads (asynchronous copies to shared memory included) and stores of ``ptx``
    by width in bits: ``{"loads": {128: 16}, ...}``."""
    counts = {"loads": Counter(), "stores": Counter()}
    for kind, modifiers in _ACCESS.findall(ptx):
        parts = modifiers.split(".")
        lanes = next((int(p[1:]) for p in parts if re.fullmatch(r"v\d", p)), 1)
        bits = next(int(p[1:]) for p in reversed(parts) if re.fullmatch(r"[bsuf]\d+", p))
        counts["loads" if kind == "ld" else "stores"][lanes * bits] += 1
    for size in _ASYNC_COPY.findall(ptx):
        counts["loads"][8 * int(size, 0)] += 1
    return {kind: dict(sorted(c.items())) for kind, c in counts.items()}


def instructions(ptx: str) -> Counter:
    """The instructions of ``ptx`` by opcode (``"cvt.rn.bf16x2.f32"``), predicates dropped."""
    opcodes = Counter()
    for line in ptx.splitlines():
        text = line.strip()
        if not text or text.startswith(("//", ".", "$", "{", "}", ")", "(")):
            continue
        if text.startswith("@"):
            text = text.split(None, 1)[1] if " " in text else ""
        opcode = text.split(None, 1)[0].rstrip(";") if text else ""
        if opcode and not opcode.endswith(":"):
            opcodes[opcode] += 1
    return opcodes


def kernel_widths(
    scheduler: Scheduler, plan, params, shape: list[int], aligned: bool, arch: int = 90
) -> dict[str, dict]:
    """For each kernel ``scheduler`` generates for ``plan``, ``params`` and the shape
    ``shape`` of ``plan.space``: its ``access_widths``, its instruction count
    (``"instructions"``), how many of them convert to bf16 rounding to nearest
    (``"bf16_conversions"``) and how many are fused multiply-adds
    (``"fused_multiply_adds"``: none, see ``COMPILE_OPTIONS``, but in a kernel whose
    ``options`` allow them) or flush subnormals to
    zero (``"flush_to_zero"``: the fp4 decoder needs them kept), and its asynchronous
    copies to shared memory (``"async_copies"``: a pipelined loop's loads)."""
    result = {}
    for kernel in scheduler.kernels(plan, params, shape, aligned):
        ptx = compiled(kernel.source, kernel.name, kernel.pointers, kernel.constants,
                       kernel.num_warps, arch, options=kernel.options)["ptx"]  # fmt: skip
        opcodes = instructions(ptx)
        result[kernel.name] = {
            **access_widths(ptx),
            "instructions": sum(opcodes.values()),
            "bf16_conversions": sum(n for op, n in opcodes.items() if op.startswith("cvt.rn.bf16")),
            "fused_multiply_adds": sum(n for op, n in opcodes.items() if op.startswith("fma")),
            "flush_to_zero": sum(n for op, n in opcodes.items() if ".ftz" in op),
            "async_copies": len(_ASYNC_COPY.findall(ptx)),
        }
    return result

"""A split row's exchange of partial reductions: the device functions a kernel's source
defines for it, written for the slots they touch, and what the kernel's generator
(``codegen.Generator``) emits around them: the walk's per-row names and prefetch
(``exchange_step``), a level's partial reductions exchanged and combined in a fixed order
(``reduce_split``; a variance with its mean by Chan's combination).

The programs that share a row each reduce their slice of it, then exchange those
partials through tagged 64-bit slots in global memory (the high 32 bits the row's tag,
the low the float32's bits): a program posts its partials (``post_source``), then waits
until every program's slots of the level carry the row's tag and reads them
(``wait_source``). Both run elementwise over the rows' values in the layout the
reductions left them in, so no value changes layout: with one row a block the first
thread posts, each lane of every warp polls one word and shuffles give every lane
every word; otherwise every thread that holds a row posts it and loads every word.
Before, a block of (parts, partials) words was spread over the threads and gathered by
reductions across threads and warps (layout conversions through shared memory, a
barrier each): about a quarter of the split kernel's warp time, profiled on H200. Now
LayerNorm backward reads 0.70 of copy against 0.61 at 8192x16384 (``benchmarks/RESULTS.md``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fusion.dtypes import float32
from fusion.exprs import VarMeanOp
from fusion.ir import TensorView
from schedulers.codegen import COMBINE, Emitter, reduce_call
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.normalization.heuristics import NormalizationParams
from schedulers.normalization.variance import slice_count, slice_moments
from schedulers.runtime import cdiv, next_power_of_two

if TYPE_CHECKING:  # the generator calls these; they emit through it
    from schedulers.normalization.codegen import Generator, Step

# Rows of slots a group uses in turn: a program is at most one row ahead of the others
# (``exchange_partials`` says why)
KEPT_ROWS = 2
# The clusters a split row's programs may form: up to the portable 8, and 16 (beyond it,
# allowed on sm_90 where the launch asks for it: Triton's launcher does at 16 only); one
# program alone has nothing to exchange (and ``BoundKernel`` launches no cluster of one)
CLUSTER_SIZES = (2, 3, 4, 5, 6, 7, 8, 16)
# The dynamic shared memory follows the static: a TMA tile's buffer in it must stay on a
# 1024-byte boundary (128-byte swizzling), so the static words take a multiple of that.
# With 64 bytes of words, the H200 faulted (misaligned address) in softmax forward's
# split row through TMA at 48 columns (check_gpu).
STATIC_ALIGN_BYTES = 1024
# Every thread of a cluster's programs waits for all: their stores before it seen after it
CLUSTER_BARRIER = "barrier.cluster.arrive.release; barrier.cluster.wait.acquire;"
# The exchange words' name in a cluster's kernel (declared by ``cluster_start_source``)
EXCHANGE_WORDS = "xwords"


def exchange_slots(plan: NormalizationPlan, params: NormalizationParams, groups: int) -> int:
    """The int64 slots a split row's programs exchange partial reductions through:
    a group's, ``KEPT_ROWS`` rows' worth, for each level of reductions, program,
    reduction of the level and row of the block."""
    rounds = len(plan.exchanges)
    return (groups * KEPT_ROWS * rounds * params.parts * exchange_width(plan)
            * params.block_rows)  # fmt: skip


def exchange_width(plan: NormalizationPlan) -> int:
    """Slots a program writes a round, per row of its block: the most partials a
    level exchanges, to a power of two."""
    return next_power_of_two(max(plan.exchanges.values()))


def post_source(name: str, count: int, rows: int, parts: int = 0, width: int = 0,
                exchange_bytes: int = 0) -> str:  # fmt: skip
    """``name(pointer, word, tag, v0, ...)``: the ``count`` values ``v`` (a float32's bits,
    int32) stored with ``tag`` (int32) in the high half at ``pointer + k * rows`` (int64
    words); with ``exchange_bytes`` (a cluster's exchange of ``parts`` programs, each
    program's words: ``cluster_exchange``) into every program's words instead, at
    ``word + (rank * width + k) * rows`` (``rank``: this program's in the cluster):
    compiled, in their shared memory, from ``parts`` threads at once with one row a
    block; interpreted, in the blocks of ``exchange_bytes`` that follow ``pointer``, one
    a program of the group, in the same layout (the words' arithmetic runs on a CPU).
    It returns zeros (int32) for the wait to take: the wait follows the post by a
    dependency, not by its side effects (``wait_source``). The interpreter exchanges
    the words atomically. On a GPU, at GPU scope:
    - one row a block (every thread holds it): relaxed atomic exchanges from the first
      thread. Relaxed stores instead: 0.34 of copy against 0.70 (LayerNorm backward
      8192x16384, H200), 0.52 against 0.71 (RMSNorm backward 4096x65536), with the
      lanes' polls of ``wait_source``; the same words from every thread that holds them
      (8 warps) 0.36 stored, 0.20 exchanged (``results/norms_split_post*_h200*.json``);
    - several rows a block (a thread holds some of them): relaxed stores from every
      thread that holds the row (correct, not fast: never chosen, forced only)."""
    values = ", ".join(f"v{k}" for k in range(count))
    if exchange_bytes:  # into every program's words: those of this program's part
        constraints, operands = "=r,r,r" + ",r" * count, f"word, tag, {values}"
        lanes = rows == 1  # program p's words from thread p; else every holder, all
        peers = ["t"] if lanes else [str(peer) for peer in range(parts)]
        stores = (
            (f".reg .pred q; .reg .b32 t; mov.u32 t, %tid.x; setp.ge.u32 q, t, {parts}; "
             "@q bra DONE; " if lanes else "")
            + ".reg .b32 r, n; " + _exchange_words("$1")
            + f"mov.u32 n, %cluster_ctarank; mad.lo.u32 a, n, {8 * width * rows}, a; "
            + " ".join(f"mapa.shared::cluster.u32 r, a, {peer}; " + " ".join(
                f"mov.b64 w, {{${k + 3}, $2}}; "
                f"st.relaxed.cluster.shared::cluster.b64 [r+{8 * k * rows}], w;"
                for k in range(count)) for peer in peers)
            + (" DONE:" if lanes else "")
        )  # fmt: skip
        # interpreted: each program's block, this program's part of the words
        here = f"word + tl.program_id(0) % {parts} * {width * rows}"
        targets = [f"{peer * exchange_bytes // 8 + k * rows} + {here}"
                   for peer in range(parts) for k in range(count)]  # fmt: skip
    else:
        constraints, operands = "=r,l,r" + ",r" * count, f"pointer, tag, {values}"
        if rows == 1:  # the first thread only
            stores = " ".join(f"mov.b64 w, {{${k + 3}, $2}}; "
                              f"atom.relaxed.gpu.global.exch.b64 w, [$1+{8 * k}], w;"
                              for k in range(count))  # fmt: skip
            stores = (".reg .pred q; .reg .b32 t; mov.u32 t, %tid.x; setp.ne.u32 q, t, 0; "
                      f"@q bra DONE; {stores} DONE:")  # fmt: skip
        else:  # every thread holding the row
            stores = " ".join(f"mov.b64 w, {{${k + 3}, $2}}; "
                              f"st.relaxed.gpu.global.b64 [$1+{8 * k * rows}], w;"
                              for k in range(count))  # fmt: skip
        targets = [f"{k * rows}" for k in range(count)]
    interpreted = "".join(
        f"        tl.atomic_xchg(pointer + {target}, (tag.to(tl.int64) << 32) | "
        f'v{index % count}.to(tl.uint32, bitcast=True).to(tl.int64), sem="relaxed")\n'
        for index, target in enumerate(targets)
    )
    return (
        f"@triton.jit\ndef {name}(pointer, word, tag, {values}):\n"
        f"    if INTERPRETED:\n{interpreted}        return tag * 0 + word * 0\n"
        "    else:\n"
        f'        return tl.inline_asm_elementwise("{{ .reg .b64 w; {stores} mov.u32 $0, 0; }}", '
        f'"{constraints}", [{operands}], '
        "dtype=tl.int32, is_pure=False, pack=1)\n"
    )


def wait_source(name: str, parts: int, width: int, count: int, rows: int,
                cluster: bool = False, summed: bool = False) -> str:  # fmt: skip
    """``name(pointer, word, tag)``: the low halves (int32) of the int64 words at ``pointer +
    (p * width + k) * rows`` for each of ``parts`` programs ``p`` and ``count`` partials
    ``k`` (in that order), once each word's high half equals ``tag``; with ``cluster`` (a
    cluster's exchange), compiled, this program's own exchange words ``word + (p *
    width + k) * rows`` in shared memory, which every program of the cluster stores
    into (``post_source``; interpreted, its block's, which ``pointer`` points into). The
    interpreter polls every slot of the round at once, in a loop. On a GPU, relaxed
    loads (at GPU scope; a cluster's at cluster scope), in one spin: no loop in the
    kernel's IR (a walk that waits is still a loop Triton's pipeliner takes).
    - One row a block (every thread of a warp holds it), at most 32 words: each lane of
      a warp polls one word (one load a warp a poll), the warp polls until every lane
      has its tag (a vote), then each word goes to every lane by a shuffle. Every thread
      loading every word took 0.35 of copy against 0.66 (LayerNorm backward
      4096x65536, 16 words, H200): the same line polled 16 times a warp.
    - Otherwise each thread loads every word and again until every tag is there.

    With ``summed`` (``sums_in_wait``: partials that are sums, one row a block, at most 32
    words), the float32 sum of each partial's ``parts`` words instead, added in
    ``combine_in_order``'s order (so the same bits), the words shuffled as the sums take
    them: ``count`` values leave the spin instead of ``parts * count`` (LayerNorm
    backward over 16 programs: 32 words live at once took its kernel from 168 registers a
    thread to 222, sm_90).

    Declared pure: Triton copies an elementwise op into each layout its users want
    (removing layout conversions) and cannot remove a copy with side effects, so an
    impure wait was left spinning 7 times a row, 6 of them for nothing (LayerNorm
    backward, compiled for sm_90). Pure, the copies no one reads are removed; the
    caller makes ``pointer`` depend on the post's result, so the wait cannot move
    ahead of it."""
    offsets = [(p * width + k) * rows for p in range(parts) for k in range(count)]
    words = len(offsets)
    outputs = count if summed else words  # then the pointer (or word) and the tag
    tag = f"${outputs + 1}"
    # where the words are: a global pointer, or this program's shared exchange words
    load = "ld.relaxed.cluster.shared::cta.b64" if cluster else "ld.relaxed.gpu.global.b64"
    at = _exchange_words(f"${outputs}") if cluster else f".reg .b64 a; mov.b64 a, ${outputs}; "
    if summed and not (rows == 1 and words <= 32):
        raise ValueError(f"{name}: summed in the wait needs one row a block and at most 32 words")
    if rows == 1 and words <= 32:
        shuffles = (
            _summed_shuffles(parts, count)
            if summed
            else " ".join(f"shfl.sync.idx.b32 ${k}, lo, {k}, 0x1f, -1;" for k in range(words))
        )
        step = ("mul.lo.u32 i, i, 8; add.u32 a, a, i; " if cluster
                else ".reg .b64 o; mul.wide.u32 o, i, 8; add.s64 a, a, o; ")  # fmt: skip
        body = (  # this lane's word: (lane % words) -> its program and partial
            f".reg .pred p; .reg .b32 i, j, lo, hi; .reg .b64 v; {at}mov.u32 i, %laneid; "
            f"rem.u32 i, i, {words}; div.u32 j, i, {count}; rem.u32 i, i, {count}; "
            f"mad.lo.u32 i, j, {width}, i; {step}"
            f"WAIT: {load} v, [a]; mov.b64 {{lo, hi}}, v; "
            f"setp.eq.u32 p, hi, {tag}; vote.sync.all.pred p, p, -1; @!p bra WAIT; {shuffles}"
        )
    else:
        loads = " ".join(f"{load} w{k}, [a+{8 * at}];" for k, at in enumerate(offsets))
        checks = " ".join(f"mov.b64 {{${k}, h}}, w{k}; setp.ne.u32 p, h, {tag}; @p bra WAIT;"
                          for k in range(words))  # fmt: skip
        body = f".reg .pred p; .reg .b32 h; .reg .b64 w<{words}>; {at}WAIT: {loads} {checks}"
    constraints = ",".join(["=f" if summed else "=r"] * outputs + ["r" if cluster else "l", "r"])
    operands = "word, tag" if cluster else "pointer, tag"
    names = ", ".join(f"w{k}" for k in range(words))
    # the interpreter: every slot of the round polled at once (unused ones carry tag 0),
    # each word picked out as integer bits (one word at a time: 76 s against 9 s, forced
    # LayerNorm forward over 32 programs of 2 rows)
    # (a power of two of them: arange's; those past the round's are not loaded)
    interpreted = (
        f"        slots = tl.arange(0, {next_power_of_two(parts * width)})\n"
        f"        there = slots < {parts * width}\n"
        f"        live = ((slots % {width}) < {count}) & there\n"
        f"        words = pointer[:, None] + (slots * {rows})[None, :]\n"
        "        tags = tl.where(live, tag.to(tl.int64), 0)[None, :]\n"
        "        got = tl.load(words, mask=there[None, :], other=0, volatile=True)\n"
        "        while tl.max(tl.ravel(((got >> 32) != tags).to(tl.int32)), 0) != 0:\n"
        "            got = tl.load(words, mask=there[None, :], other=0, volatile=True)\n"
        + "".join(f"        w{k} = tl.sum(tl.where(slots[None, :] == {at // rows}, got, 0), 1)"
                  ".to(tl.int32)\n" for k, at in enumerate(offsets))
    )  # fmt: skip
    kind = "tl.float32" if summed else "tl.int32"
    dtype = kind if outputs == 1 else f"({', '.join([kind] * outputs)})"
    if summed:  # the words as float32s, each partial's added as the asm adds them
        interpreted += "".join(f"        w{k} = w{k}.to(tl.float32, bitcast=True)\n"
                               for k in range(words))  # fmt: skip
        sums = []
        for k in range(count):
            tree = _pairwise([f"w{p * count + k}" for p in range(parts)], f"s{k}_")
            interpreted += "".join(f"        {out} = {a} + {b}\n" for out, a, b in tree)
            sums.append(tree[-1][0] if tree else f"w{k}")
        names = ", ".join(sums)
    return (
        f"@triton.jit\ndef {name}(pointer, word, tag):\n"
        f"    if INTERPRETED:\n{interpreted}        return {names}\n"
        "    else:\n"
        f'        return tl.inline_asm_elementwise("{{ {body} }}", "{constraints}", '
        f"[{operands}], dtype={dtype}, is_pure=True, pack=1)\n"
    )


def _pairwise(values: list[str], prefix: str) -> list[tuple[str, str, str]]:
    """The fixed order a split row's partials are combined in (``combine_in_order``, and
    the summed wait's additions): pairs of neighbours, then pairs of those, a leftover
    carried to the end; as (result, left, right) names, results named ``prefix`` and a
    number, the last one the total."""
    steps: list[tuple[str, str, str]] = []
    while len(values) > 1:
        pairs = []
        for a, b in zip(values[::2], values[1::2], strict=False):
            pairs.append(f"{prefix}{len(steps)}")
            steps.append((pairs[-1], a, b))
        values = pairs + values[len(pairs) * 2 :]
    return steps


def _summed_shuffles(parts: int, count: int) -> str:
    """The summed wait's asm after its spin: for each partial ``k``, the words of programs
    0..parts-1 (lane ``p * count + k``'s ``lo``) shuffled to every lane as the pairwise
    additions need them, added (``add.rn.f32``) into output ``$k``."""
    lines = [f".reg .f32 f<{parts * count + 1}>;"]
    taken: set[str] = set()

    def fetch(value: str) -> None:  # a word, shuffled in the first time it is needed
        if value.startswith("f") and value not in taken:
            taken.add(value)
            lines.append(f"shfl.sync.idx.b32 i, lo, {value[1:]}, 0x1f, -1; mov.b32 {value}, i;")

    for k in range(count):
        lanes = [f"f{p * count + k}" for p in range(parts)]
        tree = _pairwise(lanes, f"t{k}_")
        if tree:
            lines.append(".reg .f32 " + ", ".join(out for out, _, _ in tree) + ";")
        for out, a, b in tree:
            fetch(a)
            fetch(b)
            lines.append(f"add.rn.f32 {out}, {a}, {b};")
        total = tree[-1][0] if tree else lanes[0]
        fetch(total)
        lines.append(f"mov.f32 ${k}, {total};")
    return " ".join(lines)


def sums_in_wait(plan: NormalizationPlan, params: NormalizationParams, ops: list[str]) -> bool:
    """Whether a round's wait adds each partial's words itself (``wait_source``'s
    ``summed``): a split row with column sums (a backward: the forwards keep the words,
    as measured) whose partials of the round are all sums (``ops``: their combines), one
    row a block, at most 32 words."""
    words = params.parts * len(ops)
    return (bool(plan.column_sums) and all(op == "add" for op in ops)
            and params.block_rows == 1 and words <= 32)  # fmt: skip


def cluster_exchange(plan: NormalizationPlan, params: NormalizationParams) -> int:
    """Bytes of shared memory a program of a cluster's exchange (``params.cluster``)
    receives the partial reductions in, as the global slots of one group
    (``exchange_slots``): ``KEPT_ROWS`` rows' worth, for each level, program, reduction of
    the level and row of the block, 8 bytes each, to ``STATIC_ALIGN_BYTES``. The kernel
    declares them itself (``EXCHANGE_WORDS``, static shared memory: the compiler's own
    is dynamic, and a kernel that takes none has no name for it); the launch makes room
    for them (``BoundKernel``'s ``shared``)."""
    return cdiv(8 * exchange_slots(plan, params, 1), STATIC_ALIGN_BYTES) * STATIC_ALIGN_BYTES


def _exchange_words(word: str) -> str:
    """PTX: ``a`` = the shared address of this program's 64-bit exchange word ``word`` (a
    register operand)."""
    return f".reg .b32 a, s; mov.u32 a, {EXCHANGE_WORDS}; shl.b32 s, {word}, 3; add.u32 a, a, s; "


def cluster_start_source(name: str, exchange_bytes: int) -> str:
    """``name(token)``: this program's ``exchange_bytes`` of exchange words declared (at the
    kernel's scope, once: the posts and waits name them) and zeroed (what the shared
    memory held before carries stale tags), then every thread of the cluster's programs
    waits for all (``barrier.cluster``) before any stores into another's words; returns
    zero (int32) for the posts to depend on. The interpreter's programs exchange through
    global memory, zeroed before the launch: nothing to do."""
    return (
        f"@triton.jit\ndef {name}(token):\n"
        "    if INTERPRETED:\n        return token * 0\n"
        "    else:\n"
        f'        return tl.inline_asm_elementwise(".shared .align {STATIC_ALIGN_BYTES} .b8 '
        f"{EXCHANGE_WORDS}"
        f"[{exchange_bytes}]; {{ .reg .pred p; .reg .b32 t, n, e; .reg .b64 z; mov.b64 z, 0; "
        "mov.u32 t, %tid.x; mov.u32 n, %ntid.x; "
        + _exchange_words("t")
        + f"mov.u32 e, {EXCHANGE_WORDS}; add.u32 e, e, {exchange_bytes}; "
        "shl.b32 n, n, 3; ZERO: setp.ge.u32 p, a, e; @p bra DONE; st.shared.b64 [a], z; "
        f'add.u32 a, a, n; bra ZERO; DONE: {CLUSTER_BARRIER} mov.u32 $0, 0; }}", "=r,r", [token], '
        "dtype=tl.int32, is_pure=False, pack=1)\n"
    )


def barrier_source(name: str) -> str:
    """``name(token)``: every thread of the cluster's programs waits until all have
    arrived (``barrier.cluster``): at the end, so that no program leaves while another
    may still store into its shared memory. The interpreter: nothing to wait for."""
    return (
        f"@triton.jit\ndef {name}(token):\n"
        "    if INTERPRETED:\n        return token * 0\n"
        "    else:\n"
        f'        return tl.inline_asm_elementwise("{{ {CLUSTER_BARRIER} mov.u32 $0, 0; }}", '
        '"=r,r", [token], '
        "dtype=tl.int32, is_pure=False, pack=1)\n"
    )


# A split row's walk: its inputs prefetched, its partial reductions exchanged and combined.
def exchange_step(generator: Generator, early: Emitter, step: Step, prefetch: bool) -> None:
    """The walk's per-row names of the exchange and, with ``prefetch``, the full
    inputs of this row taken from the loads the previous row issued (the first
    row's before the walk), the next row's issued at once."""
    emit = step.emit
    emit.line("xj = (row_block - group) // groups")  # this group's row count so far
    emit.line("xtag = tl.cast(xj + 1, tl.int32)")  # marks this row's slots
    if not generator.params.cluster:  # the group's first slots of the row (a cluster's
        # words are each program's own: ``exchange_partials``)
        emit.line(f"xrow = (tl.cast(group, tl.int64) * {KEPT_ROWS} + xj % {KEPT_ROWS}) * "
                  f"{len(generator.plan.exchanges)}")  # fmt: skip
    if not prefetch:
        return
    early.line("first = tl.cast(group, tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
    early.line("first_mask = (first < row_count)[:, None] & col_mask[None, :]")
    emit.line("ahead = (pid + groups) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)")
    emit.line("ahead_mask = (ahead < row_count)[:, None] & col_mask[None, :]")
    for tensor, pointer in generator.pointers.items():
        if generator.plan.kinds[tensor] != "full":
            continue
        name = emit.fresh("ahead")
        early.line(f"{name} = tl.load({pointer} + (first[:, None] * COLUMNS + "
                   "cols[None, :]), mask=first_mask, other=0)")  # fmt: skip
        raw = emit.assign(name, "raw")
        emit.line(f"{name} = tl.load({pointer} + (ahead[:, None] * COLUMNS + "
                  "cols[None, :]), mask=ahead_mask, other=0)")  # fmt: skip
        step.cache[tensor] = emit.loaded(raw, tensor.dtype)


def exchange_partials(
    generator: Generator, emit: Emitter, partials: list[str], level: int, summed: bool = False
) -> list[list[str]]:
    """Each of ``partials`` (this program's reduction of its slice, a float32 per row
    of the block) with the other programs' of the row: a list of ``parts`` float32s
    (BLOCK_ROWS,) each, in the order of the programs, for the caller to combine in a
    fixed order (``summed``: the wait adds them in that order, one float32 each). The
    program posts its slots (``post_source``: with one row
    a block its first thread), then its threads wait for the level's slots of every
    program to carry this row's tag (``wait_source``). The slots alternate
    between two rows: a program posts row j+2 after its first thread read every
    program's post of j+1, each made after that program's reductions of j+1, which
    none of its threads reaches before reading row j: a barrier of the block where
    the row's values are spread over the warps (a reduction across them), and one
    written after the wait where warps may hold copies of the row (a slice narrower
    than 256 columns a warp)."""
    plan, params = generator.plan, generator.params
    width, rows = exchange_width(plan), params.block_rows
    round_ = list(plan.exchanges).index(level)
    exchange_bytes = cluster_exchange(plan, params) if params.cluster else 0
    # the rows' first words, in the rows' layout (no conversion for the asm)
    if exchange_bytes:  # the row's first word of the round in each program's own words
        word = emit.assign(f"((xj % {KEPT_ROWS} * {len(plan.exchanges)} + {round_}) * PARTS "
                           f"* {width} * BLOCK_ROWS + rows - pid * BLOCK_ROWS).to(tl.int32) "
                           "+ xstart", "xword")  # fmt: skip
        # interpreted: the group's blocks of words in global memory, a block a program
        blocks = emit.assign(f"slots + tl.cast(group, tl.int64) * (PARTS * {exchange_bytes // 8})",
                             "xblocks")  # fmt: skip
        posts, waits = blocks, f"{blocks} + part * {exchange_bytes // 8} + {word}"
    else:  # the group's slots, this program's part of them
        word = "0"
        base = emit.assign(f"slots + (xrow + {round_}) * (PARTS * {width} * BLOCK_ROWS) + "
                           "(rows - pid * BLOCK_ROWS)", "xbase")  # fmt: skip
        posts, waits = f"{base} + part * ({width} * BLOCK_ROWS)", base
    post = generator.helper("xpost", post_source, len(partials), rows, params.parts, width,
                            exchange_bytes)  # fmt: skip
    bits = ", ".join(f"{partial}.to(tl.int32, bitcast=True)" for partial in partials)
    posted = emit.assign(f"{post}({posts}, {word}, xtag, {bits})")
    wait = generator.helper("xwait", wait_source, params.parts, width, len(partials), rows,
                            params.cluster, summed)  # fmt: skip
    words = [emit.fresh("xw") for _ in range(len(partials) if summed else
                                             params.parts * len(partials))]  # fmt: skip
    # after the post: its result added in
    emit.line(f"{', '.join(words)} = {wait}({waits} + {posted}, {word} + {posted}, xtag)")
    if params.block_columns < 256 * params.num_warps:  # copies of the row
        emit.line("tl.debug_barrier()")
    if summed:  # each partial's total, float32
        return [[word] for word in words]
    values = [emit.assign(f"{word}.to(tl.float32, bitcast=True)") for word in words]
    return [values[k :: len(partials)] for k in range(len(partials))]


def reduce_split(generator: Generator, step: Step, group: list[TensorView], level: int) -> None:
    """A level's reductions of a split row: this program's slice of each, then the
    whole row's, exchanged together. A variance comes with its mean: this slice's
    sum and sum of squares about the slice's mean, combined as Chan et al. combine
    partial variances (the mean, then each slice's squares plus its count times
    its mean's distance from the row's squared), so one round gives both."""
    emit = step.emit
    group = [t for t in group if t not in generator.row_cache]  # variances already done
    if not group:
        return
    plain = [t for t in group if not isinstance(t.definition, VarMeanOp)]
    # every term first, then their sums (LayerNorm backward's two: 0.62 of copy
    # against 0.51 with each summed before the next is computed; H200, 8192x16384)
    terms = [generator.term(step, tensor) for tensor in plain]
    # each alone: two at a time took 0.79 of copy against 0.81-0.82 (H100, LN bwd 16384)
    partials = [emit.assign(reduce_call(term, 1, COMBINE[op], keep_dims=False))
                for _, op, term, _ in terms]  # fmt: skip
    finishes: list = list(zip(plain, terms, strict=True))
    for tensor in group:
        producer = tensor.definition
        if isinstance(producer, VarMeanOp):  # the mean's level: both outputs
            value = emit.as_compute(generator.value(step, producer.inputs[0]), float32)
            partials += slice_moments(emit, value, generator.params.one_pass)
            finishes.append(producer)
    # plain reductions only (a variance's partials are combined by Chan's rule)
    ops = [COMBINE[op] for _, op, _, _ in terms]
    summed = plain == group and sums_in_wait(generator.plan, generator.params, ops)
    gathered = iter(exchange_partials(generator, emit, partials, level, summed))
    for item in finishes:
        if isinstance(item, VarMeanOp):
            _chan(generator, emit, item, next(gathered), next(gathered))
            continue
        tensor, (producer, op, _, accumulator) = item
        combined = combine_in_order(emit, COMBINE[op], next(gathered))
        reduced = emit.assign(f"{combined}[:, None]")
        generator.finish_reduced(producer, tensor, op, reduced, accumulator)


def _chan(generator: Generator, emit: Emitter, producer: VarMeanOp,
          totals: list[str], squares: list[str]) -> None:  # fmt: skip
    """A variance and its mean from every slice's sum and sum of squares about its
    own mean ((BLOCK_ROWS,) each, a slice's each), in a fixed order."""
    var, mean = producer.outputs
    total = emit.assign(f"{combine_in_order(emit, 'add', totals)}[:, None]")
    generator.finish_reduced(producer, mean, "sum", total, float32)
    row_mean = generator.means[producer]  # float32, unrounded: (BLOCK_ROWS, 1)
    terms = []
    for p, (slice_total, slice_squares) in enumerate(zip(totals, squares, strict=True)):
        count = emit.assign(slice_count(str(p)))
        local = emit.assign(f"{slice_total}[:, None] / tl.maximum({count}, 1.0)")
        spread = emit.assign(f"{local} - {row_mean}")
        terms.append(emit.assign(f"{slice_squares}[:, None] + {count} * {spread} * {spread}"))
    generator.finish_reduced(producer, var, "sum", combine_in_order(emit, "add", terms), float32)


def combine_in_order(emit: Emitter, combine: str, values: list[str]) -> str:
    """``values`` combined with ``combine`` ("add", "maximum", "minimum") in a fixed
    order, ``_pairwise``'s (the summed wait adds in the same): pairs of neighbours, then
    pairs of those (sums as ``+``: a call a pair costs the interpreter)."""
    names, total = {}, values[0]
    for out, a, b in _pairwise(values, "#"):  # "#": no variable's name
        a, b = names.get(a, a), names.get(b, b)
        total = emit.assign(f"{a} + {b}" if combine == "add" else f"{combine}({a}, {b})")
        names[out] = total
    return total

"""The split strategy's heuristics: a row too long for one program's registers split over
several programs that exchange their partial reductions (``exchange`` emits the
exchange), through global memory or, on Hopper, through a thread-block cluster's
distributed shared memory."""

from __future__ import annotations

from fusion.dtypes import bfloat16
from schedulers.hardware import HardwareProfile
from schedulers.normalization.analysis import NormalizationPlan
from schedulers.normalization.exchange import CLUSTER_SIZES
from schedulers.normalization.heuristics import (
    SPLIT,
    NormalizationParams,
    fast_memory,
    tma_refusal,
)
from schedulers.runtime import cdiv, cluster_launches, next_power_of_two

SPLIT_SLICE = 8192  # columns a program of a split forward (no column sums): the width at
# which one program's persistent row reaches 0.90-0.96 of copy (H200, RMSNorm, LayerNorm)
SPLIT_VALUES = 32  # values a thread a buffered row in a split row's program; 64 where
# the row keeps no column sums (a forward: H100, LayerNorm forward 4096x65536, 4 warps
# a slice of 8192 0.87 of copy against 0.60 with 8, commit 0cd9b33,
# norms_lnfwd_sweep_h100_0cd9b33.json; H200, 0.71 against 0.45, RMSNorm forward 0.80
# either way, norms_fwd65536_sweep_h200_cf2d605.json)
SPLIT_FORWARD_VALUES = 64
# A split forward's input (one of the full shape, no column sums) comes through TMA
# descriptors into shared memory, the walk pipelined this many stages deep (Triton's
# num_stages: two rows ahead), instead of the next row's load held in registers. 4096x
# 65536, against the prefetch: RMSNorm forward 0.85-0.88 of copy against 0.81 on H200,
# LayerNorm forward 0.89-0.90 against 0.86-0.87 on H100 (RMSNorm level, 0.90-0.92);
# two stages 0.69 for LayerNorm on H100, four 0.88 (results/norms_splitfwd_sweep_
# {h200,h100}_d9669bd.json, norms_split_poll_{h200,h100}_b1e13ab.json). A backward's are
# slower that way (RMSNorm 8192x16384, H200: 0.72-0.74 against 0.74-0.75 prefetched;
# LayerNorm 0.51-0.58 against 0.62; norms_split_poll_h200_b1e13ab.json).
SPLIT_TMA_STAGES = 3
# A split row with column sums (a backward): slices of this many columns (SPLIT_VALUES a
# thread: 4 warps), its inputs loaded by pointer, pipelined SPLIT_SUMS_STAGES rows deep,
# instead of 8192 over 8 warps with the next row prefetched (fraction of copy, H200 / H100,
# results/norms_split_pipelined_{h200,h100}_{1,2}_554e014.json): LayerNorm backward
# 8192x16384 0.80 / 0.90 against 0.70 / 0.84, 4096x65536 0.69 / 0.86 against 0.66 / 0.80;
# RMSNorm backward 4096x65536 0.76 / 0.90 against 0.71 / 0.86. Pipelined at 8192 over 8
# warps: 0.77 / 0.90 (16384), 0.69 / 0.87 (65536); 4 or 5 deep within 0.02 (RMSNorm up,
# LayerNorm down); 2 deep, and 16 values a thread for LayerNorm: lower.
SPLIT_SUMS_SLICE = 4096
SPLIT_SUMS_STAGES = 3
# Rows with column sums held by one multi-wave program from this many columns on are split
# too (RMSNorm backward at 16384: 16 warps, 32 values a thread, spilling a little):
# 8192x16384 0.81-0.82 / 0.91 of copy (H200 / H100) against 0.76-0.78 / 0.90-0.92. At
# 12288 (H200, 4096 rows) the multi-wave row read 0.78-0.79 against 0.74 split in three.
SPLIT_SUMS_FROM = 16384
# A split row with column sums keeps its bfloat16 inputs' bits across the exchange and
# widens them again after it (``rewiden``), its column sums added before it: 200 -> 128
# registers a thread (RMSNorm backward, 4096 columns a program; LayerNorm 234 -> 168), so
# more programs an SM, at most this many warps of them. H200, fraction of copy, against
# the float32s kept (two programs an SM; .devtmp A/B at 6b7528b,
# results/norms_rewiden_*_h200_6b7528b.json): RMSNorm backward 8192x16384 0.92 (three
# programs of 4 warps an SM; four: 0.87) against 0.81, 4096x65536 0.87 against 0.78,
# 8192x24576 0.91 against 0.82; LayerNorm backward 8192x16384 0.85 against 0.80,
# 8192x32768 0.85 against 0.79.
SPLIT_SUMS_WARPS_PER_SM = 12
# Held to 168 registers a thread instead (``max_registers``, ptxas's maxnreg, spilling),
# LayerNorm backward 4096x65536 read 0.78 of copy against 0.71 (H200, 0a585d5,
# results/norms_rewiden_lbwd64m_h200_0a585d5.json) while its wait handed 32 words to the
# kernel at once (222 registers); RMSNorm backward 8192x16384 (128 unheld) 0.88-0.89
# held against 0.92. The wait now adds each partial's words itself
# (``exchange.sums_in_wait``): 168 registers unheld, no cap.
# Two partials a row (LayerNorm backward's) whose words a round stay few (at most
# SPLIT_NARROW_WORDS): slices of SPLIT_SUMS_NARROW columns over 2 warps, twice the
# programs, as many warps an SM. H200, LayerNorm backward 8192x16384 (8 programs, 16
# words), fraction of copy: 0.868 / 0.869 / 0.869 against 0.850 / 0.854 / 0.851 in three
# runs (results/norms_rewiden_lbwd16{,m,n}_h200_*.json); H100 level (0.887 against 0.888,
# norms_rewiden_lbwd16n_h100_65fd7af.json). RMSNorm backward there (one partial) level
# on the H200 (0.914-0.916 against 0.919-0.920): kept in 4096-column slices.
SPLIT_SUMS_NARROW = 2048
SPLIT_NARROW_WORDS = 16
# A split row's programs with no column sums, exchanging one partial a round (RMSNorm
# forward's; softmax backward's, 0.97 of copy against 0.94 at 4096x65536 on the H200;
# softmax forward's two rounds, split when forced only, unmeasured), form a thread-block
# cluster on sm_90 and exchange through its distributed shared memory
# (``exchange.cluster_exchange``): this many clusters an SM walk the rows.
# H200 (results/norms_cluster_*_h200_cf04f06.json), against the exchange through global
# memory: RMSNorm forward 4096x65536 0.91 of copy against 0.87, 8192x65536 0.92 against
# 0.85; as many clusters as the device holds at once 0.72-0.83 (placed by cluster, the
# SMs' loads are uneven), one an SM 0.90-0.91. Two partials (LayerNorm's variance) with
# float32 weights stay on global memory: 4096x65536 0.82 either way, 8192x32768 0.80
# against 0.83; and the backwards: RMSNorm 8192x16384 0.80 against 0.81, LayerNorm
# 4096x65536 0.67-0.71 against 0.72 (.devtmp A/B probes, results/norms_cluster_ab_h200_*).
CLUSTERS_PER_SM = 2
# Two partials (LayerNorm forward's variance) form a cluster too where the weights are
# kept as their bits (three programs an SM fit: without the bits two, 0.80-0.82 of copy),
# this many programs an SM (whole clusters; fewer, or as many as the device holds at
# once, lose: the SMs' loads are uneven), each slice's variance in one reduction
# (``one_pass``). H200, fraction of copy against the exchange through global memory (two
# runs, .devtmp A/B probes at 420cf7d, results/norms_lncluster*_h200_420cf7d_*.json):
# 4096x65536 0.871 against 0.857-0.858, 8192x65536 0.890 against 0.864-0.868, 16384x
# 65536 0.892-0.893 against 0.865-0.866, 8192x32768 (clusters of 4) 0.873-0.875 against
# 0.862-0.865; in one pass 0.885-0.886, 0.898-0.900, 0.900, 0.881-0.883. 2048x65536 and
# 4096x32768 level (0.82-0.85). Programs an SM (8192x65536): 4, 6 0.74-0.76; 10, 12, 16
# 0.86-0.89; as many as the device holds at once 0.63. The H100 keeps the float32
# weights, on global memory (0.91-0.92).
CLUSTER_PROGRAMS_PER_SM = 8
# A split row with column sums (a backward) on fast memory forms a cluster too where a row has at
# least this many programs and a cluster holds them (6-8, 16), as many clusters as the device holds
# at once (the driver's count, ``occupancy.max_active_clusters``: 21 clusters of 16 programs of
# LayerNorm backward 4096x65536 on an H200, where 396 programs fit three an SM), each walking its
# rows to the end. Earlier runs of the backwards as clusters
# (results/norms_bwd_cluster_grid_h200_4c3902d_*.json: 0.63-0.75 of copy) had taken more clusters
# than the device holds: the rest ran in a second wave. H200, fraction of copy, against the exchange
# through global memory (.devtmp A/B probes at 56bf201,
# results/norms_bwd_clusters_{h200,h100}_56bf201.json): LayerNorm backward 4096x65536 0.818 against
# 0.797, 2048x65536 0.791 against 0.776, 8192x32768 0.908 against 0.862, 8192x16384 0.928 against
# 0.867, 16384x16384 0.963 against 0.904; RMSNorm backward 4096x65536 0.915-0.920 against
# 0.885-0.888, 8192x65536 0.924 against 0.891, 8192x32768 0.937-0.938 against 0.918 (level in the
# A/B of the built choice: 0.912-0.915 against 0.910-0.922,
# results/norms_bwd_clusters_ab_h200_5ae18e7.json), but 8192x16384 (clusters of 4) 0.875-0.877
# against 0.906-0.912 (99 clusters, as many programs as through global memory: 0.854). Fewer
# clusters lose (RMSNorm 8192x32768: 49 of 62, 0.884). Six programs a row
# (results/norms_bwd_clusters6_h200_cb7305c.json): LayerNorm backward 8192x24576 0.863 against
# 0.791, 8192x12288 (2048 columns a program) 0.882 against 0.800, RMSNorm backward 8192x24576 0.955
# against 0.906; seven (results/norms_bwd_clusters7_ab_h200_ab3a4c8.json): LayerNorm backward
# 8192x28672 0.838 against 0.773, 8192x14336 0.893 against 0.795, RMSNorm 8192x28672 0.948 against
# 0.914. Ten or twelve programs a row stay on global memory (no cluster holds them). On the H100
# they lose but at LayerNorm 4096x65536 (0.935 against 0.915; 8192x32768 0.888 against 0.939,
# RMSNorm 4096x65536 0.928 against 0.952): fast memory only.
CLUSTER_SUMS_PARTS = 6


def split_params(
    plan: NormalizationPlan,
    hardware: HardwareProfile,
    columns: int,
    parts: int | None = None,
) -> NormalizationParams | str:
    """A row split over ``parts`` programs, or why it cannot be: each program keeps its
    slice of the row (and of the column sums) in registers, exchanges its partial
    reductions with the others through tagged slots in global memory (a round a level of
    reductions, a row), and applies them to its slice; weights are loaded once. Without
    column sums and with one partial a row to exchange, on sm_90, a row's programs form
    a thread-block cluster exchanging through its shared memory, ``CLUSTERS_PER_SM`` of
    them an SM; with two partials (a variance) where the weights are kept as their bits,
    ``CLUSTER_PROGRAMS_PER_SM`` programs an SM, each slice's variance in one pass; with
    column sums on fast memory, where a row has ``CLUSTER_SUMS_PARTS`` programs or more
    and a cluster holds them (6-8 or 16), as many clusters as the device holds at once
    (counted at the launch).
    By default, at least two programs, and no more than a warp polls words at once (a
    row longer than that many slices takes wider ones, more warps):
    - with column sums, a program per ``SPLIT_SUMS_SLICE`` columns (as many as the row
      fills; ``SPLIT_SUMS_NARROW`` where two partials' words a round stay few), the
      walk's loads pipelined ``SPLIT_SUMS_STAGES`` rows deep;
    - without, a power of two of programs, one per ``SPLIT_SLICE`` columns, the one
      input's slices through TMA, pipelined ``SPLIT_TMA_STAGES`` stages deep where TMA
      can stride its rows, else the next row's inputs loaded before the exchange.
    First measured on H200 (``results/norms_split_h200.json``, commit ``215a8eb``): 8 warps
    a slice of 8192 columns, the next row prefetched; the constants say what replaced
    it. The programs of a row wait for each other, so the grid is never larger than the
    device holds at once (clusters aside: their programs run together)."""
    if hardware.arch and hardware.arch < 70:
        return f"polling the exchange needs sm_70 or later (sm_{hardware.arch})"
    other = [t for t in plan.levels if not t.dtype.is_floating or t.dtype.bits > 32]
    if other:
        return (f"{other[0]} ({other[0].dtype}): the exchange carries float32 partials; "
                "integer and float64 reductions are not split")  # fmt: skip
    sums = bool(plan.column_sums)
    full = plan.full_inputs
    # column sums: the bfloat16 inputs widened again after the exchange, fewer registers
    rewiden = sums and any(t.dtype is bfloat16 for t in full)
    partials = max(plan.exchanges.values())
    if parts is None:  # at most as many words a round as a warp polls at once (wait_source)
        most = max(1, hardware.warp_size // partials)
        if sums:  # slices wider where capped; as many as the row fills (3 at 12288)
            words = cdiv(columns, SPLIT_SUMS_NARROW) * partials  # a round's, narrow
            narrow = rewiden and partials > 1 and words <= SPLIT_NARROW_WORDS
            slice_ = SPLIT_SUMS_NARROW if narrow else SPLIT_SUMS_SLICE
            wide = max(slice_, next_power_of_two(cdiv(columns, most)))
            parts = max(2, cdiv(columns, wide))
        else:  # a power of two of them
            parts = max(2, min(next_power_of_two(cdiv(columns, SPLIT_SLICE)),
                               1 << (most.bit_length() - 1)))  # fmt: skip
    if parts < 1:
        return f"parts={parts}: at least one program a row"
    width = next_power_of_two(cdiv(max(columns, 1), parts))
    values = SPLIT_VALUES if sums else SPLIT_FORWARD_VALUES
    warps = max(1, min(16, width // (values * hardware.warp_size)))
    # measured on forwards: one full input, no column sums
    tma = (len(full) == 1 and not sums
           and tma_refusal(plan, hardware, columns, width) is None)  # fmt: skip
    prefetch = not sums and not tma and all(not t.dtype.storage_only for t in full)
    stages = SPLIT_TMA_STAGES if tma else SPLIT_SUMS_STAGES if sums else 1
    loads = (f", the input's slices loaded through TMA, pipelined {stages} stages deep" if tma
             else f", the inputs' slices pipelined {stages} rows deep" if sums
             else ", the next row's inputs loaded first" if prefetch else "")  # fmt: skip
    fast = fast_memory(hardware)  # the bits', a cluster's, contraction's
    # bfloat16 weights kept as their bits (below) where they may be: forwards on fast memory
    keep_bits = (
        not sums
        and fast
        and any(plan.kinds[t] == "column" and t.dtype is bfloat16 for t in plan.inputs)
    )
    # a cluster: one partial a round, or a variance's two with the weights as bits; with
    # column sums, on fast memory, CLUSTER_SUMS_PARTS programs a row or more
    cluster = (
        (sums and fast and parts >= CLUSTER_SUMS_PARTS
         or not sums and (partials == 1 or partials == 2 and plan.variance and keep_bits))
        and hardware.arch // 10 == 9
        and parts in CLUSTER_SIZES
        and cluster_launches()
    )  # fmt: skip
    # A split row without column sums (but a cluster exchanging one partial) keeps its
    # bfloat16 weights in registers as their bits, widened where used after the exchange
    # (``column_bits``; ``triton_math.widen_bf16_here``, which the compiler does not hoist
    # out of the walk): LayerNorm forward's weight and bias, 4096x65536, 255 -> 168
    # registers a thread (sm_90, Triton 3.6), three programs of 4 warps an SM instead of
    # two. H200, fraction of copy (.devtmp A/B, results/norms_column_bits_*_h200_*.json):
    # LayerNorm forward 4096x65536 0.86 against 0.82 (two programs an SM with the bits:
    # 0.77), 8192x65536 0.87 against 0.83, 2048x65536 0.84 against 0.81, 8192x32768 0.86
    # against 0.84; the weights read with each row instead 0.70. RMSNorm forward's cluster
    # (168 -> 128 registers) 0.90-0.91 against 0.91-0.92: not taken there. On the H100
    # (3000 GB/s) the bits lose: LayerNorm forward 4096x65536 0.83 against 0.91, 8192x65536
    # 0.82 against 0.90 (results/norms_column_bits_h100_f9ce1a6.json): fast memory only.
    # (These through global memory; LayerNorm's now a cluster: CLUSTER_PROGRAMS_PER_SM.)
    bits = keep_bits and not (cluster and partials == 1)
    # A variance's slices in one reduction each (``one_pass``) where a cluster exchanges
    # them (see CLUSTER_PROGRAMS_PER_SM)
    one_pass = cluster and plan.variance
    # Two partials a row with column sums (LayerNorm backward's), on fast memory: its
    # multiplies and adds contracted into fmas (``contract``; the reference rounds each
    # product, an fma does not: within the tolerance of the sums and bf16 outputs they
    # feed). H200, fraction of copy, two runs (.devtmp A/B, results/norms_contract_
    # {h200,h100}_*.json): 4096x65536 0.801 / 0.801 against 0.776 / 0.780, 8192x32768
    # 0.865 against 0.841-0.842, 8192x16384 0.873-0.874 against 0.869; RMSNorm backward
    # (one partial) level (0.887 / 0.904-0.906 against 0.883-0.884 / 0.905-0.909). On the
    # H100 LayerNorm 8192x16384 0.885-0.886 against 0.893-0.894, 65536 0.924-0.927
    # against 0.920-0.921: not taken there.
    # Every value it computes 16- or 32-bit floats: a code (fp8, fp4) or an exact value
    # (bool, an integer: a comparison, a rounding to integers) may come out otherwise
    # than the reference's, a float64 is not to lose bits. LayerNorm forward's cluster in
    # one pass too (its sums of squares, Chan's combination, the weight's product and the
    # bias; two runs, results/norms_lnfwd_contract_h200_2af968a_{1,2}.json): 8192x65536
    # 0.903-0.904 against 0.895, 16384x65536 0.902 against 0.890, 4096x65536 0.890-0.891
    # against 0.889, 8192x32768 0.880-0.881 against 0.871-0.879; contracted on global
    # memory in two passes it had needed 242 registers (0.79), in the cluster 168.
    computed = [*plan.outputs, *(t for e in plan.exprs for t in e.outputs)]
    contract = (
        ((sums and partials > 1) or one_pass)
        and fast
        and all(t.dtype.is_floating and t.dtype.bits in (16, 32) for t in computed)
    )
    # a cluster with column sums: as many as the device holds at once, known at its launch
    programs = (0 if cluster and sums
                else cluster_programs(parts, hardware.sm_count, partials) if cluster
                else sums_programs(parts, warps, hardware.sm_count) if rewiden
                else 0)  # fmt: skip
    why = (
        f"the row split over {parts} programs of {width} columns ({warps} warps, "
        f"{max(1, width // (warps * hardware.warp_size))} values a thread a buffer), "
        f"{len(plan.levels)} partial reductions exchanged a row{loads}"
        + ("; the inputs' bfloat16 bits kept across the exchange, widened again after it"
           if rewiden else "")
        + ("; the weights kept as their bfloat16 bits, widened where used" if bits else "")
        + ("; multiplies and adds contracted into fmas" if contract else "")
        + ("; each slice's variance in one reduction" if one_pass else "")
        + ("; a cluster a row's programs, exchanging through its shared memory, "
           + (f"{programs} programs" if programs
              else "as many clusters as the device holds at once") if cluster
           else f"; as many programs as the device holds at once, {programs} at most"
           if programs else "; as many programs as the device holds at once")
    )  # fmt: skip
    return NormalizationParams(1, width, warps, True, programs, stages, strategy=SPLIT,
                               column_registers=True, parts=parts, prefetch=prefetch,
                               tma=tma, cluster=cluster, rewiden=rewiden,
                               column_bits=bits, contract=contract, one_pass=one_pass,
                               why=why)  # fmt: skip


def sums_programs(parts: int, warps: int, sm_count: int) -> int:
    """A split row's programs with column sums exchanging through global memory on a
    device of ``sm_count`` SMs: at most ``SPLIT_SUMS_WARPS_PER_SM`` warps of them an SM,
    two groups of ``parts`` at least (the interpreter's)."""
    return max(2 * parts, sm_count * max(1, SPLIT_SUMS_WARPS_PER_SM // warps))


def cluster_programs(parts: int, sm_count: int, partials: int = 1) -> int:
    """A split row's programs launched as clusters of ``parts`` on a device of
    ``sm_count`` SMs: ``CLUSTERS_PER_SM`` clusters an SM exchanging one partial a round,
    ``CLUSTER_PROGRAMS_PER_SM`` programs an SM (whole clusters) exchanging more."""
    if partials == 1:
        return parts * sm_count * CLUSTERS_PER_SM
    return parts * max(1, sm_count * CLUSTER_PROGRAMS_PER_SM // parts)

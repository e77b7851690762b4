"""The launch shapes of the decode kernels that pricing must reserve buffers for.

Split-K decode attention cuts the KV range into at most ``ATTN_SPLITS`` pieces
(carve_kernels/attention.py; buf.attn_partial / buf.attn_lse). A T-layout decode GEMV
(carve_kernels/gemv_t.py) cuts its launch into programs: row tiles, times splits of each row's
blocks. Pricing (engine/planning/buffers.py) sizes the buffer of the splits' partial sums by the
rule the launches follow.

A split row tile writes one row of partial sums per split into ``part`` [parts, split, rows]
and the last of its programs to finish adds them in split order: the same sums, so the same
output bits, whatever order the programs ran in (greedy decoding repeats itself, on one GPU or
split over several)."""

from __future__ import annotations

from collections.abc import Sequence

from spec import quant_types as qt

ATTN_SPLITS = 64  # split-K decode attention: the KV range is cut into at most this many pieces

# (rows per program, warps, programs aimed at) of the T-layout GEMV. With the split sums added
# in order by each row tile's last program, 128 rows keep that tail short (H200, int8 x,
# tg128: 256 rows 7B 438.2 / 32B 119.9 t/s, 128 rows 448.0 / 120.6, 64 rows x 2 warps 424.0 /
# 117.8)
T_CONFIG = (128, 4, 2112)
# the gate/up launch: 128 rows per program, each Q4_K step reading both matrices' words (H200:
# 7B 50.1 -> 47.0 us, 32B 88.6 -> 83.0 us against one matrix after the other at 256 rows)
T_GLU_CONFIG = (128, 4, 2112)
# the low-bit types' T bodies (carve_kernels/gemv_t_low.py, gemv_t_grid.py, gemv_t_iq1.py),
# alone or as the gate/up pair: two rows
# a thread share each x value's loads and x-only work (H200, 7B ffn_up + ffn_down, 2026-12-02:
# 256 rows won the sweep of five configs for Q2_K and IQ4_XS, on bf16 and int8 x; IQ2_XXS's
# configs were within 5 % of each other)
T_LOWBIT_TYPES = frozenset({qt.Q2_K, qt.Q3_K, qt.IQ4_XS, qt.IQ1_S, qt.IQ1_M, qt.IQ2_XXS,
                            qt.IQ2_XS, qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S})
T_CONFIG_LOWBIT = (256, 4, 2112)


def t_config(ggml_type: int, glu: bool = False) -> tuple[int, int, int]:
    """The config of a single (or, ``glu``, a gate/up) T launch over matrices of this type;
    q/k/v's launch is always ``T_CONFIG``."""
    if ggml_type in T_LOWBIT_TYPES:
        return T_CONFIG_LOWBIT
    return T_GLU_CONFIG if glu else T_CONFIG


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tiles(rows: Sequence[int], block_n: int) -> int:
    """Row tiles of a launch over matrices of ``rows`` rows (q, k, v: each starts a tile)."""
    return sum(cdiv(r, block_n) for r in rows)


def split(n_tiles: int, nb: int, target: int) -> tuple[int, int]:
    """(splits, blocks per split) of rows of ``nb`` blocks so that the grid has ~target
    programs; every split holds at least one block."""
    s = max(1, min(nb, cdiv(target, n_tiles)))
    bps = cdiv(nb, s)
    return cdiv(nb, bps), bps


def scratch(rows: Sequence[int], cols: int, config: tuple[int, int, int],
            parts: int = 1) -> tuple[int, int]:
    """(float32 partial sums, int32 counters) one x row of a launch needs; (0, 0) unsplit.
    ``cols``: the matrices' columns (256 per block); ``parts``: 2 for the gate/up pair."""
    block_n, _, target = config
    nb = cols // 256
    if nb < 1 or not rows:
        return 0, 0
    t = tiles(rows, block_n)
    s, _ = split(t, nb, target)
    return (parts * s * sum(rows), t) if s > 1 else (0, 0)


# The GPU sampler (carve_kernels/sample.py): the top-k it serves (1..SAMPLE_TOP_K), the repetition
# penalty's window (up to SAMPLE_LAST_N tokens), the programs of its first pass (each keeps up to
# SAMPLE_TOP_K of its slice's best), the candidates its pick ranks at once and the ring of sampled
# ids the host reads back. Its keys (int64): SAMPLE_TOP_K per part, then SAMPLE_MERGE. Its state:
# 16 settings slots, the penalty's history ring, the ring of ids (int32).
SAMPLE_TOP_K = 64
SAMPLE_LAST_N = 256
SAMPLE_PARTS = 128
SAMPLE_MERGE = 256
SAMPLE_KEYS = SAMPLE_PARTS * SAMPLE_TOP_K + SAMPLE_MERGE
SAMPLE_RING = 64
SAMPLE_STATE = 16 + SAMPLE_LAST_N + SAMPLE_RING

# The GPU runner's lookup buffer (buf.lookup, one per stage): the IQ types' value tables
# (carve_kernels/lowbit_blocks.py lays them out in whole 256-byte lines) and, in its last line, the
# int32 flags of the load's scan for non-finite block scales (carve_kernels/scale_scan.py).
LOOKUP_BYTES = 34304
LOOKUP_FLAGS = 64

# Mixture-of-experts prefill (carve_kernels/moe_prefill.py): the routed rows (tokens x experts used)
# sorted by expert, cut into tiles of MOE_TILE_ROWS rows of one expert each; every expert's last
# tile may be partial, so a chunk needs at most this many tiles (the priced buf.moe_tiles).
# 64 rows: each tile dequantizes its expert's blocks once for twice the rows of 32 (H200,
# 2026-12-04, 512 tokens: Qwen3-30B-A3B gate/up + Q6_K down 758 against 852 us, gpt-oss-20b
# 1,967 against 2,370 us, each at its best tile; carve_kernels/NOTES.md)
MOE_TILE_ROWS = 64


def moe_tiles(routed_rows: int, n_expert: int) -> int:
    """Tiles of at most MOE_TILE_ROWS rows of one expert that ``routed_rows`` rows can need."""
    return cdiv(routed_rows, MOE_TILE_ROWS) + min(n_expert, routed_rows)

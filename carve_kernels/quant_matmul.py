"""Quantized matrix kernels: fused dequantize x vector (decode), dequantize to f16/bf16 (prefill
GEMMs and the dequant cache), and embedding gather with dequantize. Gate/up with the GLU and
q/k/v in one launch: carve_kernels/gemv_fused.py.

A weight is its GGUF bytes as a uint8 tensor ``[rows, row_bytes]`` (torch shape of a GGUF
``[ne0=cols, ne1=rows]`` matrix), so ``y = W @ x`` with ``x`` of ``cols`` values.
Each function has a plain-torch twin ``*_ref`` of the same signature built on
``carve_kernels.dequant`` (itself held bit-equal to ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import dequant as _dq
from carve_kernels import pdl, q8x, trace
from carve_kernels.gemv_dot import row_dot
from carve_kernels.gemv_q8_blocks import (
    iq4nl_q8_rows_dot,
    lut_words,
    q40_q8_rows_dot,
    q41_q8_rows_dot,
    q50_q8_rows_dot,
)
from carve_kernels.lowbit_blocks import LOWBIT_PLANS, lookup_table
from carve_kernels.quant_blocks import PLANS, dequant_part, plan
from spec import quant_types as qt

# (rows per program, blocks per step, warps[, pipeline stages]) per type, for M<=8 decode GEMV;
# picked by tile sweeps on an H200 (benchmarks/gemv_profile.py). The generic walk wants tiles
# that give each thread ~16 contiguous weight bytes per part, or loads stay 2 bytes wide and the
# scale loads dominate.
GEMV_CONFIG: dict[int, tuple[int, ...]] = {
    qt.F16: (4, 16, 4),
    qt.BF16: (4, 16, 4),
    qt.Q4_0: (4, 32, 4),
    qt.Q5_0: (4, 16, 4),
    # Q8_0's row body (on trial; carve_kernels/gemv_dot.py q80_rows_dot: a thread per 32-value
    # block), two blocks a thread: in the step (H200, 2026-12-03) gpt-oss-20b 437.8 t/s at
    # (8, 32, 4), 403.4 at (8, 16, 4), 369.1 at (8, 8, 4); Qwen2-7B Q8_0 162.0, 168.0, 147.2.
    # Its generic walk (the default): GEMV_CONFIG_GENERIC
    qt.Q8_0: (8, 32, 4),
    qt.Q4_K: (4, 16, 4),
    qt.Q5_K: (4, 16, 4),
    qt.Q6_K: (2, 16, 4),
    qt.MXFP4: (4, 16, 4),  # not swept yet
    # Q4_1, Q5_1, Q2_K, Q3_K, IQ4_NL and IQ4_XS (carve_kernels/lowbit_blocks.py): not swept yet
    **{t: (4, 16, 4) if PLANS[t].block == 32 else (4, 8, 4) for t in LOWBIT_PLANS},
    # the grid IQ types' body (carve_kernels/gemv_iq.py: tiles of groups of 32 values), from
    # device_check sweeps on an H200 (2026-12-02, bf16 and int8 x)
    qt.IQ2_XXS: (8, 8, 4), qt.IQ2_S: (8, 8, 4), qt.IQ1_M: (8, 8, 4),
    qt.IQ2_XS: (4, 4, 4), qt.IQ3_XXS: (4, 4, 4), qt.IQ3_S: (4, 4, 4), qt.IQ1_S: (4, 4, 4),
    # IQ4_XS's body (carve_kernels/gemv_lowbit.py), the same sweep: int8 x best at (8, 8, 4), bf16
    # x at (8, 4, 4), within 4 % of it here
    qt.IQ4_XS: (8, 8, 4),
}
# tiles for matrices with many rows (>= WIDE_PROGRAMS programs at the default tile), where
# fewer, fatter programs win: Qwen2-7B's ffn_up/gate and the output head
GEMV_CONFIG_WIDE: dict[int, tuple[int, ...]] = {qt.Q4_K: (8, 8, 4)}
# and for long rows (cols >= 4 x rows), where the grid is small and each program long
GEMV_CONFIG_LONG: dict[int, tuple[int, ...]] = {qt.Q6_K: (4, 16, 8)}
WIDE_PROGRAMS = 2048
# the generic walk's tile for a type whose GEMV_CONFIG is its row body's, where the body does
# not run (off trial, or a Q8_0 weight off a 4-byte boundary). Q8_0 at 32 blocks a step: in
# the step (H200, 2026-12-03) Qwen2-7B Q8_0 231.4 / 231.2 t/s against 223.8 at (4, 16, 4),
# gpt-oss-20b 414.6 / 414.9 against 405.4
GEMV_CONFIG_GENERIC: dict[int, tuple[int, ...]] = {qt.Q8_0: (4, 32, 4)}
# types whose parts are summed over their lanes at once (LANE_SUM; faster for these on the H200)
LANE_SUM_TYPES = frozenset({qt.Q5_0, qt.Q8_0})
# types whose generic walk turns integers to floats through the mantissa of 2^23 (faster than
# I2F for these on the H200; slower for Q4_K's generic walk)
MAGIC_TYPES = frozenset({qt.Q6_K})
# types with a storage-order body in carve_kernels/gemv_dot.py, and the byte alignment of the
# weight's start (and of its rows) that the body's 16-byte loads assume
SPECIAL_ALIGN = {qt.Q4_K: 16}
# types with a row body of their own (row_dot with SPECIAL, on float32, 16-bit or decode's
# int8 x): the grid IQ types (carve_kernels/gemv_iq.py, a group of 32 values per lane, reading their
# table, 8-byte aligned, a row per word), IQ4_XS (carve_kernels/gemv_lowbit.py; on an H200 1.9x the
# generic walk on int8 x, 1.7x on bf16 x, 2026-12-02), which need no alignment; Q8_0's (on
# trial, ROW_BODY_TRIAL) only where the weight's start is ROW_BODY_ALIGN-aligned, else the
# generic walk; Q5_0's, Q4_0's, Q4_1's, Q5_1's and IQ4_NL's on decode's int8 x alone
# (INT8_BODY_TYPES), 4-byte aligned too
ROW_BODY_TYPES = frozenset({qt.IQ2_XXS, qt.IQ2_XS, qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S, qt.IQ1_S,
                            qt.IQ1_M, qt.IQ4_XS, qt.Q5_0, qt.Q4_0, qt.Q4_1, qt.Q5_1, qt.IQ4_NL})
# the byte alignment of the weight's start that a row body's word loads assume (the others: 1)
ROW_BODY_ALIGN = {qt.Q8_0: 4, qt.Q5_0: 4, qt.Q4_0: 4, qt.Q4_1: 4, qt.Q5_1: 4, qt.IQ4_NL: 4}
# row bodies on decode's int8 copy of x alone (carve_kernels/gemv_q8_blocks.py, the expert GEMVs'
# bodies): other x (more than one row, or a matrix the copy does not reach) takes the generic
# walk at its own tile; GEMV_CONFIG_BODY is the body's tile. Q5_0 (a thread per 22-byte
# block), for the small models whose rows are not whole 256-value blocks (Qwen2-0.5B's q, k,
# gate and up): H200, 2026-12-04, 7B ffn_up + ffn_down 41.0 us (54 % of the floor) at (4, 32,
# 4) against 106.9 on the generic walk (58.0 at (8, 32, 4)); Qwen2-0.5B tg128 1,343.9 against
# 1,234.6 t/s at (8, 32, 4), the same greedy ids
# Q4_0, Q4_1 and Q5_1 (carve_kernels/gemv_q8_blocks.py: a thread per block as Q5_0's; Q4_1's and
# Q5_1's min term by a dp4a of x's words with ones) at Q5_0's tile: 7B ffn_up + ffn_down 35.8
# / 34.5 / 41.8 us (50 / 58 / 58 % of the floor; the best of device_check's six tiles) against
# 70.4 / 63.3 / 116.6 on the generic walk; Qwen2-7B all Q4_0 tg128 342.4 against 265.7 t/s,
# all Q4_1 305.6 against 282.7 (int8 x off, same call, same greedy ids; H200, 2026-12-04).
# IQ4_NL's (the expert GEMVs' iq4nl_q8_rows_dot, its table as the kernels' constants; gemv3
# leaves it to the generic walk): Qwen2-7B all IQ4_NL tg128 224.0 against 165.9 t/s, the same
# greedy ids (H100, 2026-12-07, one lease, as trial iq4nl_rows)
INT8_BODY_TYPES = frozenset({qt.Q5_0, qt.Q4_0, qt.Q4_1, qt.Q5_1, qt.IQ4_NL})
GEMV_CONFIG_BODY: dict[int, tuple[int, ...]] = {t: (4, 32, 4) for t in INT8_BODY_TYPES}
# bodies of their own not switched on: Q2_K (carve_kernels/gemv_lowbit.py q2k_rows_dot) measured
# 1.14x the generic walk on int8 x but 0.85x on bf16 x (H200, 2026-12-02), and its big matrices
# go to the T layout (carve_kernels/gemv_t_low.py); it runs only where a caller adds it to
# ROW_BODY_TYPES (the tests; benchmarks/device_check.py --types, which times it beside the
# generic walk; CARVE_TRIAL=q2k_rows). Q8_0 (carve_kernels/gemv_dot.py q80_rows_dot, a thread per
# block read as aligned int32 words; decode's int8 copy of x reaches its q/k/v, gate/up and
# head): written 2026-12-03 (CARVE_TRIAL=q8_0_rows); a tie where it was timed (H100,
# 2026-12-07: the IQ2_XXS mix with Q8_0 attention, 434.8 against 434.9 t/s), where the T
# layout takes Q8_0's big matrices
ROW_BODY_TRIAL = frozenset({qt.Q2_K, qt.Q8_0})


def gemv_config(ggml_type: int, rows: int, cols: int) -> tuple[int, ...]:
    """The tile a decode GEMV of this type and shape runs with."""
    cfg = GEMV_CONFIG[ggml_type]
    if ggml_type in GEMV_CONFIG_WIDE and triton.cdiv(rows, cfg[0]) >= WIDE_PROGRAMS:
        return GEMV_CONFIG_WIDE[ggml_type]
    if ggml_type in GEMV_CONFIG_LONG and cols >= 4 * rows:
        return GEMV_CONFIG_LONG[ggml_type]
    return cfg


@triton.jit
def _dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, K, row_bytes, TYPE: tl.constexpr,
         BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr, L: tl.constexpr,
         BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, LANE_SUM: tl.constexpr,
         SPECIAL: tl.constexpr, MAGIC: tl.constexpr, xd_ptr, Q8X: tl.constexpr,
         ASM: tl.constexpr, LUT0: tl.constexpr = 0, LUT1: tl.constexpr = 0,
         LUT2: tl.constexpr = 0, LUT3: tl.constexpr = 0):
    # row_dot, and the bodies that read decode's int8 x alone (INT8_BODY_TYPES); LUT0..LUT3:
    # IQ4_NL's table (gemv_q8_blocks.lut_words)
    if SPECIAL and Q8X and TYPE == 6:  # Q5_0: a thread per 22-byte block
        y = q50_q8_rows_dot(w_ptr, wh_ptr, xrow, xd_ptr, rows_c, K // BS, row_bytes, BLOCK_R,
                            BLOCK_B, ASM)
    elif SPECIAL and Q8X and TYPE == 2:  # Q4_0: 18-byte blocks, as Q5_0's
        y = q40_q8_rows_dot(w_ptr, wh_ptr, xrow, xd_ptr, rows_c, K // BS, row_bytes, BLOCK_R,
                            BLOCK_B, ASM)
    elif SPECIAL and Q8X and TYPE == 20:  # IQ4_NL: Q4_0's blocks, the table's values
        y = iq4nl_q8_rows_dot(w_ptr, wh_ptr, xrow, xd_ptr, rows_c, K // BS, row_bytes, LUT0,
                              LUT1, LUT2, LUT3, BLOCK_R, BLOCK_B, ASM)
    elif SPECIAL and Q8X and (TYPE == 3 or TYPE == 7):  # Q4_1, Q5_1: aligned words
        y = q41_q8_rows_dot(w_ptr, wh_ptr, xrow, xd_ptr, rows_c, K // BS, row_bytes, TYPE,
                            BLOCK_R, BLOCK_B, ASM)
    else:
        y = row_dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, K, row_bytes, TYPE, BS, TS, NPART, L,
                    BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC, xd_ptr, ASM)
    return y


@triton.jit
def _gemv_kernel(w_ptr, wh_ptr, wi_ptr, x_ptr, xq_ptr, xd_ptr, y_ptr, b_ptr, N, K, row_bytes,
                 stride_xm, stride_ym, trace_ptr, TYPE: tl.constexpr, BS: tl.constexpr,
                 TS: tl.constexpr, NPART: tl.constexpr, L: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_B: tl.constexpr, LANE_SUM: tl.constexpr, SPECIAL: tl.constexpr,
                 MAGIC: tl.constexpr, HAS_BIAS: tl.constexpr, Q8X: tl.constexpr,
                 ASM: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr = False,
                 LUT0: tl.constexpr = 0, LUT1: tl.constexpr = 0, LUT2: tl.constexpr = 0,
                 LUT3: tl.constexpr = 0):
    trace.wait(trace_ptr, PDL, TRACE)
    # rows on axis 0: a 152064-row output matrix in 2-row programs passes the 65535 limit of
    # grid axes 1 and 2
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_c = tl.minimum(rows, N - 1)  # clamp instead of masking every weight load
    # Q8X: x's int8 copy (one row; the row bodies, ROW_BODY_TYPES)
    xrow = xq_ptr if Q8X else x_ptr + m.to(tl.int64) * stride_xm
    y = _dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, K, row_bytes, TYPE, BS, TS, NPART, L,
             BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC, xd_ptr, Q8X, ASM, LUT0, LUT1, LUT2,
             LUT3)
    trace.stamp(trace_ptr, 2, TRACE)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rows, y.to(y_ptr.dtype.element_ty),
             mask=rows < N)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _dequant_kernel(w_ptr, wh_ptr, g_ptr, ids_ptr, out_ptr, N, K, row_bytes, stride_om,
                    TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr,
                    L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                    GATHER: tl.constexpr,
                    PDL: tl.constexpr):
    pdl.start(PDL)
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < N
    if GATHER:  # embedding: output row i is weight row ids[i]
        src = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
    else:
        src = tl.minimum(r, N - 1).to(tl.int64)
    nblk = K // BS
    blk = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = blk < nblk
    blk_c = tl.minimum(blk, nblk - 1)
    lane = tl.arange(0, L)
    base = src[:, None, None] * row_bytes + blk_c[None, :, None] * TS
    out_row = out_ptr + r.to(tl.int64)[:, None, None] * stride_om
    mask = rmask[:, None, None] & bmask[None, :, None]
    for p in tl.static_range(NPART):
        v, e = dequant_part(w_ptr, wh_ptr, base, lane, TYPE, p, False, g_ptr)
        col = blk[None, :, None] * BS + e[None, None, :]
        tl.store(out_row + col, v.to(out_ptr.dtype.element_ty), mask=mask)


def _views(w: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"weight must be contiguous uint8 [rows, row_bytes], got {w.dtype} "
                         f"{tuple(w.shape)}")
    half = torch.bfloat16 if ggml_type == qt.BF16 else torch.float16
    if w.shape[1] % 2:  # MXFP4's 17-byte blocks: its walk loads nothing 16 bits wide
        return w, w
    return w, w.view(half)


def row_cols(w: torch.Tensor, ggml_type: int) -> int:
    """Values per row of a weight stored as [rows, row_bytes]."""
    p = plan(ggml_type)
    if w.shape[1] % p.nbytes:
        raise ValueError(f"{qt.type_name(ggml_type)} row of {w.shape[1]} bytes is not whole blocks")
    return w.shape[1] // p.nbytes * p.block


def _table(w: torch.Tensor, ggml_type: int) -> torch.Tensor:
    # the value table of an IQ type (carve_kernels/lowbit_blocks.py); the weight itself, unread,
    # for the types that have none
    dev = w.device
    if not w.is_cuda and w.is_pinned():  # pinned host memory a GPU kernel reads in place
        dev = torch.device("cuda", torch.cuda.current_device())
    t = lookup_table(ggml_type, dev)
    return w if t is None else t


def _launch_args(w: torch.Tensor, ggml_type: int, config: tuple[int, ...] | None = None,
                 x_dtype: torch.dtype = torch.bfloat16, int8_x: bool = False):
    """(pointer views (bytes, 16-bit, int32 or the type's value table), the body's constexprs,
    warps, stages) of one weight's GEMV; ``int8_x``: it multiplies decode's int8 copy of x."""
    w, wh = _views(w, ggml_type)
    p = plan(ggml_type)
    k = row_cols(w, ggml_type)
    align = SPECIAL_ALIGN.get(ggml_type)
    # the storage-order body loads x twice as wide as the generic walk per weight byte: with
    # float32 activations the generic walk is faster (on an H200)
    special = (align is not None and w.data_ptr() % align == 0 and w.shape[1] % align == 0
               and x_dtype != torch.float32)
    # the storage-order body's 16-byte loads; the IQ types' value table in its place
    wi = w.view(torch.int32) if special else _table(w, ggml_type)
    body = row_body(w, ggml_type) and (int8_x or ggml_type not in INT8_BODY_TYPES)
    special = special or body
    if config is None and not special and ggml_type in GEMV_CONFIG_GENERIC:
        config = GEMV_CONFIG_GENERIC[ggml_type]
    if config is None and body and ggml_type in GEMV_CONFIG_BODY:
        config = GEMV_CONFIG_BODY[ggml_type]
    br, bb, warps, *rest = config or gemv_config(ggml_type, w.shape[0], k)
    bb = min(bb, triton.next_power_of_2(k // p.block))  # short rows: no all-masked blocks
    meta = {"TYPE": ggml_type, "BS": p.block, "TS": p.nbytes, "NPART": p.parts, "L": p.lanes,
            "BLOCK_R": br, "BLOCK_B": bb, "LANE_SUM": ggml_type in LANE_SUM_TYPES,
            "SPECIAL": special, "MAGIC": ggml_type in MAGIC_TYPES}
    if body and ggml_type == qt.IQ4_NL:  # its table as the body's constants
        meta.update(zip(("LUT0", "LUT1", "LUT2", "LUT3"), lut_words(ggml_type), strict=True))
    return (w, wh, wi), meta, warps, (rest[0] if rest else None)


def row_body(w: torch.Tensor, ggml_type: int) -> bool:
    """Whether this weight's GEMV runs its type's row body (ROW_BODY_TYPES, its start aligned
    as ROW_BODY_ALIGN asks; a Q8_0 view off a 4-byte boundary takes the generic walk)."""
    return ggml_type in ROW_BODY_TYPES and w.data_ptr() % ROW_BODY_ALIGN.get(ggml_type, 1) == 0


def _q8_in(xq, ggml_type: int, x2: torch.Tensor, special: bool,
           int8_x: bool) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(int8 values, scales, use): decode's int8 copy of x (carve_kernels/q8x.py: q as int32 words,
    d, s) where the kernel multiplies with it (a row body runs: ``special`` and a
    ROW_BODY_TYPES type; ``int8_x``: the copy is usable for x2, ``q8x.usable``), else x twice
    and False."""
    if not special or ggml_type not in ROW_BODY_TYPES or not int8_x:
        return x2, x2, False
    return xq[0].view(torch.int8), xq[1], True


def _x2(x: torch.Tensor, k: int) -> torch.Tensor:
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    return x2


def _opts(warps: int, stages: int | None) -> dict:
    return {"num_warps": warps, **({"num_stages": stages} if stages else {})}


def gemv(w: torch.Tensor, ggml_type: int, x: torch.Tensor, out: torch.Tensor | None = None,
         config: tuple[int, ...] | None = None, bias: torch.Tensor | None = None,
         use_pdl: bool = True, xq=None) -> torch.Tensor:
    """y[M, rows] = x[M, cols] @ W^T (+ bias), dequantizing W on the fly; M small (decode,
    M <= 8). x is float32/bf16/f16; y has x's dtype unless ``out`` is given. No allocation
    with ``out``. ``config`` overrides the tile (rows per program, blocks per step, warps[,
    stages]); the body and the accumulation follow from the type, the weight's alignment and
    x's dtype. ``use_pdl``: launch with PDL where the GPU has it (carve_kernels/pdl.py). ``xq``: x's
    int8 copy (q, d, s of carve_kernels/q8x.py), which a row body (ROW_BODY_TYPES: the grid IQ
    types, IQ4_XS, Q8_0 on a 4-byte aligned weight) multiplies by dp4a when M = 1; ignored
    otherwise."""
    n, k = w.shape[0], row_cols(w, ggml_type)
    x2 = _x2(x, k)
    m = x2.shape[0]
    int8_x = q8x.usable(xq, x2)
    ptrs, meta, warps, stages = _launch_args(w, ggml_type, config, x.dtype, int8_x)
    q, d, use = _q8_in(xq, ggml_type, x2, meta["SPECIAL"], int8_x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out.view(m, n)
    grid = (triton.cdiv(n, meta["BLOCK_R"]), m)
    _gemv_kernel[grid](*ptrs, x2, q, d, y, bias if bias is not None else y, n, k, w.shape[1],
                       x2.stride(0), y.stride(0), **trace.args("gemv", grid, y),
                       HAS_BIAS=bias is not None, Q8X=use,
                       ASM=w.is_cuda, **meta, **_opts(warps, stages), **pdl.opts(y, use_pdl))
    return y.view(*x.shape[:-1], n) if out is None else out


def gemv_ref(w: torch.Tensor, ggml_type: int, x: torch.Tensor, out: torch.Tensor | None = None,
             config: tuple[int, ...] | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
    wf = dequantize_ref(w, ggml_type, torch.float32)
    y = x.to(torch.float32).reshape(-1, wf.shape[1]) @ wf.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    y = y.to(x.dtype)
    y = y.view(*x.shape[:-1], wf.shape[0])
    return y if out is None else out.copy_(y.view(out.shape))


def _dequant_launch(w, ggml_type, ids, out, n, k, use_pdl):
    w, wh = _views(w, ggml_type)
    p = plan(ggml_type)
    br = 8
    bb = min(8 if p.block == 256 else 16, triton.next_power_of_2(k // p.block))
    if not w.is_cuda:  # the interpreter: each program costs ~0.1 s whatever its size
        br, bb = min(64, triton.next_power_of_2(n)), triton.next_power_of_2(k // p.block)
    grid = (triton.cdiv(n, br), triton.cdiv(k // p.block, bb))
    _dequant_kernel[grid](w, wh, _table(w, ggml_type), ids if ids is not None else w, out, n, k,
                          w.shape[1],
                          out.stride(0), TYPE=ggml_type, BS=p.block, TS=p.nbytes,
                          NPART=p.parts, L=p.lanes, BLOCK_R=br, BLOCK_B=bb,
                          GATHER=ids is not None, num_warps=4, **pdl.opts(out, use_pdl))
    return out


def dequantize(w: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float16,
               out: torch.Tensor | None = None, use_pdl: bool = True) -> torch.Tensor:
    """W [rows, row_bytes] -> [rows, cols] in ``dtype`` (a dequant-cache span when ``out``).
    ``use_pdl`` as in ``gemv``."""
    n, k = w.shape[0], row_cols(w, ggml_type)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=w.device)
    return _dequant_launch(w, ggml_type, None, out, n, k, use_pdl)


def dequantize_ref(w: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float16,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    n, k = w.shape[0], row_cols(w, ggml_type)
    # carve_kernels.dequant allocates its scratch on the CPU, so the reference runs there
    y = _dq.dequantize_to(w.reshape(-1).cpu(), ggml_type, (k, n), torch.float32)
    y = y.to(device=w.device, dtype=dtype)
    return y if out is None else out.copy_(y)


def embed(w: torch.Tensor, ggml_type: int, ids: torch.Tensor, dtype: torch.dtype = torch.float32,
          out: torch.Tensor | None = None, use_pdl: bool = True) -> torch.Tensor:
    """Rows ``ids`` [T] of the embedding W, dequantized: [T, cols]. ``use_pdl`` as in
    ``gemv``."""
    k = row_cols(w, ggml_type)
    t = ids.numel()
    if out is None:
        out = torch.empty(t, k, dtype=dtype, device=w.device)
    return _dequant_launch(w, ggml_type, ids.reshape(-1), out.view(t, k), t, k, use_pdl)


def embed_ref(w: torch.Tensor, ggml_type: int, ids: torch.Tensor,
              dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    rows = w[ids.reshape(-1).long()].contiguous()
    y = dequantize_ref(rows, ggml_type, dtype)
    return y if out is None else out.copy_(y.view(out.shape))


def matmul(w: torch.Tensor, ggml_type: int, x: torch.Tensor, scratch: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill y = x @ W^T: dequantize W into ``scratch`` (or take an already dequantized
    dequant-cache tensor when ``ggml_type`` is None) and run one GEMM in x's dtype."""
    if ggml_type is None:
        wd = w
    else:
        wd = dequantize(w, ggml_type, x.dtype, out=scratch)
    if out is None:
        return x @ wd.T
    return torch.matmul(x, wd.T, out=out)


SUPPORTED = tuple(qt.type_name(t) for t in (qt.F16, qt.BF16, qt.Q4_0, qt.Q5_0, qt.Q8_0,
                                              qt.Q4_K, qt.Q5_K, qt.Q6_K))

"""Decode GEMV over row-interleaved ("transposed") weights: the layout the runner repacks a
matrix into at load time so that one GEMV thread reads 16 bytes holding the same word of 4
neighbouring rows, and every activation value it needs is the same for the whole program.

GGUF stores a matrix row by row, block by block. The T layout keeps every byte and only
reorders them in units of U bytes (U = 4 for Q4_K, whose 144-byte block is 36 words):

    T[b, u, n] = unit u of block b of row n      (shape [blocks per row, units per block, rows])

so the units of one block position sit side by side for all rows. A program owns BLOCK_N rows
(BLOCK_N / threads per thread, loaded as one vector per word) and a range of blocks; x for that
range is loaded as scalars (the same address in every thread: one broadcast per warp, no
layout conversion, no shuffle), and each thread keeps its rows' sums in registers to the end.
Programs that split a row's blocks add their sums into a float32 ``part`` buffer; the last one
of a row tile to finish (an atomic counter, acq_rel) reads and zeroes it and writes y.

Same results as ``quant_matmul.gemv`` on the GGUF layout (the torch twin is ``gemv_t_ref``).
Status: Q4_K only, measured on the H200 against the GGUF-layout GEMV (kernels/NOTES.md,
session 3: 1.1-1.3x), not yet used by the runner, which would have to repack at load time
and dequantize prefill weights from this layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import quant_types as qt

# bytes per unit and units per block of the types with a T layout
UNIT = {qt.Q4_K: 4}
UNITS = {qt.Q4_K: 36}


def repack(w: torch.Tensor, ggml_type: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """GGUF rows ``w`` (uint8 [rows, row_bytes]) -> the T layout, as uint8 of the same size."""
    u, upb = UNIT[ggml_type], UNITS[ggml_type]
    n = w.shape[0]
    nb = w.shape[1] // (u * upb)
    if w.shape[1] != nb * u * upb:
        raise ValueError(f"{qt.type_name(ggml_type)} row of {w.shape[1]} bytes is not whole blocks")
    dt = {4: torch.int32, 2: torch.int16}[u]
    t = w.view(dt).view(n, nb, upb).permute(1, 2, 0)
    if out is None:
        return t.contiguous().view(torch.uint8).view(-1)
    out.view(dt).view(nb, upb, n).copy_(t)
    return out


def unpack(t: torch.Tensor, ggml_type: int, rows: int) -> torch.Tensor:
    """The T layout back to GGUF rows (uint8 [rows, row_bytes]); for checks."""
    u, upb = UNIT[ggml_type], UNITS[ggml_type]
    dt = {4: torch.int32, 2: torch.int16}[u]
    v = t.view(dt).view(-1, upb, rows)
    return v.permute(2, 0, 1).contiguous().view(torch.uint8).view(rows, -1)


@triton.jit
def _nib(w, S: tl.constexpr):
    # nibble at bit S of each word as the float 1 + q/16 (q into the top of the mantissa of 1.0:
    # one shift and one LOP3, no convert); the caller takes the 1 back out per sub-block
    if S <= 19:
        v = (w << (19 - S)) & 0x780000
    else:
        v = (w >> (S - 19)) & 0x780000
    return (v | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _k4_sm(w0, w1, w2, J: tl.constexpr):
    # get_scale_min_k4 of ggml-quants.c for sub-block J of the 12 scale bytes in words w0..w2
    if J < 4:
        sc = (w0 >> (8 * J)) & 63
        mn = (w1 >> (8 * J)) & 63
    else:
        q4 = (w2 >> (8 * (J - 4))) & 255
        sc = (q4 & 15) | (((w0 >> (8 * (J - 4) + 6)) & 3) << 4)
        mn = (q4 >> 4) | (((w1 >> (8 * (J - 4) + 6)) & 3) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4k_t_dot(wt_ptr, x_ptr, rows, rmask, N, b_lo, b_hi, BLOCK_N: tl.constexpr):
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b in range(b_lo, b_hi):
        blk = wt_ptr + b * 36 * N + rows  # < 2^31 words for any real matrix
        dd = tl.load(blk, mask=rmask, other=0)
        w0 = tl.load(blk + N, mask=rmask, other=0)
        w1 = tl.load(blk + 2 * N, mask=rmask, other=0)
        w2 = tl.load(blk + 3 * N, mask=rmask, other=0)
        d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        xb = x_ptr + b * 256
        for c in tl.static_range(4):
            sl = tl.zeros([BLOCK_N], dtype=tl.float32)
            sh = tl.zeros([BLOCK_N], dtype=tl.float32)
            xsl = 0.0
            xsh = 0.0
            for j in tl.static_range(8):
                w = tl.load(blk + (4 + 8 * c + j) * N, mask=rmask, other=0)
                for m in tl.static_range(4):
                    xl = tl.load(xb + 64 * c + 4 * j + m).to(tl.float32)
                    xh = tl.load(xb + 64 * c + 32 + 4 * j + m).to(tl.float32)
                    sl += _nib(w, 8 * m) * xl
                    sh += _nib(w, 8 * m + 4) * xh
                    xsl += xl
                    xsh += xh
            scl, mnl = _k4_sm(w0, w1, w2, 2 * c)
            sch, mnh = _k4_sm(w0, w1, w2, 2 * c + 1)
            # sum x (1 + q/16) = xs + (sum q x) / 16
            acc += (d * 16.0) * (scl * (sl - xsl) + sch * (sh - xsh)) \
                - dmin * (mnl * xsl + mnh * xsh)
    return acc


@triton.jit
def _k4_sm_dyn(w0, w1, w2, J):
    # _k4_sm for a sub-block J known only at run time (a scalar, 0..7)
    sh = (J % 4) * 8
    lo_sc = (w0 >> sh) & 63
    lo_mn = (w1 >> sh) & 63
    q4 = (w2 >> sh) & 255
    hi_sc = (q4 & 15) | (((w0 >> (sh + 6)) & 3) << 4)
    hi_mn = (q4 >> 4) | (((w1 >> (sh + 6)) & 3) << 4)
    low = J < 4
    return tl.where(low, lo_sc, hi_sc).to(tl.float32), tl.where(low, lo_mn, hi_mn).to(tl.float32)


@triton.jit
def _x4(xp, m: tl.constexpr, XV: tl.constexpr):
    # x[m] of the 4 values at xp; XV: they came as one 8-byte word (16-bit x)
    if XV:
        v = ((xp >> (16 * m)) & 0xFFFF).to(tl.uint16)
        return v.to(tl.bfloat16, bitcast=True).to(tl.float32)
    else:
        return tl.load(xp + m).to(tl.float32)


@triton.jit
def _word(w, xp, sl, sh, xsl, xsh, XV: tl.constexpr = False):
    # one word of 4 rows' qs: bytes m = 0..3 are l = 4j + m of the chunk; low nibble against
    # x[l], high against x[32 + l] (xp points at x[4j] of the chunk)
    if XV:
        xlv = tl.load(xp.to(tl.pointer_type(tl.int64)))
        xhv = tl.load((xp + 32).to(tl.pointer_type(tl.int64)))
    else:
        xlv = xp
        xhv = xp + 32
    for m in tl.static_range(4):
        xl = _x4(xlv, m, XV)
        xh = _x4(xhv, m, XV)
        sl += _nib(w, 8 * m) * xl
        sh += _nib(w, 8 * m + 4) * xh
        xsl += xl
        xsh += xh
    return sl, sh, xsl, xsh


@triton.jit
def _ld8(qp, N, rmask):
    return (tl.load(qp, mask=rmask, other=0), tl.load(qp + N, mask=rmask, other=0),
            tl.load(qp + 2 * N, mask=rmask, other=0), tl.load(qp + 3 * N, mask=rmask, other=0),
            tl.load(qp + 4 * N, mask=rmask, other=0), tl.load(qp + 5 * N, mask=rmask, other=0),
            tl.load(qp + 6 * N, mask=rmask, other=0), tl.load(qp + 7 * N, mask=rmask, other=0))


@triton.jit
def _chunk(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, xb, c, BLOCK_N: tl.constexpr,
           XV: tl.constexpr):
    sl = tl.zeros([BLOCK_N], dtype=tl.float32)
    sh = tl.zeros([BLOCK_N], dtype=tl.float32)
    xsl = 0.0
    xsh = 0.0
    sl, sh, xsl, xsh = _word(a0, xb, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a1, xb + 4, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a2, xb + 8, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a3, xb + 12, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a4, xb + 16, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a5, xb + 20, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a6, xb + 24, sl, sh, xsl, xsh, XV)
    sl, sh, xsl, xsh = _word(a7, xb + 28, sl, sh, xsl, xsh, XV)
    d = (h0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    scl, mnl = _k4_sm_dyn(h1, h2, h3, 2 * c)
    sch, mnh = _k4_sm_dyn(h1, h2, h3, 2 * c + 1)
    return (d * 16.0) * (scl * (sl - xsl) + sch * (sh - xsh)) - dmin * (mnl * xsl + mnh * xsh)


@triton.jit
def _q4k_t_dot_half(wt_ptr, x_ptr, rows, rmask, N, b_lo, b_hi, BLOCK_N: tl.constexpr,
                    XV: tl.constexpr):
    # half a block (2 chunks, 16 words per row) per step, every load of the step issued before
    # its math: ptxas keeps loads at the top of the body they are used in
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        c0 = (hb % 2) * 2
        hp = wt_ptr + b * 36 * N + rows
        qp = hp + (4 + c0 * 8) * N
        h0 = tl.load(hp, mask=rmask, other=0)
        h1 = tl.load(hp + N, mask=rmask, other=0)
        h2 = tl.load(hp + 2 * N, mask=rmask, other=0)
        h3 = tl.load(hp + 3 * N, mask=rmask, other=0)
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(qp, N, rmask)
        e0, e1, e2, e3, e4, e5, e6, e7 = _ld8(qp + 8 * N, N, rmask)
        # ptxas issues loads just before their use, so a warp has ~1 load in flight; a
        # dependence of the first word on all of them (through ``N >> 31``, 0 at run time)
        # makes it issue the step's 20 loads together (SASS read for sm_90)
        t = (a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ e0 ^ e1 ^ e2 ^ e3 ^ e4 ^ e5 ^ e6 ^ e7 ^ h0 ^ h1
             ^ h2 ^ h3)
        a0 = a0 + (t & (N >> 31))
        xb = x_ptr + b * 256 + 64 * c0
        acc += _chunk(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, xb, c0, BLOCK_N, XV)
        acc += _chunk(e0, e1, e2, e3, e4, e5, e6, e7, h0, h1, h2, h3, xb + 64, c0 + 1, BLOCK_N,
                      XV)
    return acc


@triton.jit
def _gemv_t_kernel(wt_ptr, x_ptr, y_ptr, b_ptr, part_ptr, cnt_ptr, N, NB, BPS, stride_xm,
                   stride_ym, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, XV: tl.constexpr,
                   HAS_BIAS: tl.constexpr, TYPE: tl.constexpr, BATCH: tl.constexpr):
    pid = tl.program_id(0)
    ks = tl.program_id(1)
    m = tl.program_id(2).to(tl.int64)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    xrow = x_ptr + m * stride_xm
    b_lo = ks * BPS
    b_hi = tl.minimum(b_lo + BPS, NB)
    # rows masked, not clamped: a clamp hides their contiguity and the loads go 4 bytes wide
    if BATCH:
        acc = _q4k_t_dot_half(wt_ptr, xrow, rows, rmask, N, b_lo, b_hi, BLOCK_N, XV)
    else:
        acc = _q4k_t_dot(wt_ptr, xrow, rows, rmask, N, b_lo, b_hi, BLOCK_N)
    yrow = y_ptr + m * stride_ym
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(yrow + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)
    else:
        # the splits of a row tile add into part; the last to arrive writes y and leaves part
        # and its counter at zero for the next call
        prow = part_ptr + m * N
        tl.atomic_add(prow + rows, acc, mask=rmask, sem="relaxed")
        cnt = cnt_ptr + m * tl.num_programs(0) + pid
        tl.debug_barrier()  # every thread's adds issued before the counter's release
        done = tl.atomic_add(cnt, 1)
        if done == SPLIT - 1:
            zero = tl.zeros([BLOCK_N], tl.float32)
            tot = tl.atomic_add(prow + rows, zero, mask=rmask)  # read at L2, where the adds are
            tl.store(prow + rows, zero, mask=rmask)
            if HAS_BIAS:
                tot += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(yrow + rows, tot.to(y_ptr.dtype.element_ty), mask=rmask)
            tl.atomic_xchg(cnt, 0)


# (rows per program, warps, programs aimed at) of the T-layout GEMV: the best of the H200 sweep
# (`python -m kernels.gemv_profile --tlayout`, kernels/NOTES.md)
T_CONFIG = (256, 4, 1056)


def split_for(n: int, nb: int, block_n: int, target: int) -> int:
    """Blocks of a row are split over this many programs so that the grid has ~target."""
    tiles = triton.cdiv(n, block_n)
    return max(1, min(nb, triton.cdiv(target, tiles)))


def gemv_t(wt: torch.Tensor, ggml_type: int, rows: int, x: torch.Tensor, out: torch.Tensor,
           part: torch.Tensor, counter: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int] | None = None, batch: bool = True) -> torch.Tensor:
    """y[M, rows] = x[M, cols] @ W^T for W in the T layout ``wt`` (from ``repack``).
    ``part``: float32 zeros [M, rows]; ``counter``: int32 zeros [M, row tiles] (both left zero).
    No allocation."""
    block_n, warps, target = config or T_CONFIG
    nbytes = wt.numel()
    nb = nbytes // (rows * UNIT[ggml_type] * UNITS[ggml_type])
    x2 = x.reshape(-1, nb * 256)
    mm = x2.shape[0]
    y = out.view(mm, rows)
    split = split_for(rows, nb, block_n, target)
    bps = triton.cdiv(nb, split)
    split = triton.cdiv(nb, bps)
    tiles = triton.cdiv(rows, block_n)
    if split > 1 and (part.numel() < mm * rows or counter.numel() < mm * tiles):
        raise ValueError("part/counter buffers too small for this GEMV")
    grid = (tiles, split, mm)
    _gemv_t_kernel[grid](wt.view(torch.int32), x2, y, bias if bias is not None else y, part,
                         counter, rows, nb, bps, x2.stride(0), y.stride(0), BLOCK_N=block_n,
                         XV=(x2.dtype == torch.bfloat16 and x2.stride(0) % 4 == 0
                             and x2.data_ptr() % 8 == 0),
                         SPLIT=split, HAS_BIAS=bias is not None, TYPE=ggml_type, BATCH=bool(batch),
                         num_warps=warps)
    return out


def gemv_t_ref(wt: torch.Tensor, ggml_type: int, rows: int, x: torch.Tensor,
               out: torch.Tensor, part: torch.Tensor, counter: torch.Tensor,
               bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    from kernels.quant_matmul import gemv_ref

    return gemv_ref(unpack(wt, ggml_type, rows), ggml_type, x, out=out, bias=bias)

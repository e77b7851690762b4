"""A row-of-the-grid body for the grid IQ types' decode GEMVs (``gemv_dot.row_dot`` with
SPECIAL): IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M (grid rows of 8 values) and IQ3_XXS, IQ3_S
(rows of 4).

The generic walk (kernels/lowbit_blocks.py) gives every lane one value: per value it loads a
grid index, gathers one grid byte and works out its sign. Here each lane holds one grid row: its
index, sign bits (with the parity of a 7-bit sign index), scale and IQ1 delta are worked out
once for its 4 or 8 values, the row is one 4- or 8-byte gather from the table (read as int32 or
int64 words), and its values are unpacked by shifts:

    sum_j x_j * db * v_j = db * sum_j x_j * v_j,   v_j = +-grid_j (IQ1: 8 grid_j +- 1)

Block layouts as in kernels/lowbit_blocks.py; ``r`` is the grid row within the block.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.lowbit_blocks import _u8, _u16


@triton.jit
def _ksigns(s):
    # ksigns_iq2xs[s] for a 7-bit s: s and its parity in bit 7
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return s | ((p & 1) << 7)


@triton.jit
def _row(w_ptr, wh_ptr, base, r, TYPE: tl.constexpr):
    """Row ``r`` ([ROWS]) of the blocks at ``base`` ([R, B, 1]): (grid index, sign bits with
    bit j for value j, the row's float scale, IQ1's delta in units of grid/8 or 0)."""
    rr = r[None, None, :]
    zero = tl.zeros_like(base).to(tl.int32) + tl.zeros_like(rr)
    if TYPE == 16:  # IQ2_XXS: d, per 32 values 4 index bytes + u32 (4 x 7 sign bits, scale)
        o = base + 2 + 8 * (rr // 4)
        gi = _u8(w_ptr, o + rr % 4)
        hi = _u8(w_ptr, o + 7)
        aux = _u8(w_ptr, o + 4) | (_u8(w_ptr, o + 5) << 8) | (_u8(w_ptr, o + 6) << 16) | (
            (hi & 15) << 24)
        sgn = _ksigns((aux >> (7 * (rr % 4))) & 127)
        db = tl.load(wh_ptr + base // 2).to(tl.float32) * (0.5 + (hi >> 4).to(tl.float32)) * 0.25
        delta = zero
    elif TYPE == 17:  # IQ2_XS: d, qs[32] u16 (9-bit index, 7 sign bits), scales[8] nibbles
        q = _u16(w_ptr, base + 2 + 2 * rr)
        gi = q & 511
        sgn = _ksigns(q >> 9)
        s = (_u8(w_ptr, base + 66 + rr // 4) >> (4 * ((rr // 2) % 2))) & 15
        db = tl.load(wh_ptr + base // 2).to(tl.float32) * (0.5 + s.to(tl.float32)) * 0.25
        delta = zero
    elif TYPE == 22:  # IQ2_S: d, qs[32], signs[32], qh[8] (2 top bits per row), scales[8]
        gi = _u8(w_ptr, base + 2 + rr) | (((_u8(w_ptr, base + 66 + rr // 4) >> (2 * (rr % 4)))
                                           & 3) << 8)
        sgn = _u8(w_ptr, base + 34 + rr)
        s = (_u8(w_ptr, base + 74 + rr // 4) >> (4 * ((rr // 2) % 2))) & 15
        db = tl.load(wh_ptr + base // 2).to(tl.float32) * (0.5 + s.to(tl.float32)) * 0.25
        delta = zero
    elif TYPE == 19:  # IQ1_S: d, qs[32], qh[8] u16 (3 top bits per row, scale, delta sign)
        qh = _u16(w_ptr, base + 34 + 2 * (rr // 4))
        gi = _u8(w_ptr, base + 2 + rr) | (((qh >> (3 * (rr % 4))) & 7) << 8)
        sgn = zero
        dl = tl.load(wh_ptr + base // 2).to(tl.float32) * (2 * ((qh >> 12) & 7) + 1).to(
            tl.float32)
        db = dl * 0.125
        delta = 1 - 2 * (qh >> 15)
    elif TYPE == 29:  # IQ1_M: qs[32], qh[16] (a nibble per row), scales 4 x u16 (and d)
        nib = (_u8(w_ptr, base + 32 + rr // 2) >> (4 * (rr % 2))) & 15
        gi = _u8(w_ptr, base + rr) | ((nib & 7) << 8)
        sgn = zero
        d16 = ((_u8(w_ptr, base + 49) >> 4) | (_u8(w_ptr, base + 51) & 0xF0)
               | ((_u8(w_ptr, base + 53) >> 4) << 8) | ((_u8(w_ptr, base + 55) & 0xF0) << 8))
        d = d16.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        s3 = (_u16(w_ptr, base + 48 + 2 * (rr // 8)) >> (3 * ((rr // 2) % 4))) & 7
        db = d * (2 * s3 + 1).to(tl.float32) * 0.125
        delta = 1 - 2 * (nib >> 3)
    elif TYPE == 18:  # IQ3_XXS: d, qs[64] (an index per 4 values), 8 u32 (signs, scale)
        gi = _u8(w_ptr, base + 2 + rr)
        o = base + 66 + 4 * (rr // 8)
        hi = _u8(w_ptr, o + 3)
        aux = _u8(w_ptr, o) | (_u8(w_ptr, o + 1) << 8) | (_u8(w_ptr, o + 2) << 16) | (
            (hi & 15) << 24)
        sgn = _ksigns((aux >> (7 * ((rr % 8) // 2))) & 127) >> (4 * (rr % 2))
        db = tl.load(wh_ptr + base // 2).to(tl.float32) * (0.5 + (hi >> 4).to(tl.float32)) * 0.5
        delta = zero
    else:  # IQ3_S: d, qs[64], qh[8] (top bit per row), signs[32], scales[4] nibbles
        sub = rr // 8
        gi = _u8(w_ptr, base + 2 + rr) | (((_u8(w_ptr, base + 66 + sub) >> (rr % 8)) & 1) << 8)
        sgn = _u8(w_ptr, base + 74 + rr // 2) >> (4 * (rr % 2))
        s = (_u8(w_ptr, base + 106 + sub // 2) >> (4 * (sub % 2))) & 15
        db = tl.load(wh_ptr + base // 2).to(tl.float32) * (1 + 2 * s).to(tl.float32)
        delta = zero
    return gi, sgn, db, delta


@triton.jit
def iq_rows_dot(w_ptr, wh_ptr, g_ptr, xrow, rows_c, nblk, row_bytes, TYPE: tl.constexpr,
                TS: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_B: tl.constexpr):
    """[BLOCK_R] float32 dot products of rows ``rows_c`` (of a grid IQ type, ``W`` values per
    grid row) with the activation row at ``xrow``; ``g_ptr``: the type's grid
    (kernels.lowbit_blocks.lookup_table, its start 8-byte aligned), read a row per word."""
    if W == 4:
        gw = g_ptr.to(tl.pointer_type(tl.int32))
    else:
        gw = g_ptr.to(tl.pointer_type(tl.int64))
    tb = tl.arange(0, BLOCK_B)
    r = tl.arange(0, 256 // W)
    row_base = rows_c.to(tl.int64)[:, None, None] * row_bytes
    acc = tl.zeros([BLOCK_R, BLOCK_B, 256 // W], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bmask = blk < nblk
        base = row_base + tl.minimum(blk, nblk - 1)[None, :, None] * TS  # [R, B, 1]
        gi, sgn, db, delta = _row(w_ptr, wh_ptr, base, r, TYPE)
        g = tl.load(gw + gi)  # [R, B, rows]: each row's grid values, a byte each
        xo = (blk * 256)[:, None] + (W * r)[None, :]  # [B, rows]: each row's first x
        xm = tl.broadcast_to(bmask[None, :, None], (BLOCK_R, BLOCK_B, 256 // W))
        srow = tl.zeros([BLOCK_R, BLOCK_B, 256 // W], dtype=tl.float32)
        for j in tl.static_range(W):
            # x as a full [R, B, rows] tile in the weights' register layout (no conversion)
            xp = tl.broadcast_to((xrow + xo + j)[None, :, :], (BLOCK_R, BLOCK_B, 256 // W))
            xv = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            q = ((g >> (8 * j)) & 255).to(tl.int32)
            if TYPE == 19 or TYPE == 29:  # IQ1: signed grid values (times 8), the delta
                q = tl.where(q > 127, q - 256, q) + delta
            else:
                q = tl.where(((sgn >> j) & 1) != 0, -q, q)
            srow += q.to(tl.float32) * xv
        acc += db * srow
    return tl.sum(tl.sum(acc, axis=2), axis=1)

"""A row-of-the-grid body for IQ2_XXS decode GEMVs (``gemv_dot.row_dot`` with SPECIAL).

The generic walk (kernels/lowbit_blocks.py) gives every lane one value: per value it loads a
grid index, gathers one grid byte and computes its sign bit with the parity of its 7-bit sign
index. Here each lane holds one grid row of 8 values: the row's index, sign bits, parity and
scale are computed once for its 8 values, the row is one 8-byte gather from the table (viewed
as int64), and its values are unpacked by shifts. Per value that leaves a shift, a mask, a
sign select, a convert and the product.

    sum_j x_j * db * sign_j * grid_j = db * sum_j x_j * (sign_j * grid_j)

Block (66 bytes): d f16, then per 32 values (a sub-block) 4 grid-row indices (bytes) and a u32
of 4 x 7 sign bits and a 4-bit scale (bits 28-31): db = d * (0.5 + scale) * 0.25.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _u8(ptr, off):
    return tl.load(ptr + off).to(tl.int32)


@triton.jit
def iq2xxs_dot(w_ptr, wh_ptr, g_ptr, xrow, rows_c, nblk, row_bytes,
               BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    """[BLOCK_R] float32 dot products of IQ2_XXS rows ``rows_c`` with the activation row at
    ``xrow``; ``g_ptr``: the IQ2_XXS grid (kernels.lowbit_blocks.lookup_table), read as int64
    words (one grid row each)."""
    g64 = g_ptr.to(tl.pointer_type(tl.int64))  # the grid's rows as words (8-byte aligned)
    tb = tl.arange(0, BLOCK_B)
    r = tl.arange(0, 32)  # grid row of the block: sub-block r // 4, row r % 4 within it
    sub = r // 4
    row_base = rows_c.to(tl.int64)[:, None, None] * row_bytes
    acc = tl.zeros([BLOCK_R, BLOCK_B, 32], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bmask = blk < nblk
        base = row_base + tl.minimum(blk, nblk - 1)[None, :, None] * 66  # [R, B, 1]
        o = base + 2 + 8 * sub[None, None, :]  # the sub-block's 8 bytes, [R, B, 32]
        gi = _u8(w_ptr, o + (r % 4)[None, None, :])
        hi = _u8(w_ptr, o + 7)
        aux = _u8(w_ptr, o + 4) | (_u8(w_ptr, o + 5) << 8) | (_u8(w_ptr, o + 6) << 16) | (
            (hi & 15) << 24)
        s = (aux >> (7 * (r % 4))[None, None, :]) & 127
        p = s ^ (s >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
        sgn = s | ((p & 1) << 7)  # ksigns_iq2xs: bit j set -> value j negative
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        db = d * (0.5 + (hi >> 4).to(tl.float32)) * 0.25
        g = tl.load(g64 + gi)  # [R, B, 32] int64: the row's 8 grid bytes
        xo = (blk * 256)[:, None] + (8 * r)[None, :]  # [B, 32]: each row's first x
        xm = tl.broadcast_to(bmask[None, :, None], (BLOCK_R, BLOCK_B, 32))
        srow = tl.zeros([BLOCK_R, BLOCK_B, 32], dtype=tl.float32)
        for j in tl.static_range(8):
            # x as a full [R, B, 32] tile in the weights' register layout (no conversion)
            xp = tl.broadcast_to((xrow + xo + j)[None, :, :], (BLOCK_R, BLOCK_B, 32))
            xv = tl.load(xp, mask=xm, other=0.0).to(tl.float32)
            q = ((g >> (8 * j)) & 255).to(tl.int32)
            q = tl.where(((sgn >> j) & 1) != 0, -q, q)
            srow += q.to(tl.float32) * xv
        acc += db * srow
    return tl.sum(tl.sum(acc, axis=2), axis=1)

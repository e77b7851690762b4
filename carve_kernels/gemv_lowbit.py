"""Decode GEMV bodies of the low-bit types that are not grid types, on the pattern of
carve_kernels/gemv_iq.py (a lane per 32 values, x as 64-bit words or decode's int8 copy by dp4a):
IQ4_XS (its 16-value table through ``prmt`` byte permutes) and Q2_K (2-bit values, a scale
and a min per 16). Both are on trial (``quant_matmul.ROW_BODY_TRIAL``) until a GPU times them
against the generic walk (carve_kernels/NOTES.md).
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_iq import _h, _step, _word_dot, _x_words
from carve_kernels.gemv_t_dot import _dp4a
from carve_kernels.gemv_t_low import _iq4_table, _iq4_values


# --- IQ4_XS: nibbles into the 16-value table by byte permutes (gemv_t_low._iq4_values) ----
@triton.jit
def iq4xs_rows_dot(w_ptr, wh_ptr, g_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes,
                   TS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                   ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of IQ4_XS rows ``rows_c`` with the activation row at
    ``xrow``, as ``iq_rows_dot`` (float32, bf16, f16 or decode's int8 copy of x with its
    scales at ``xd_ptr``): a lane per sub-block of 32 values, its 16 bytes of nibbles read as
    4 words, each word's 8 nibbles turned into their table values (``g_ptr``: the 16 int8
    values, 4-byte aligned) by byte permutes, then multiplied as IQ2's signed grid words.
    Block: d, scales_h u16 (2 bits per sub-block), scales_l[4] (a nibble per sub-block),
    qs[128] (sub-block i: bytes 16i..16i+15, value j in the low nibble of byte j, value
    16 + j in the high one)."""
    XQ: tl.constexpr = xrow.dtype.element_ty == tl.int8
    X16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16 or (
        xrow.dtype.element_ty == tl.float16)
    BF16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16
    t0, t1, t2, t3 = _iq4_table(g_ptr)
    ww = w_ptr.to(tl.pointer_type(tl.int32))
    xw = _x_words(xrow)
    tb = tl.arange(0, BLOCK_B)
    g = tl.arange(0, 8)[None, None, :]  # the lane's sub-block
    row_half = rows_c.to(tl.int64)[:, None, None] * (row_bytes // 2)
    acc = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        hb, xg, xm = _step(row_half, b0 + tb, nblk, g, TS, BLOCK_R, BLOCK_B)
        d = tl.load(wh_ptr + hb).to(tl.float32)
        sh = _h(wh_ptr, hb + 1)
        sl = (_h(wh_ptr, hb + 2 + g // 4) >> (8 * ((g // 2) % 2) + 4 * (g % 2))) & 15
        dl = d * ((sl | (((sh >> (2 * g)) & 3) << 4)) - 32).to(tl.float32)
        qw = hb // 2 + 2 + 4 * g  # the sub-block's first qs word (block byte 8 + 16 g)
        isum = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.int32)
        s = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.float32)
        for k in tl.static_range(4):
            vl, vh = _iq4_values(tl.load(ww + qw + k), t0, t1, t2, t3, ASM)
            # vl: values 4k..4k+3 of the sub-block, vh: values 16 + 4k..16 + 4k + 3
            if XQ:
                isum = _dp4a(vl, tl.load(xw + xg * 8 + k, mask=xm, other=0), isum, ASM, True)
                isum = _dp4a(vh, tl.load(xw + xg * 8 + 4 + k, mask=xm, other=0), isum, ASM,
                             True)
            elif X16:
                xa = tl.load(xw + xg * 8 + k, mask=xm, other=0)
                xb = tl.load(xw + xg * 8 + 4 + k, mask=xm, other=0)
                s += _word_dot(vl, xa, xa, True, BF16) + _word_dot(vh, xb, xb, True, BF16)
            else:
                xa = tl.load(xw + xg * 16 + 2 * k, mask=xm, other=0)
                xb = tl.load(xw + xg * 16 + 2 * k + 1, mask=xm, other=0)
                xc = tl.load(xw + xg * 16 + 8 + 2 * k, mask=xm, other=0)
                xd = tl.load(xw + xg * 16 + 8 + 2 * k + 1, mask=xm, other=0)
                s += _word_dot(vl, xa, xb, False, BF16) + _word_dot(vh, xc, xd, False, BF16)
        if XQ:
            acc += dl * isum.to(tl.float32) * tl.load(xd_ptr + xg, mask=xm, other=0.0)
        else:
            acc += dl * s
    return tl.sum(tl.sum(acc, axis=2), axis=1)


# --- Q2_K: 2-bit values, a scale and a min per 16 --------------------------------------------
@triton.jit
def q2k_rows_dot(w_ptr, wh_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, TS: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of Q2_K rows ``rows_c`` with the activation row at
    ``xrow``, as ``iq_rows_dot`` (float32, bf16, f16 or decode's int8 copy of x with its
    scales at ``xd_ptr``): a lane per 32 values. Block (84 bytes): scales[16] (a 4-bit scale
    and a 4-bit min per 16 values), qs[64], d, dmin; values 32g..32g+31 (g = 4n + j) are bits
    2j..2j+1 of qs bytes 32n..32n+31, and their two scale bytes are 16-bit word g of the
    block. value = d * scale * q - dmin * min."""
    XQ: tl.constexpr = xrow.dtype.element_ty == tl.int8
    X16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16 or (
        xrow.dtype.element_ty == tl.float16)
    BF16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16
    ww = w_ptr.to(tl.pointer_type(tl.int32))
    xw = _x_words(xrow)
    tb = tl.arange(0, BLOCK_B)
    g = tl.arange(0, 8)[None, None, :]
    n2 = g // 4
    j2 = g % 4
    row_half = rows_c.to(tl.int64)[:, None, None] * (row_bytes // 2)
    acc = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.float32)
    ones = tl.full([BLOCK_R, BLOCK_B, 8], 0x01010101, tl.int32)
    for b0 in range(0, nblk, BLOCK_B):
        hb, xg, xm = _step(row_half, b0 + tb, nblk, g, TS, BLOCK_R, BLOCK_B)
        sc = _h(wh_ptr, hb + g)  # the two scale bytes of the lane's 32 values
        d = tl.load(wh_ptr + hb + 40).to(tl.float32)
        dmin = tl.load(wh_ptr + hb + 41).to(tl.float32)
        qw = hb // 2 + 4 + 8 * n2  # the first of the lane's 8 qs words (block byte 16 + 32 n)
        iq0 = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.int32)
        iq1 = iq0
        ix0 = iq0
        ix1 = iq0
        f0 = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.float32)
        f1 = f0
        fx0 = f0
        fx1 = f0
        for k in tl.static_range(8):
            v = (tl.load(ww + qw + k) >> (2 * j2)) & 0x03030303  # values 4k..4k+3, 0..3
            if XQ:
                xa = tl.load(xw + xg * 8 + k, mask=xm, other=0)
                if k < 4:
                    iq0 = _dp4a(v, xa, iq0, ASM, True)
                    ix0 = _dp4a(ones, xa, ix0, ASM, True)
                else:
                    iq1 = _dp4a(v, xa, iq1, ASM, True)
                    ix1 = _dp4a(ones, xa, ix1, ASM, True)
            else:
                if X16:
                    xa = tl.load(xw + xg * 8 + k, mask=xm, other=0)
                    xb = xa
                else:
                    xa = tl.load(xw + xg * 16 + 2 * k, mask=xm, other=0)
                    xb = tl.load(xw + xg * 16 + 2 * k + 1, mask=xm, other=0)
                if k < 4:
                    f0 += _word_dot(v, xa, xb, X16, BF16)
                    fx0 += _word_dot(ones, xa, xb, X16, BF16)
                else:
                    f1 += _word_dot(v, xa, xb, X16, BF16)
                    fx1 += _word_dot(ones, xa, xb, X16, BF16)
        if XQ:
            f0 = iq0.to(tl.float32)
            f1 = iq1.to(tl.float32)
            fx0 = ix0.to(tl.float32)
            fx1 = ix1.to(tl.float32)
        s = (d * ((sc & 15).to(tl.float32) * f0 + ((sc >> 8) & 15).to(tl.float32) * f1)
             - dmin * (((sc >> 4) & 15).to(tl.float32) * fx0 + (sc >> 12).to(tl.float32) * fx1))
        if XQ:
            s = s * tl.load(xd_ptr + xg, mask=xm, other=0.0)
        acc += s
    return tl.sum(tl.sum(acc, axis=2), axis=1)

"""The per-block dot product of the T-layout GEMVs (carve_kernels/gemv_t.py) for Q6_K: half a
block a step of a program's row tile against x as float (bf16 four values to an 8-byte load, or
float32; values as 1 + q/64 through the mantissa of 1.0) or as its int8 copy
(carve_kernels/q8x.py) through signed ``dp4a`` (``_q6_s8``, which decode's Q6_K expert GEMVs in
carve_kernels/gemv_q8.py share). Its step issues all of its weight loads before its math, as
Q4_K's (carve_kernels/gemv_t_dot.py).
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_t_dot import _bits, _dp4a, _ld8, _pick4, _sc8, _x4


@triton.jit
def _q6_val(lo, S: tl.constexpr, h, SH: tl.constexpr):
    # the 6-bit value (4 low bits at bit S of lo, 2 high at bit SH of h) as 1 + q/64
    return (_bits(lo, S, 0xF, 17) | _bits(h, SH, 3, 21) | 0x3F800000).to(tl.float32, bitcast=True)

@triton.jit
def _q6_word(a, b, h, xp, s0, s1, s2, s3, x0, x1, x2, x3, XV: tl.constexpr):
    # byte m of ql words a (l = l0 + m) and b (l + 32) and qh word h gives quarter k's value
    # for x[32 k + l]: k = 0 a's low nibble, 1 b's low, 2 a's high, 3 b's high; qh bits 2k
    if XV:
        v0 = tl.load(xp.to(tl.pointer_type(tl.int64)))
        v1 = tl.load((xp + 32).to(tl.pointer_type(tl.int64)))
        v2 = tl.load((xp + 64).to(tl.pointer_type(tl.int64)))
        v3 = tl.load((xp + 96).to(tl.pointer_type(tl.int64)))
    else:
        v0 = xp
        v1 = xp + 32
        v2 = xp + 64
        v3 = xp + 96
    for m in tl.static_range(4):
        y0 = _x4(v0, m, XV)
        y1 = _x4(v1, m, XV)
        y2 = _x4(v2, m, XV)
        y3 = _x4(v3, m, XV)
        s0 += _q6_val(a, 8 * m, h, 8 * m) * y0
        s1 += _q6_val(b, 8 * m, h, 8 * m + 2) * y1
        s2 += _q6_val(a, 8 * m + 4, h, 8 * m + 4) * y2
        s3 += _q6_val(b, 8 * m + 4, h, 8 * m + 6) * y3
        x0 += y0
        x1 += y1
        x2 += y2
        x3 += y3
    return s0, s1, s2, s3, x0, x1, x2, x3

@triton.jit
def _q6_group(a0, a1, a2, a3, b0, b1, b2, b3, h0, h1, h2, h3, xb, sw0, sw1, d,
              IS: tl.constexpr, BLOCK_N: tl.constexpr, XV: tl.constexpr):
    # 16 values of l (4 words) in each of the 4 quarters of a half block: one scale each,
    # sc[8n + 2k + IS] (bytes 2k + IS of the half's two scale words)
    z = tl.zeros([BLOCK_N], dtype=tl.float32)
    s0, s1, s2, s3 = z, z, z, z
    x0, x1, x2, x3 = 0.0, 0.0, 0.0, 0.0
    s0, s1, s2, s3, x0, x1, x2, x3 = _q6_word(a0, b0, h0, xb, s0, s1, s2, s3, x0, x1, x2, x3, XV)
    s0, s1, s2, s3, x0, x1, x2, x3 = _q6_word(a1, b1, h1, xb + 4, s0, s1, s2, s3, x0, x1, x2,
                                              x3, XV)
    s0, s1, s2, s3, x0, x1, x2, x3 = _q6_word(a2, b2, h2, xb + 8, s0, s1, s2, s3, x0, x1, x2,
                                              x3, XV)
    s0, s1, s2, s3, x0, x1, x2, x3 = _q6_word(a3, b3, h3, xb + 12, s0, s1, s2, s3, x0, x1, x2,
                                              x3, XV)
    # sum x (q - 32) = 64 sum x (1 + q/64) - 96 sum x
    t = _sc8(sw0, IS) * (64.0 * s0 - 96.0 * x0) + _sc8(sw0, 2 + IS) * (64.0 * s1 - 96.0 * x1) \
        + _sc8(sw1, IS) * (64.0 * s2 - 96.0 * x2) + _sc8(sw1, 2 + IS) * (64.0 * s3 - 96.0 * x3)
    return d * t

@triton.jit
def _q6_s8(lo, hi):
    # 4 six-bit values (nibbles lo, 2 high bits already at bits 4-5 of each byte in hi) as the
    # signed bytes q - 32: flipping bit 5 gives q - 32 as a 6-bit two's complement, and its
    # sign bit times 6 fills bits 6-7 (0x20 * 6 = 0xC0, no carry between bytes)
    v = ((lo & 0x0F0F0F0F) | (hi & 0x30303030)) ^ 0x20202020
    return v | ((v & 0x20202020) * 6)

@triton.jit
def _q6_q8_group(a0, a1, a2, a3, b0, b1, b2, b3, h0, h1, h2, h3, xw, xd, sw0, sw1, d,
                 IS: tl.constexpr, ASM: tl.constexpr):
    # _q6_group on int8 x: xw points at x's int8 word of quarter 0 for l = 16 IS, xd at
    # quarter 0's scale; quarter k is 8 words / 1 scale further
    z = a0 * 0
    i0, i1, i2, i3 = z, z, z, z
    for j in tl.static_range(4):
        a = _pick4(a0, a1, a2, a3, j)
        b = _pick4(b0, b1, b2, b3, j)
        h = _pick4(h0, h1, h2, h3, j)
        i0 = _dp4a(_q6_s8(a, h << 4), tl.load(xw + j) + z, i0, ASM, True)
        i1 = _dp4a(_q6_s8(b, h << 2), tl.load(xw + 8 + j) + z, i1, ASM, True)
        i2 = _dp4a(_q6_s8(a >> 4, h), tl.load(xw + 16 + j) + z, i2, ASM, True)
        i3 = _dp4a(_q6_s8(b >> 4, h >> 2), tl.load(xw + 24 + j) + z, i3, ASM, True)
    t = _sc8(sw0, IS) * tl.load(xd) * i0.to(tl.float32) \
        + _sc8(sw0, 2 + IS) * tl.load(xd + 1) * i1.to(tl.float32) \
        + _sc8(sw1, IS) * tl.load(xd + 2) * i2.to(tl.float32) \
        + _sc8(sw1, 2 + IS) * tl.load(xd + 3) * i3.to(tl.float32)
    return d * t

@triton.jit
def _q6k_t_dot(wt_ptr, wh_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
               BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr,
               ASM: tl.constexpr):
    # Q6_K: words 0-31 ql, 32-47 qh, 48-51 scales; the f16 d in a plane after all words.
    # Half a block (128 values: 8 ql words each side, 8 qh words) per step, loads batched.
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    dp = wh_ptr + NB * 104 * N + rows
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 52 * N + rows
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + 16 * n * N, N, rmask)
        b0, b1, b2, b3, b4, b5, b6, b7 = _ld8(base + (16 * n + 8) * N, N, rmask)
        h0, h1, h2, h3, h4, h5, h6, h7 = _ld8(base + (32 + 8 * n) * N, N, rmask)
        sw0 = tl.load(base + (48 + 2 * n) * N, mask=rmask, other=0)
        sw1 = tl.load(base + (49 + 2 * n) * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = (a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ b0 ^ b1 ^ b2 ^ b3 ^ b4 ^ b5 ^ b6 ^ b7 ^ h0 ^ h1
             ^ h2 ^ h3 ^ h4 ^ h5 ^ h6 ^ h7 ^ sw0 ^ sw1)
        a0 = a0 + (t & (N >> 31))  # all of the step's loads issued together (see Q4_K)
        if Q8X:  # int8 x: words b * 64 + 32 n + 8 k + j, scales b * 8 + 4 n + k
            xw = xq_ptr + b * 64 + 32 * n
            xd = xd_ptr + b * 8 + 4 * n
            acc += _q6_q8_group(a0, a1, a2, a3, b0, b1, b2, b3, h0, h1, h2, h3, xw, xd, sw0,
                                sw1, d, 0, ASM)
            acc += _q6_q8_group(a4, a5, a6, a7, b4, b5, b6, b7, h4, h5, h6, h7, xw + 4, xd, sw0,
                                sw1, d, 1, ASM)
        else:
            xb = x_ptr + b * 256 + 128 * n
            acc += _q6_group(a0, a1, a2, a3, b0, b1, b2, b3, h0, h1, h2, h3, xb, sw0, sw1, d, 0,
                             BLOCK_N, XV)
            acc += _q6_group(a4, a5, a6, a7, b4, b5, b6, b7, h4, h5, h6, h7, xb + 16, sw0, sw1,
                             d, 1, BLOCK_N, XV)
    return acc

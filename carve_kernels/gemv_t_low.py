"""T-layout step bodies (carve_kernels/gemv_t.py) of the low-bit K types and IQ4_XS: Q2_K, Q3_K,
IQ4_XS; and of Q8_0. The grid IQ types' bodies are in carve_kernels/gemv_t_grid.py (IQ2_XXS,
IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and carve_kernels/gemv_t_iq1.py (IQ1_S, IQ1_M); the helpers
they share with these (``_prmt``, ``_x64``, ``_f16``) are here.

As for Q4_K and Q6_K (carve_kernels/gemv_t_dot.py) each thread owns whole rows, reads the same word
of neighbouring rows beside its neighbours (one 128-byte line a warp a word), issues a step's
loads together and keeps its rows' sums in registers; x, the same for every row, is read as
scalars (broadcast loads) and whatever depends on x alone (Q2_K's sums of x per 16 values) is
worked out once per thread, whatever its number of rows.

On decode's int8 copy of x (carve_kernels/q8x.py) the values multiply by ``dp4a``: Q2_K's 2-bit
values as bytes ``(w >> 2j) & 0x03030303`` (Q3_K's with their hmask bit at bit 2, less 4 times
the sum of x per 16), IQ4_XS's nibbles turned into their table values by byte permutes
(``_iq4_values``). On float x (bf16 as 64-bit words of four, or float32 or f16 one value a
load) Q2_K's values become floats through the mantissa of 1.0 (1 + q/4, the 1 taken back out
with the sum of x) and the others' signed bytes by a convert.

Blocks (GGUF order; the T layout keeps the words of a block): Q2_K, 84 bytes = 21 words:
scales[16] (words 0-3; low nibble a scale, high a min, per 16 values), qs[64] (words 4-19;
values 128n + 32j + l are bits 2j of byte 32n + l), d and dmin (word 20). IQ4_XS, 136 bytes =
34 words: d and scales_h (word 0), scales_l (word 1), qs[128] (words 2-33; sub-block i: bytes
16i..16i+15, value l in the low nibble of byte l, 16 + l in the high one).
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_t_dot import _bits, _dp4a, _ld8, _pick4, _pick8, _sc8, _x4


@triton.jit
def _prmt(a, b, c, ASM: tl.constexpr):
    # PTX prmt.b32 (the generic mode): byte k of the result is byte (c >> 4k) & 7 of the eight
    # bytes of {b, a} (a's first), or that byte's sign bit repeated when bit 3 of the nibble
    # is set; ASM: the GPU's instruction, else the same in integer ops (the interpreter)
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:  # the eight bytes as one 64-bit word (fewer interpreter steps)
        ab = (b.to(tl.int64) << 32) | (a.to(tl.int64) & 0xFFFFFFFF)
        r = tl.zeros_like(ab ^ c)  # the broadcast shape (c may be a constant)
        for k in tl.static_range(4):
            sel = (c >> (4 * k)) & 15
            byte = (ab >> ((sel & 7) * 8)) & 255
            byte = tl.where(sel >= 8, (byte >> 7) * 255, byte)
            r = r | (byte << (8 * k))
        return r.to(tl.int32)


@triton.jit
def _iq4_table(tab_ptr):
    """The 16 int8 values at tab_ptr (4-byte aligned) as the four words `_iq4_values` takes."""
    tw = tab_ptr.to(tl.pointer_type(tl.int32))
    return tl.load(tw), tl.load(tw + 1), tl.load(tw + 2), tl.load(tw + 3)


@triton.jit
def _iq4_values(q, t0, t1, t2, t3, ASM: tl.constexpr):
    """The table values of the 8 nibbles of qs word q (t0..t3: the 16 int8 values as four
    words): (the low nibbles' 4 values, the high nibbles'), each a word of 4 signed bytes."""
    # nibble k of each 16-bit half picks among 8 bytes with its bits 0-2 (bit 3 of a prmt
    # selector asks for the sign, so it is cleared), in the first 8 values and in the last 8;
    # a third permute takes each byte from the first (bit 3 clear) or the last (set)
    lo = q & 0x77777777
    pick = ((q >> 1) & 0x44444444) | 0x32103210
    h0 = _prmt(_prmt(t0, t1, lo, ASM), _prmt(t2, t3, lo, ASM), pick, ASM)
    lo1 = lo >> 16
    h1 = _prmt(_prmt(t0, t1, lo1, ASM), _prmt(t2, t3, lo1, ASM), pick >> 16, ASM)
    # h0, h1: the values of bytes 0-1 and 2-3, low and high nibble in turn
    return _prmt(h0, h1, 0x6420, ASM), _prmt(h0, h1, 0x7531, ASM)


@triton.jit
def _f16(w, HI: tl.constexpr):
    # the f16 in the low (HI: high) half of word w, as float32
    if HI:
        w = w >> 16
    return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _x64(xq_ptr, i):
    # int8 x words i and i + 1 (8 values) in one 8-byte load, as two int32
    v = tl.load(xq_ptr.to(tl.pointer_type(tl.int64)) + i // 2)
    return v.to(tl.int32), (v >> 32).to(tl.int32)


# --- Q2_K -------------------------------------------------------------------------------------
@triton.jit
def _quarter_sums_q8(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5, h6, h7, hb, xq_ptr,
                     xi, J: tl.constexpr, HMASK: tl.constexpr, ASM: tl.constexpr):
    # values 32J..32J+31 of a half block on int8 x words xi..xi+7, as two sub-blocks of 16:
    # (sum v x of each, sum x of each). v: the 2-bit fields at bit 2J of the 8 qs words a0..a7
    # (Q2_K), with bit hb of the same bytes of hmask words h0..h7 at bit 2 (HMASK: Q3_K)
    z = a0 * 0
    i0 = z
    i1 = z
    for k in tl.static_range(0, 8, 2):
        wa = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, k)
        wb = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, k + 1)
        if HMASK:
            va = _q3_bytes(wa, _pick8(h0, h1, h2, h3, h4, h5, h6, h7, k), J, hb)
            vb = _q3_bytes(wb, _pick8(h0, h1, h2, h3, h4, h5, h6, h7, k + 1), J, hb)
        else:
            va = (wa >> (2 * J)) & 0x03030303
            vb = (wb >> (2 * J)) & 0x03030303
        xa, xb = _x64(xq_ptr, xi + k)
        if k == 0:  # x's sums per 16 values: scalars, once per thread whatever its rows
            ones = xa * 0 + 0x01010101
            s0 = xa * 0
            s1 = s0
        if k < 4:
            i0 = _dp4a(vb, xb, _dp4a(va, xa, i0, ASM, True), ASM, True)
            s0 = _dp4a(ones, xb, _dp4a(ones, xa, s0, ASM, True), ASM, True)
        else:
            i1 = _dp4a(vb, xb, _dp4a(va, xa, i1, ASM, True), ASM, True)
            s1 = _dp4a(ones, xb, _dp4a(ones, xa, s1, ASM, True), ASM, True)
    return i0, i1, s0, s1


@triton.jit
def _q2_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, sw, d, dmin, xq_ptr, xd_ptr, xi,
                   J: tl.constexpr, ASM: tl.constexpr):
    # values 32J..32J+31 of a half block (bits 2J of its 8 qs words), two sub-blocks of 16
    # with their scale and min bytes in sw (bytes 2(J % 2) and 2(J % 2) + 1), on int8 x words
    # xi..xi+7 and x scale xd_ptr
    i0, i1, s0, s1 = _quarter_sums_q8(a0, a1, a2, a3, a4, a5, a6, a7, a0, a1, a2, a3, a4, a5,
                                      a6, a7, 0, xq_ptr, xi, J, False, ASM)
    SH: tl.constexpr = 16 * (J % 2)
    isc = ((sw >> SH) & 15) * i0 + ((sw >> (SH + 8)) & 15) * i1
    imn = ((sw >> (SH + 4)) & 15) * s0 + ((sw >> (SH + 12)) & 15) * s1
    return tl.load(xd_ptr) * (d * isc.to(tl.float32) - dmin * imn.to(tl.float32))


@triton.jit
def _quarter_sums_f(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5, h6, h7, hb, xp,
                    J: tl.constexpr, HMASK: tl.constexpr, BLOCK_N: tl.constexpr,
                    XV: tl.constexpr):
    # _quarter_sums_q8 on float x (xp points at x[32 J] of the half block): each value v as the
    # float 1 + v/8 (v into the top of the mantissa of 1.0), so sum v x = 8 (sum - sum x);
    # returns (that sum, sum x) of each sub-block of 16
    z = tl.zeros([BLOCK_N], dtype=tl.float32)
    f0 = z
    f1 = z
    x0 = 0.0
    x1 = 0.0
    for k in tl.static_range(8):
        w = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, k)
        if HMASK:
            w = _q3_bytes(w, _pick8(h0, h1, h2, h3, h4, h5, h6, h7, k), J, hb)
        if XV:
            xv = tl.load((xp + 4 * k).to(tl.pointer_type(tl.int64)))
        else:
            xv = xp + 4 * k
        for m in tl.static_range(4):
            xm = _x4(xv, m, XV)
            if HMASK:  # the 3-bit value at bit 8m of the assembled bytes
                fv = (_bits(w, 8 * m, 7, 20) | 0x3F800000).to(tl.float32, bitcast=True)
            else:  # the 2-bit field at bit 8m + 2J of the qs word itself
                fv = (_bits(w, 8 * m + 2 * J, 3, 20) | 0x3F800000).to(tl.float32, bitcast=True)
            if k < 4:
                f0 += fv * xm
                x0 += xm
            else:
                f1 += fv * xm
                x1 += xm
    return 8.0 * (f0 - x0), 8.0 * (f1 - x1), x0, x1


@triton.jit
def _q2_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, sw, d, dmin, xp, J: tl.constexpr,
                  BLOCK_N: tl.constexpr, XV: tl.constexpr):
    # _q2_quarter_q8 on float x: xp points at x[32 J] of the half block
    q0, q1, x0, x1 = _quarter_sums_f(a0, a1, a2, a3, a4, a5, a6, a7, a0, a1, a2, a3, a4, a5, a6,
                                     a7, 0, xp, J, False, BLOCK_N, XV)
    SH: tl.constexpr = 16 * (J % 2)
    return d * (((sw >> SH) & 15).to(tl.float32) * q0
                + ((sw >> (SH + 8)) & 15).to(tl.float32) * q1) \
        - dmin * (((sw >> (SH + 4)) & 15).to(tl.float32) * x0
                  + ((sw >> (SH + 12)) & 15).to(tl.float32) * x1)


@triton.jit
def q2k_t_dot(wt_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, b_lo, b_hi, BLOCK_N: tl.constexpr,
              XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # half a block (128 values: 8 qs words, 2 scale words, the d word) per step
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 21 * N + rows
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + (4 + 8 * n) * N, N, rmask)
        sw0 = tl.load(base + 2 * n * N, mask=rmask, other=0)
        sw1 = tl.load(base + (2 * n + 1) * N, mask=rmask, other=0)
        dw = tl.load(base + 20 * N, mask=rmask, other=0)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ sw0 ^ sw1 ^ dw
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together (carve_kernels/gemv_t_dot.py)
        d = _f16(dw, False)
        dmin = _f16(dw, True)
        if Q8X:  # x words b * 64 + 32 n + 8 j + k, scales b * 8 + 4 n + j
            xi = b * 64 + 32 * n
            xd = xd_ptr + b * 8 + 4 * n
            acc += _q2_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, sw0, d, dmin, xq_ptr, xd,
                                  xi, 0, ASM)
            acc += _q2_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, sw0, d, dmin, xq_ptr, xd + 1,
                                  xi + 8, 1, ASM)
            acc += _q2_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, sw1, d, dmin, xq_ptr, xd + 2,
                                  xi + 16, 2, ASM)
            acc += _q2_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, sw1, d, dmin, xq_ptr, xd + 3,
                                  xi + 24, 3, ASM)
        else:
            xb = x_ptr + b * 256 + 128 * n
            acc += _q2_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, sw0, d, dmin, xb, 0, BLOCK_N,
                                 XV)
            acc += _q2_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, sw0, d, dmin, xb + 32, 1,
                                 BLOCK_N, XV)
            acc += _q2_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, sw1, d, dmin, xb + 64, 2,
                                 BLOCK_N, XV)
            acc += _q2_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, sw1, d, dmin, xb + 96, 3,
                                 BLOCK_N, XV)
    return acc


# --- Q3_K -------------------------------------------------------------------------------------
@triton.jit
def _q3_bytes(w, h, J: tl.constexpr, HB):
    # Q3_K's 3-bit values (0..7, the value plus 4) of qs word w: its 2-bit fields at bit 2J
    # of each byte with bit HB of the same bytes of hmask word h at bit 2
    return ((w >> (2 * J)) & 0x03030303) | (((h >> HB) & 0x01010101) << 2)


@triton.jit
def _q3_scale(s0, s1, s2, n, IS: tl.constexpr):
    # scale 8n + IS (IS 0..7) of the 12 scale bytes in words s0..s2, minus 32: its low 4 bits
    # are the nibble 4n of byte IS, its high 2 bits bits 2(2n + IS // 4) of byte 8 + IS % 4
    B: tl.constexpr = IS % 4
    if IS < 4:
        lw = s0
    else:
        lw = s1
    low = (lw >> (8 * B + 4 * n)) & 15
    high = (s2 >> (8 * B + 2 * (2 * n + IS // 4))) & 3
    return (low | (high << 4)) - 32


@triton.jit
def _q3_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5, h6, h7, n, s0, s1,
                   s2, d, xq_ptr, xd_ptr, xi, J: tl.constexpr, ASM: tl.constexpr):
    # values 32J..32J+31 of half block n (bits 2J of its 8 qs words, bit 4n + J of the 8
    # hmask words), two sub-blocks of 16 with their own scales, on int8 x words xi..xi+7 and
    # x scale xd_ptr: sum (v - 4) x = dp4a(v, x) - 4 sum x
    i0, i1, t0, t1 = _quarter_sums_q8(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5,
                                      h6, h7, 4 * n + J, xq_ptr, xi, J, True, ASM)
    isum = _q3_scale(s0, s1, s2, n, 2 * J) * (i0 - 4 * t0) \
        + _q3_scale(s0, s1, s2, n, 2 * J + 1) * (i1 - 4 * t1)
    return tl.load(xd_ptr) * d * isum.to(tl.float32)


@triton.jit
def _q3_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5, h6, h7, n, s0, s1,
                  s2, d, xp, J: tl.constexpr, BLOCK_N: tl.constexpr, XV: tl.constexpr):
    # _q3_quarter_q8 on float x (xp points at x[32 J] of the half block): sum (v - 4) x
    q0, q1, x0, x1 = _quarter_sums_f(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5, h6,
                                     h7, 4 * n + J, xp, J, True, BLOCK_N, XV)
    return d * (_q3_scale(s0, s1, s2, n, 2 * J).to(tl.float32) * (q0 - 4.0 * x0)
                + _q3_scale(s0, s1, s2, n, 2 * J + 1).to(tl.float32) * (q1 - 4.0 * x1))


@triton.jit
def q3k_t_dot(wt_ptr, wh_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
              BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # Q3_K: words 0-7 hmask (bit 4n + J of byte l: value l of quarter J of half n has its
    # third bit), 8-23 qs (8 a half block), 24-26 the 16 six-bit scales; its f16 d in the
    # tail plane. Half a block (128 values: 8 qs, 8 hmask, 3 scale words) per step
    dp = wh_ptr + NB * 54 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 27 * N + rows
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + (8 + 8 * n) * N, N, rmask)
        h0, h1, h2, h3, h4, h5, h6, h7 = _ld8(base, N, rmask)
        s0 = tl.load(base + 24 * N, mask=rmask, other=0)
        s1 = tl.load(base + 25 * N, mask=rmask, other=0)
        s2 = tl.load(base + 26 * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ h0 ^ h1 ^ h2 ^ h3 ^ h4 ^ h5 ^ h6 ^ h7 ^ s0 ^ s1 ^ s2
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together (carve_kernels/gemv_t_dot.py)
        if Q8X:  # x words b * 64 + 32 n + 8 j + k, scales b * 8 + 4 n + j
            xi = b * 64 + 32 * n
            xd = xd_ptr + b * 8 + 4 * n
            for j in tl.static_range(4):
                acc += _q3_quarter_q8(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5,
                                      h6, h7, n, s0, s1, s2, d, xq_ptr, xd + j, xi + 8 * j, j,
                                      ASM)
        else:
            xb = x_ptr + b * 256 + 128 * n
            for j in tl.static_range(4):
                acc += _q3_quarter_f(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, h4, h5,
                                     h6, h7, n, s0, s1, s2, d, xb + 32 * j, j, BLOCK_N, XV)
    return acc


# --- Q8_0 -------------------------------------------------------------------------------------
@triton.jit
def _q80_block(a0, a1, a2, a3, a4, a5, a6, a7, d, xq_ptr, xd_ptr, x_ptr, bx,
               BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr,
               ASM: tl.constexpr):
    # one block of 32 signed bytes (words a0..a7) with its scale d against x's block bx: on
    # int8 x eight dp4a and x's scale, on float x the bytes converted and multiplied
    if Q8X:
        isum = a0 * 0
        for k in tl.static_range(0, 8, 2):
            xa, xb = _x64(xq_ptr, bx * 8 + k)
            isum = _dp4a(_pick8(a0, a1, a2, a3, a4, a5, a6, a7, k + 1), xb,
                         _dp4a(_pick8(a0, a1, a2, a3, a4, a5, a6, a7, k), xa, isum, ASM, True),
                         ASM, True)
        r = d * tl.load(xd_ptr + bx) * isum.to(tl.float32)
    else:
        s = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(8):
            w = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, k)
            if XV:
                xv = tl.load((x_ptr + bx * 32 + 4 * k).to(tl.pointer_type(tl.int64)))
            else:
                xv = x_ptr + bx * 32 + 4 * k
            for m in tl.static_range(4):
                s += _sc8(w, m) * _x4(xv, m, XV)
        r = d * s
    return r


@triton.jit
def q80_t_dot(wt_ptr, wh_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
              BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # Q8_0: blocks of 32 values, 8 words of signed bytes after the f16 d (to the tail plane,
    # as the grid IQ types' HEAD). Two blocks (18 loads) per step; the second of an odd range
    # masked, its x read at the last block of the range (d = 0 makes it add nothing)
    dp = wh_ptr + NB * 16 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for b in range(b_lo, b_hi, 2):
        b1 = tl.minimum(b + 1, b_hi - 1)
        m1 = rmask & ((rows * 0 + b + 1) < b_hi)
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(wt_ptr + b * 8 * N + rows, N, rmask)
        e0, e1, e2, e3, e4, e5, e6, e7 = _ld8(wt_ptr + (b + 1) * 8 * N + rows, N, m1)
        d0 = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        d1 = tl.load(dp + (b + 1) * N, mask=m1, other=0.0).to(tl.float32)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ e0 ^ e1 ^ e2 ^ e3 ^ e4 ^ e5 ^ e6 ^ e7
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together (carve_kernels/gemv_t_dot.py)
        acc += _q80_block(a0, a1, a2, a3, a4, a5, a6, a7, d0, xq_ptr, xd_ptr, x_ptr, b,
                          BLOCK_N, XV, Q8X, ASM)
        acc += _q80_block(e0, e1, e2, e3, e4, e5, e6, e7, d1, xq_ptr, xd_ptr, x_ptr, b1,
                          BLOCK_N, XV, Q8X, ASM)
    return acc


# --- IQ4_XS -----------------------------------------------------------------------------------
@triton.jit
def _iq4_sub(q0, q1, q2, q3, t0, t1, t2, t3, dl, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
             XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # one sub-block (32 values: qs words q0..q3) times its scale dl: on int8 x words
    # xi..xi+7 and x scale xd_ptr, or on float x at xp
    z = q0 * 0
    isum = z
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(4):
        q = _pick4(q0, q1, q2, q3, k)
        vl, vh = _iq4_values(q, t0, t1, t2, t3, ASM)  # values 4k.., 16 + 4k..
        if Q8X:
            isum = _dp4a(vl, tl.load(xq_ptr + xi + k), isum, ASM, True)
            isum = _dp4a(vh, tl.load(xq_ptr + xi + 4 + k), isum, ASM, True)
        else:
            if XV:
                xl = tl.load((xp + 4 * k).to(tl.pointer_type(tl.int64)))
                xh = tl.load((xp + 16 + 4 * k).to(tl.pointer_type(tl.int64)))
            else:
                xl = xp + 4 * k
                xh = xp + 16 + 4 * k
            for m in tl.static_range(4):
                s += _sc8(vl, m) * _x4(xl, m, XV) + _sc8(vh, m) * _x4(xh, m, XV)
    if Q8X:
        return dl * tl.load(xd_ptr) * isum.to(tl.float32)
    return dl * s


@triton.jit
def iq4xs_t_dot(wt_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, b_lo, b_hi,
                BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr,
                ASM: tl.constexpr):
    # half a block (4 sub-blocks: 16 qs words, and the d/scales_h and scales_l words) per
    # step; tab_ptr: the 16 int8 values (carve_kernels/lowbit_blocks.lookup_table), 4-byte aligned
    t0, t1, t2, t3 = _iq4_table(tab_ptr)
    xw = xq_ptr.to(tl.pointer_type(tl.int32))
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 34 * N + rows
        h0 = tl.load(base, mask=rmask, other=0)
        h1 = tl.load(base + N, mask=rmask, other=0)
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + (2 + 16 * n) * N, N, rmask)
        e0, e1, e2, e3, e4, e5, e6, e7 = _ld8(base + (10 + 16 * n) * N, N, rmask)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ e0 ^ e1 ^ e2 ^ e3 ^ e4 ^ e5 ^ e6 ^ e7 ^ h0 ^ h1
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together
        d = _f16(h0, False)
        for i in tl.static_range(4):  # sub-block 4 n + i
            if i == 0:
                q0, q1, q2, q3 = a0, a1, a2, a3
            elif i == 1:
                q0, q1, q2, q3 = a4, a5, a6, a7
            elif i == 2:
                q0, q1, q2, q3 = e0, e1, e2, e3
            else:
                q0, q1, q2, q3 = e4, e5, e6, e7
            ib = 4 * n + i
            ls = ((h1 >> (4 * ib)) & 15) | (((h0 >> (16 + 2 * ib)) & 3) << 4)
            dl = d * (ls - 32).to(tl.float32)
            acc += _iq4_sub(q0, q1, q2, q3, t0, t1, t2, t3, dl, xw, xd_ptr + b * 8 + ib,
                            b * 64 + 8 * ib, x_ptr + b * 256 + 32 * ib, BLOCK_N, XV, Q8X, ASM)
    return acc

"""The per-block dot products of the T-layout GEMVs (carve_kernels/gemv_t.py): for Q4_K and Q5_K
(Q6_K's are in carve_kernels/gemv_t_q6k.py), one step of a program's row tile against x as
float (bf16 four values to an 8-byte load, or float32) or as its int8 copy
(carve_kernels/q8x.py) through ``dp4a``; and the helpers the other bodies share (``_dp4a``,
``_funnel``, ``_pick4``, ``_ld8``, ``_x4``, ``_bits``, ``_sc8``). Every step issues all of its
weight loads before its math (see ``q4k_t_dot_half``); each thread keeps its rows' sums in
registers. Nibbles become floats as 1 + q/16 through the mantissa of 1.0.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _nib(w, S: tl.constexpr):
    # nibble at bit S of each word as the float 1 + q/16 (q into the top of the mantissa of 1.0:
    # one shift and one LOP3, no convert); the caller takes the 1 back out per sub-block
    return (_bits(w, S, 0xF, 19) | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def _pick4(a0, a1, a2, a3, K: tl.constexpr):
    # a<K> of four words, K known when compiling (registers cannot be indexed)
    if K == 0:
        w = a0
    elif K == 1:
        w = a1
    elif K == 2:
        w = a2
    else:
        w = a3
    return w


@triton.jit
def _pick8(a0, a1, a2, a3, a4, a5, a6, a7, K: tl.constexpr):
    # a<K> of eight words, K known when compiling
    if K < 4:
        w = _pick4(a0, a1, a2, a3, K)
    else:
        w = _pick4(a4, a5, a6, a7, K - 4)
    return w


@triton.jit
def _k4_sm(w0, w1, w2, J):
    # get_scale_min_k4 of ggml-quants.c for sub-block J (a scalar, 0..7) of the 12 scale bytes
    # in words w0..w2
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
        # a bf16 is the top half of its float32: one shift or one AND per value
        w = (xp >> (32 * (m // 2))).to(tl.int32)
        if m % 2 == 0:
            w = w << 16
        else:
            w = w & -65536
        return w.to(tl.float32, bitcast=True)
    else:
        return tl.load(xp + m).to(tl.float32)


@triton.jit
def _word(w, v, xp, sl, sh, ul, uh, xsl, xsh, XV: tl.constexpr, PAIR: tl.constexpr,
          Q5: tl.constexpr):
    # one word of 4 rows' qs: bytes m = 0..3 are l = 4j + m of the chunk; low nibble against
    # x[l], high against x[32 + l] (xp points at x[4j] of the chunk). PAIR: v is the same word
    # of a second matrix (up beside gate), summed into ul/uh with the same x values. Q5: w
    # and v are pairs (low values, high values) of words of 5-bit bytes (``_q5_bytes``), each
    # value the float 1 + q/32
    if XV:
        xlv = tl.load(xp.to(tl.pointer_type(tl.int64)))
        xhv = tl.load((xp + 32).to(tl.pointer_type(tl.int64)))
    else:
        xlv = xp
        xhv = xp + 32
    if Q5:
        wl, wh = w
        vl, vh = v
    else:
        wl, wh, vl, vh = w, w, v, v
    for m in tl.static_range(4):
        xl = _x4(xlv, m, XV)
        xh = _x4(xhv, m, XV)
        sl += _val(wl, m, 0, Q5) * xl
        sh += _val(wh, m, 4, Q5) * xh
        if PAIR:
            ul += _val(vl, m, 0, Q5) * xl
            uh += _val(vh, m, 4, Q5) * xh
        xsl += xl
        xsh += xh
    return sl, sh, ul, uh, xsl, xsh


@triton.jit
def _val(w, m: tl.constexpr, HI: tl.constexpr, Q5: tl.constexpr):
    # value m of word w as a float: Q4_K's nibble at bit 8m + HI as 1 + q/16, or (Q5) the
    # 5-bit byte m as 1 + q/32, each through the mantissa of 1.0
    if Q5:
        return (_bits(w, 8 * m, 0x1F, 18) | 0x3F800000).to(tl.float32, bitcast=True)
    return _nib(w, 8 * m + HI)


@triton.jit
def _q5_bytes(w, qh, c):
    # Q5_K: qs word w of chunk c with its qh word (bit 2c of byte m: value m's fifth bit in
    # the low sub-block, bit 2c + 1 in the high one) as (low values, high values), a 5-bit
    # value a byte
    hs = 2 * c
    lo = (w & 0x0F0F0F0F) | (((qh >> hs) & 0x01010101) << 4)
    hi = ((w >> 4) & 0x0F0F0F0F) | (((qh >> (hs + 1)) & 0x01010101) << 4)
    return lo, hi


@triton.jit
def _ld8(qp, N, rmask):
    return (tl.load(qp, mask=rmask, other=0), tl.load(qp + N, mask=rmask, other=0),
            tl.load(qp + 2 * N, mask=rmask, other=0), tl.load(qp + 3 * N, mask=rmask, other=0),
            tl.load(qp + 4 * N, mask=rmask, other=0), tl.load(qp + 5 * N, mask=rmask, other=0),
            tl.load(qp + 6 * N, mask=rmask, other=0), tl.load(qp + 7 * N, mask=rmask, other=0))


@triton.jit
def _k4_mix(h0, h1, h2, h3, c, sl, sh, xsl, xsh, Q5: tl.constexpr):
    # chunk c's two sub-blocks from their sums of (1 + q/16) x (Q5: 1 + q/32) and of x
    d = (h0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    scl, mnl = _k4_sm(h1, h2, h3, 2 * c)
    sch, mnh = _k4_sm(h1, h2, h3, 2 * c + 1)
    if Q5:
        d = d * 32.0
    else:
        d = d * 16.0
    return d * (scl * (sl - xsl) + sch * (sh - xsh)) - dmin * (mnl * xsl + mnh * xsh)


@triton.jit
def _words(a0, a1, a2, a3, a4, a5, a6, a7, q, c, Q5: tl.constexpr):
    # a chunk's 8 qs words as the values _word takes (Q5: with their 8 qh words q)
    # (one return: the compiler checks every return's type, even in a branch it drops)
    if Q5:
        r = (_q5_bytes(a0, q[0], c), _q5_bytes(a1, q[1], c), _q5_bytes(a2, q[2], c),
             _q5_bytes(a3, q[3], c), _q5_bytes(a4, q[4], c), _q5_bytes(a5, q[5], c),
             _q5_bytes(a6, q[6], c), _q5_bytes(a7, q[7], c))
    else:
        r = (a0, a1, a2, a3, a4, a5, a6, a7)
    return r


@triton.jit
def _chunk(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, h0, h1, h2, h3,
           k0, k1, k2, k3, qa, qb, xb, c, BLOCK_N: tl.constexpr, XV: tl.constexpr,
           PAIR: tl.constexpr, Q5: tl.constexpr):
    # chunk c (64 values) of the words a (headers h) and, PAIR, of b (headers k); Q5: qa, qb
    # their 8 qh words each
    z = tl.zeros([BLOCK_N], dtype=tl.float32)
    sl, sh, ul, uh = z, z, z, z
    xsl = 0.0
    xsh = 0.0
    a0, a1, a2, a3, a4, a5, a6, a7 = _words(a0, a1, a2, a3, a4, a5, a6, a7, qa, c, Q5)
    if PAIR:
        b0, b1, b2, b3, b4, b5, b6, b7 = _words(b0, b1, b2, b3, b4, b5, b6, b7, qb, c, Q5)
    else:
        b0, b1, b2, b3, b4, b5, b6, b7 = a0, a1, a2, a3, a4, a5, a6, a7
    sl, sh, ul, uh, xsl, xsh = _word(a0, b0, xb, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a1, b1, xb + 4, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a2, b2, xb + 8, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a3, b3, xb + 12, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a4, b4, xb + 16, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a5, b5, xb + 20, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a6, b6, xb + 24, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    sl, sh, ul, uh, xsl, xsh = _word(a7, b7, xb + 28, sl, sh, ul, uh, xsl, xsh, XV, PAIR, Q5)
    r = _k4_mix(h0, h1, h2, h3, c, sl, sh, xsl, xsh, Q5)
    r2 = z
    if PAIR:
        r2 = _k4_mix(k0, k1, k2, k3, c, ul, uh, xsl, xsh, Q5)
    return r, r2


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr, SIGNED: tl.constexpr = False):
    # c + the 4 bytes of a (unsigned; SIGNED: signed) times those of b (signed); ASM: the
    # GPU's instruction, else the same sum in integer ops (the interpreter runs no assembly)
    if ASM:
        if SIGNED:
            return tl.inline_asm_elementwise("dp4a.s32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                             [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        for k in tl.static_range(4):
            if SIGNED:
                ak = (a << (24 - 8 * k)) >> 24
            else:
                ak = (a >> (8 * k)) & 0xFF
            c += ak * ((b << (24 - 8 * k)) >> 24)
        return c


@triton.jit
def _funnel(lo, hi, s, ASM: tl.constexpr):
    # the 32 bits at bit s (0..32) of the 64-bit word hi:lo: bytes of an unaligned word from the
    # two aligned words around it (ASM: one funnel shift; s = 32 gives hi). Used by the
    # MXFP4 (carve_kernels/gemv_q8_blocks.py) and Q8_0 (carve_kernels/gemv_dot.py) bodies
    if ASM:
        return tl.inline_asm_elementwise("shf.r.clamp.b32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [lo, hi, s], dtype=tl.int32, is_pure=True, pack=1)
    else:
        v = (lo.to(tl.int64) & 0xFFFFFFFF) | (hi.to(tl.int64) << 32)
        return (v >> s.to(tl.int64)).to(tl.int32)


@triton.jit
def _q8_word(w, v, xl, J: tl.constexpr, il, ih, jl, jh, qa, qb, c, ASM: tl.constexpr,
             PAIR: tl.constexpr, Q5: tl.constexpr):
    # word J of a chunk: its low nibbles are values 4J..4J+3 of the low sub-block, the high
    # ones of the high sub-block, against x's int8 words J of both (xl: the low sub-block's
    # 8 words, the high one's after them; broadcast to the rows). Q5: qa (qb) is the qh word
    # J of w (v), whose bits 2c and 2c + 1 are the values' fifth bits
    z = w * 0
    xlo = tl.load(xl + J) + z
    xhi = tl.load(xl + 8 + J) + z
    wl, wh = _value_bytes(w, qa, c, Q5)
    il = _dp4a(wl, xlo, il, ASM)
    ih = _dp4a(wh, xhi, ih, ASM)
    if PAIR:
        vl, vh = _value_bytes(v, qb, c, Q5)
        jl = _dp4a(vl, xlo, jl, ASM)
        jh = _dp4a(vh, xhi, jh, ASM)
    return il, ih, jl, jh


@triton.jit
def _value_bytes(w, qh, c, Q5: tl.constexpr):
    # qs word w as (low values, high values), a value a byte: Q4_K's nibbles, or (Q5) Q5_K's
    # 5-bit values with their qh word (one return: see _words)
    if Q5:
        r = _q5_bytes(w, qh, c)
    else:
        r = (w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F)
    return r


@triton.jit
def _k4_mix_q8(h0, h1, h2, h3, c, il, ih, dl, dh, sl, sh):
    # chunk c's two sub-blocks from the integer dots and x's int8 scales and sums
    d = (h0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    scl, mnl = _k4_sm(h1, h2, h3, 2 * c)
    sch, mnh = _k4_sm(h1, h2, h3, 2 * c + 1)
    return d * (scl * dl * il.to(tl.float32) + sch * dh * ih.to(tl.float32)) \
        - dmin * (mnl * sl + mnh * sh)


@triton.jit
def _q8_chunk(a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7, h0, h1, h2, h3,
              k0, k1, k2, k3, qa, qb, xq_ptr, xd_ptr, xs_ptr, blk, c, ASM: tl.constexpr,
              PAIR: tl.constexpr, Q5: tl.constexpr):
    # chunk c of block blk on int8 x (sub-blocks 2c and 2c + 1, 8 words each); Q5: qa, qb the
    # 8 qh words of a, b
    g = blk * 8 + 2 * c
    xl = xq_ptr + g * 8
    z = a0 * 0
    il, ih, jl, jh = z, z, z, z
    il, ih, jl, jh = _q8_word(a0, b0, xl, 0, il, ih, jl, jh, qa[0], qb[0], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a1, b1, xl, 1, il, ih, jl, jh, qa[1], qb[1], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a2, b2, xl, 2, il, ih, jl, jh, qa[2], qb[2], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a3, b3, xl, 3, il, ih, jl, jh, qa[3], qb[3], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a4, b4, xl, 4, il, ih, jl, jh, qa[4], qb[4], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a5, b5, xl, 5, il, ih, jl, jh, qa[5], qb[5], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a6, b6, xl, 6, il, ih, jl, jh, qa[6], qb[6], c, ASM, PAIR, Q5)
    il, ih, jl, jh = _q8_word(a7, b7, xl, 7, il, ih, jl, jh, qa[7], qb[7], c, ASM, PAIR, Q5)
    dl, dh = tl.load(xd_ptr + g), tl.load(xd_ptr + g + 1)
    sl, sh = tl.load(xs_ptr + g), tl.load(xs_ptr + g + 1)
    r = _k4_mix_q8(h0, h1, h2, h3, c, il, ih, dl, dh, sl, sh)
    r2 = r * 0.0
    if PAIR:
        r2 = _k4_mix_q8(k0, k1, k2, k3, c, jl, jh, dl, dh, sl, sh)
    return r, r2


@triton.jit
def _q4k_half_loads(wt_ptr, b, c0, rows, rmask, N, Q5: tl.constexpr):
    # the 4 header words and the 16 qs words of half block c0 // 2 of block b (Q5_K: 44
    # words a block, its 8 qh words between the headers and the qs)
    if Q5:
        hp = wt_ptr + b * 44 * N + rows
        qp = hp + (12 + c0 * 8) * N
    else:
        hp = wt_ptr + b * 36 * N + rows
        qp = hp + (4 + c0 * 8) * N
    h0 = tl.load(hp, mask=rmask, other=0)
    h1 = tl.load(hp + N, mask=rmask, other=0)
    h2 = tl.load(hp + 2 * N, mask=rmask, other=0)
    h3 = tl.load(hp + 3 * N, mask=rmask, other=0)
    a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(qp, N, rmask)
    e0, e1, e2, e3, e4, e5, e6, e7 = _ld8(qp + 8 * N, N, rmask)
    return h0, h1, h2, h3, a0, a1, a2, a3, a4, a5, a6, a7, e0, e1, e2, e3, e4, e5, e6, e7


@triton.jit
def _qh_loads(wt_ptr, b, rows, rmask, N, Q5: tl.constexpr):
    # Q5_K: the 8 qh words of block b (words 4-11), both chunks of a half block read them;
    # else 8 zeros nothing reads
    if Q5:
        return _ld8(wt_ptr + b * 44 * N + rows + 4 * N, N, rmask)
    z = rows * 0
    return z, z, z, z, z, z, z, z


@triton.jit
def _xor8(q):
    return q[0] ^ q[1] ^ q[2] ^ q[3] ^ q[4] ^ q[5] ^ q[6] ^ q[7]


@triton.jit
def q4k_t_dot_half(wt_ptr, ut_ptr, x_ptr, xq_ptr, xd_ptr, xs_ptr, rows, rmask, N, b_lo, b_hi,
                   BLOCK_N: tl.constexpr, XV: tl.constexpr, PAIR: tl.constexpr,
                   Q8X: tl.constexpr, ASM: tl.constexpr, Q5: tl.constexpr = False):
    # half a block (2 chunks, 16 words per row) per step, every load of the step issued before
    # its math: ptxas keeps loads at the top of the body they are used in. PAIR: the same
    # half block of ut (up beside gate) in the same step, on the same x values. Q8X: x is the
    # int8 copy (carve_kernels/q8x.py) and the nibbles multiply by dp4a. Q5: Q5_K, whose fifth bits
    # (the block's 8 qh words, read by both half steps) join the nibbles as 5-bit bytes
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        c0 = (hb % 2) * 2
        h0, h1, h2, h3, a0, a1, a2, a3, a4, a5, a6, a7, e0, e1, e2, e3, e4, e5, e6, e7 = \
            _q4k_half_loads(wt_ptr, b, c0, rows, rmask, N, Q5)
        qa = _qh_loads(wt_ptr, b, rows, rmask, N, Q5)
        # ptxas issues loads just before their use, so a warp has ~1 load in flight; a
        # dependence of the first word on all of them (through ``N >> 31``, 0 at run time)
        # makes it issue the step's 20 (PAIR: 40; Q5: 8 and 16 more) loads together (SASS
        # read for sm_90)
        t = (a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ e0 ^ e1 ^ e2 ^ e3 ^ e4 ^ e5 ^ e6 ^ e7 ^ h0 ^ h1
             ^ h2 ^ h3)
        if Q5:
            t ^= _xor8(qa)
        if PAIR:
            k0, k1, k2, k3, p0, p1, p2, p3, p4, p5, p6, p7, f0, f1, f2, f3, f4, f5, f6, f7 = \
                _q4k_half_loads(ut_ptr, b, c0, rows, rmask, N, Q5)
            qb = _qh_loads(ut_ptr, b, rows, rmask, N, Q5)
            t ^= (p0 ^ p1 ^ p2 ^ p3 ^ p4 ^ p5 ^ p6 ^ p7 ^ f0 ^ f1 ^ f2 ^ f3 ^ f4 ^ f5 ^ f6 ^ f7
                  ^ k0 ^ k1 ^ k2 ^ k3)
            if Q5:
                t ^= _xor8(qb)
        else:
            k0, k1, k2, k3, p0, p1, p2, p3, p4, p5, p6, p7, f0, f1, f2, f3, f4, f5, f6, f7 = \
                h0, h1, h2, h3, a0, a1, a2, a3, a4, a5, a6, a7, e0, e1, e2, e3, e4, e5, e6, e7
            qb = qa
        a0 = a0 + (t & (N >> 31))
        if Q8X:
            r, r2 = _q8_chunk(a0, a1, a2, a3, a4, a5, a6, a7, p0, p1, p2, p3, p4, p5, p6, p7,
                              h0, h1, h2, h3, k0, k1, k2, k3, qa, qb, xq_ptr, xd_ptr, xs_ptr, b,
                              c0, ASM, PAIR, Q5)
            acc += r
            acc2 += r2
            r, r2 = _q8_chunk(e0, e1, e2, e3, e4, e5, e6, e7, f0, f1, f2, f3, f4, f5, f6, f7,
                              h0, h1, h2, h3, k0, k1, k2, k3, qa, qb, xq_ptr, xd_ptr, xs_ptr, b,
                              c0 + 1, ASM, PAIR, Q5)
        else:
            xb = x_ptr + b * 256 + 64 * c0
            r, r2 = _chunk(a0, a1, a2, a3, a4, a5, a6, a7, p0, p1, p2, p3, p4, p5, p6, p7,
                           h0, h1, h2, h3, k0, k1, k2, k3, qa, qb, xb, c0, BLOCK_N, XV, PAIR, Q5)
            acc += r
            acc2 += r2
            r, r2 = _chunk(e0, e1, e2, e3, e4, e5, e6, e7, f0, f1, f2, f3, f4, f5, f6, f7,
                           h0, h1, h2, h3, k0, k1, k2, k3, qa, qb, xb + 64, c0 + 1, BLOCK_N, XV,
                           PAIR, Q5)
        acc += r
        acc2 += r2
    return acc, acc2


@triton.jit
def _bits(w, S: tl.constexpr, MASK: tl.constexpr, D: tl.constexpr):
    # ((w >> S) & MASK) << D in one shift and one AND (the AND drops any sign bits)
    if D >= S:
        return (w << (D - S)) & (MASK << D)
    else:
        return (w >> (S - D)) & (MASK << D)


@triton.jit
def _sc8(w, BYTE: tl.constexpr):
    # signed byte BYTE of w as float32
    return ((w << (24 - 8 * BYTE)) >> 24).to(tl.float32)

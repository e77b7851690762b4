"""T-layout step bodies (carve_kernels/gemv_t.py) of the grid IQ types with rows of 4 or 8
values: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S (IQ1_S and IQ1_M: carve_kernels/gemv_t_iq1.py).
The thread-owns-rows pattern is the other T bodies' (carve_kernels/gemv_t_low.py).

On decode's int8 copy of x (carve_kernels/q8x.py) each grid row is gathered from the table (one
8- or 4-byte word a row; in shared memory where gemv_t.SMEM_TYPES holds the type), each word
xor'ed with its sign mask (0xFF bytes where a value is negative: carve_kernels/gemv_iq.py
``_byte_masks``, one multiply and one byte permute a word), which makes a negative value
-g - 1, so the dp4a of the masks themselves is taken back out (IQ3_S's 9-bit indices made by a
byte permute too). On float x (bf16 as 64-bit words of four, or float32 or f16 one value a
load) the signed bytes (``_signed``) become floats by a convert.

Blocks (GGUF order; the T layout keeps the words of a block): IQ2_XXS, 66 bytes: d (to the
tail plane), then 16 words, two a group of 32 values (4 index bytes; 4 x 7 sign bits and a
4-bit scale). IQ2_XS, 74 bytes: d (to the tail plane), then 18 words: qs (words 0-15, a 16-bit
word a grid row of 8: 9-bit index, 7 sign bits), scales (words 16-17, a byte a group: a nibble
for its rows 0-1, one for rows 2-3). IQ2_S, 82 bytes: d (to the tail plane), then 20 words: the
index bytes (words 0-7, a word a group), signs (words 8-15, a byte a row), qh (words 16-17, a
byte a group: the indices' 2 high bits), scales (words 18-19, as IQ2_XS's). IQ3_XXS, 98 bytes:
d (to the tail plane), then 24 words: qs (words 0-15, 2 a group, an index byte a grid row of
4), then a word a group (4 x 7 sign bits, each for a pair of rows, and a 4-bit scale). IQ3_S,
110 bytes: d (to the tail plane), then 27 words: qs (2 a group, an index byte a row of 4), qh (a
byte a group, the indices' 9th bits), signs (a word a group, 4 bits a row), scales (a nibble a
group).
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_iq import _byte_masks, _ksigns, _sign_masks, _signed, grid_row, grid_tab
from carve_kernels.gemv_t_dot import _dp4a, _ld8, _pick4, _pick8, _sc8, _x4
from carve_kernels.gemv_t_low import _prmt, _x64


# --- the grid types: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS and IQ3_S -------------------
@triton.jit
def _grid_dot(w0, w1, xp, xq_ptr, xi, isum, s, W: tl.constexpr, XV: tl.constexpr,
              Q8X: tl.constexpr, ASM: tl.constexpr):
    # one signed grid row (W = 8: words w0, w1; W = 4: w0) against x: int8 words xi.. into
    # isum, or float x at xp into s
    if Q8X:
        if W == 8:
            xa, xb = _x64(xq_ptr, xi)
            isum = _dp4a(w1, xb, _dp4a(w0, xa, isum, ASM, True), ASM, True)
        else:
            isum = _dp4a(w0, tl.load(xq_ptr + xi), isum, ASM, True)
    else:
        if XV:
            xa = tl.load(xp.to(tl.pointer_type(tl.int64)))
        else:
            xa = xp
        for m in tl.static_range(4):
            s += _sc8(w0, m) * _x4(xa, m, XV)
        if W == 8:
            if XV:
                xb = tl.load((xp + 4).to(tl.pointer_type(tl.int64)))
            else:
                xb = xp + 4
            for m in tl.static_range(4):
                s += _sc8(w1, m) * _x4(xb, m, XV)
    return isum, s


@triton.jit
def _iq2xxs_group(aux0, aux1, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                  XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 4 grid rows of 8 (index bytes of aux0; 7 sign bits each and the
    # group's 4-bit scale in aux1)
    isum = aux0 * 0
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    if Q8X:
        # the sign masks m: (g ^ m) is -g - 1 where m is 0xFF, so the group's sum is
        # dp4a(g ^ m, x) less dp4a(m, x) (m's bytes -1 or 0)
        neg = aux0 * 0
        for r in tl.static_range(4):
            gr = grid_row(tab, ((aux0 >> (8 * r)) & 255), True, ASM)  # the row's 8 grid bytes, 1..127
            m0, m1 = _sign_masks((aux1 >> (7 * r)) & 127, ASM)
            xa, xb = _x64(xq_ptr, xi + 2 * r)
            isum = _dp4a(gr.to(tl.int32) ^ m0, xa, isum, ASM, True)
            isum = _dp4a((gr >> 32).to(tl.int32) ^ m1, xb, isum, ASM, True)
            neg = _dp4a(m1, xb, _dp4a(m0, xa, neg, ASM, True), ASM, True)
        db = d * (0.5 + ((aux1 >> 28) & 15).to(tl.float32)) * 0.25
        return db * tl.load(xd_ptr) * (isum - neg).to(tl.float32)
    for r in tl.static_range(4):
        gr = grid_row(tab, ((aux0 >> (8 * r)) & 255), True, ASM)  # the row's 8 grid bytes, 1..127
        sg = _ksigns((aux1 >> (7 * r)) & 127, ASM)
        isum, s = _grid_dot(_signed(gr.to(tl.int32), sg & 15),
                            _signed((gr >> 32).to(tl.int32), (sg >> 4) & 15), xp + 8 * r,
                            xq_ptr, xi + 2 * r, isum, s, 8, XV, Q8X, ASM)
    db = d * (0.5 + ((aux1 >> 28) & 15).to(tl.float32)) * 0.25
    return db * s


@triton.jit
def iq2xxs_t_dot(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
                 BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr,
                 ASM: tl.constexpr):
    # IQ2_XXS: words 0-15 the qs of groups 0-7 (2 a group: 4 index bytes, then the signs and
    # scale), its f16 d in the tail plane. Half a block (4 groups, 8 words) per step
    tab = grid_tab(tab_ptr, True, ASM)
    dp = wh_ptr + NB * 32 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(wt_ptr + b * 16 * N + 8 * n * N + rows, N, rmask)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together
        for j in tl.static_range(4):  # group 4 n + j
            u = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j)
            v = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j + 1)
            g = 4 * n + j
            acc += _iq2xxs_group(u, v, tab, d, xq_ptr, xd_ptr + b * 8 + g, b * 64 + 8 * g,
                                 x_ptr + b * 256 + 32 * g, BLOCK_N, XV, Q8X, ASM)
    return acc


@triton.jit
def _iq3s_group(q0, q1, qh, sg, sc, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 8 grid rows of 4 (index bytes of q0, q1, their 9th bits in the
    # byte qh, 4 sign bits each in sg), the group's scale nibble sc
    isum = q0 * 0
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    db = d * (1 + 2 * sc).to(tl.float32)
    if Q8X:  # two rows' sign masks from a byte of sg, as IQ2_XXS's: dp4a(g ^ m) less dp4a(m)
        # the rows' 9th index bits as bytes 0 / 1 (rows 0-3, 4-7), so that a byte permute
        # makes each row's index: its byte of q, its byte of these, then two zero bytes (the
        # sign of a 0 / 1 byte repeated)
        e0 = ((qh & 15) * 0x00204081) & 0x01010101
        e1 = (((qh >> 4) & 15) * 0x00204081) & 0x01010101
        neg = q0 * 0
        for h in tl.static_range(4):
            if h < 2:
                q = q0
                e = e0
            else:
                q = q1
                e = e1
            s8 = sg >> (8 * h)
            m0, m1 = _byte_masks(s8 & 127, s8, ASM)
            r = 2 * h
            k = r % 4
            g0 = grid_row(tab, _prmt(q, e, k | ((4 + k) << 4) | ((12 + k) << 8) | ((12 + k) << 12),
                                     ASM), False, ASM)
            g1 = grid_row(tab, _prmt(q, e, (k + 1) | ((5 + k) << 4) | ((13 + k) << 8)
                                     | ((13 + k) << 12), ASM), False, ASM)
            xa, xb = _x64(xq_ptr, xi + r)
            isum = _dp4a(g1 ^ m1, xb, _dp4a(g0 ^ m0, xa, isum, ASM, True), ASM, True)
            neg = _dp4a(m1, xb, _dp4a(m0, xa, neg, ASM, True), ASM, True)
        out = db * tl.load(xd_ptr) * (isum - neg).to(tl.float32)
    else:
        for r in tl.static_range(8):
            if r < 4:
                q = q0
            else:
                q = q1
            gi = ((q >> (8 * (r % 4))) & 255) | (((qh >> r) & 1) << 8)
            w = _signed(grid_row(tab, gi, False, ASM), (sg >> (4 * r)) & 15)  # the row's 4 grid bytes
            isum, s = _grid_dot(w, w, xp + 4 * r, xq_ptr, xi + r, isum, s, 4, XV, Q8X, ASM)
        out = db * s
    return out


@triton.jit
def iq3s_t_dot(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
               BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # IQ3_S: words 0-15 qs (2 a group), 16-17 qh (a byte a group), 18-25 signs (a word a
    # group), 26 the scales (a nibble a group); its f16 d in the tail plane. Half a block (4
    # groups) per step
    tab = grid_tab(tab_ptr, False, ASM)
    dp = wh_ptr + NB * 54 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 27 * N + rows
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + 8 * n * N, N, rmask)
        qh = tl.load(base + (16 + n) * N, mask=rmask, other=0)
        s0 = tl.load(base + (18 + 4 * n) * N, mask=rmask, other=0)
        s1 = tl.load(base + (19 + 4 * n) * N, mask=rmask, other=0)
        s2 = tl.load(base + (20 + 4 * n) * N, mask=rmask, other=0)
        s3 = tl.load(base + (21 + 4 * n) * N, mask=rmask, other=0)
        sc = tl.load(base + 26 * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ qh ^ s0 ^ s1 ^ s2 ^ s3 ^ sc
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together
        for j in tl.static_range(4):  # group 4 n + j
            u = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j)
            v = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j + 1)
            sg = _pick4(s0, s1, s2, s3, j)
            g = 4 * n + j
            acc += _iq3s_group(u, v, (qh >> (8 * j)) & 255, sg, (sc >> (4 * g)) & 15, tab, d,
                               xq_ptr, xd_ptr + b * 8 + g, b * 64 + 8 * g,
                               x_ptr + b * 256 + 32 * g, BLOCK_N, XV, Q8X, ASM)
    return acc


@triton.jit
def _iq3xxs_group(q0, q1, aux, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                  XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 4 pairs of grid rows of 4 (index bytes 2l and 2l + 1 of q0, q1;
    # the pair's 7 sign bits, as IQ2_XXS's for a row of 8, in aux), the scale aux's top nibble
    isum = q0 * 0
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    if Q8X:  # the sign masks as IQ2_XXS's
        neg = q0 * 0
        for r in tl.static_range(4):
            if r < 2:
                q = q0
            else:
                q = q1
            m0, m1 = _sign_masks((aux >> (7 * r)) & 127, ASM)
            g0 = grid_row(tab, ((q >> (16 * (r % 2))) & 255), False, ASM)
            g1 = grid_row(tab, ((q >> (16 * (r % 2) + 8)) & 255), False, ASM)
            xa, xb = _x64(xq_ptr, xi + 2 * r)
            isum = _dp4a(g1 ^ m1, xb, _dp4a(g0 ^ m0, xa, isum, ASM, True), ASM, True)
            neg = _dp4a(m1, xb, _dp4a(m0, xa, neg, ASM, True), ASM, True)
        db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
        return db * tl.load(xd_ptr) * (isum - neg).to(tl.float32)
    for r in tl.static_range(4):
        if r < 2:
            q = q0
        else:
            q = q1
        sg = _ksigns((aux >> (7 * r)) & 127, ASM)
        w0 = _signed(grid_row(tab, ((q >> (16 * (r % 2))) & 255), False, ASM), sg & 15)
        w1 = _signed(grid_row(tab, ((q >> (16 * (r % 2) + 8)) & 255), False, ASM), (sg >> 4) & 15)
        isum, s = _grid_dot(w0, w1, xp + 8 * r, xq_ptr, xi + 2 * r, isum, s, 8, XV, Q8X, ASM)
    db = d * (0.5 + ((aux >> 28) & 15).to(tl.float32)) * 0.5
    return db * s


@triton.jit
def iq3xxs_t_dot(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo,
                 b_hi, BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr,
                 ASM: tl.constexpr):
    # IQ3_XXS: words 0-15 qs (2 a group), 16-23 a group's signs and scale; its f16 d in the
    # tail plane. Half a block (4 groups: 8 qs words and 4 sign words) per step
    tab = grid_tab(tab_ptr, False, ASM)
    dp = wh_ptr + NB * 48 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 24 * N + rows
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + 8 * n * N, N, rmask)
        s0 = tl.load(base + (16 + 4 * n) * N, mask=rmask, other=0)
        s1 = tl.load(base + (17 + 4 * n) * N, mask=rmask, other=0)
        s2 = tl.load(base + (18 + 4 * n) * N, mask=rmask, other=0)
        s3 = tl.load(base + (19 + 4 * n) * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ s0 ^ s1 ^ s2 ^ s3
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together
        for j in tl.static_range(4):  # group 4 n + j
            u = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j)
            v = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j + 1)
            g = 4 * n + j
            acc += _iq3xxs_group(u, v, _pick4(s0, s1, s2, s3, j), tab, d, xq_ptr,
                                 xd_ptr + b * 8 + g, b * 64 + 8 * g, x_ptr + b * 256 + 32 * g,
                                 BLOCK_N, XV, Q8X, ASM)
    return acc


@triton.jit
def _iq2_pair(w, sg, tab, acc, db, xq_ptr, xi, xp, R: tl.constexpr, BLOCK_N: tl.constexpr,
              XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # two grid rows of 8 (R, R + 1 of the group) that share a scale db: w[k] their grid
    # indices, sg[k] their 8 sign bits (Q8X: their sign masks, _byte_masks); added to acc
    # (Q8X: the integer sum times db, x's scale left to the caller)
    isum = w[0] * 0
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    if Q8X:  # as IQ2_XXS's: dp4a(g ^ m, x) less dp4a(m, x)
        neg = w[0] * 0
        for k in tl.static_range(2):
            gr = grid_row(tab, w[k], True, ASM)
            m = sg[k]
            xa, xb = _x64(xq_ptr, xi + 2 * (R + k))
            isum = _dp4a(gr.to(tl.int32) ^ m[0], xa, isum, ASM, True)
            isum = _dp4a((gr >> 32).to(tl.int32) ^ m[1], xb, isum, ASM, True)
            neg = _dp4a(m[1], xb, _dp4a(m[0], xa, neg, ASM, True), ASM, True)
        acc += db * (isum - neg).to(tl.float32)
    else:
        for k in tl.static_range(2):
            gr = grid_row(tab, w[k], True, ASM)
            isum, s = _grid_dot(_signed(gr.to(tl.int32), sg[k] & 15),
                                _signed((gr >> 32).to(tl.int32), (sg[k] >> 4) & 15),
                                xp + 8 * (R + k), xq_ptr, xi + 2 * (R + k), isum, s, 8, XV, Q8X,
                                ASM)
        acc += db * s
    return acc


@triton.jit
def _iq2xs_group(q0, q1, sc, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                 XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 4 rows of 8, row r the 16-bit half r % 2 of q0 (rows 0-1) or q1
    # (9-bit index, 7 sign bits); the scale nibbles of sc, low for rows 0-1, high for 2-3
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(2):
        if h == 0:
            q = q0
        else:
            q = q1
        u0 = q & 0xFFFF
        u1 = (q >> 16) & 0xFFFF
        db = d * (0.5 + ((sc >> (4 * h)) & 15).to(tl.float32)) * 0.25
        if Q8X:
            sg = (_sign_masks(u0 >> 9, ASM), _sign_masks(u1 >> 9, ASM))
        else:
            sg = (_ksigns(u0 >> 9, ASM), _ksigns(u1 >> 9, ASM))
        acc = _iq2_pair((u0 & 511, u1 & 511), sg, tab, acc, db, xq_ptr, xi, xp, 2 * h, BLOCK_N,
                        XV, Q8X, ASM)
    if Q8X:
        return tl.load(xd_ptr) * acc
    return acc


@triton.jit
def iq2xs_t_dot(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
                BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr,
                ASM: tl.constexpr):
    # IQ2_XS: words 0-15 qs (2 a group), 16-17 the scales (a byte a group); its f16 d in the
    # tail plane. Half a block (4 groups: 8 qs words and a scales word) per step
    tab = grid_tab(tab_ptr, True, ASM)
    dp = wh_ptr + NB * 36 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 18 * N + rows
        a0, a1, a2, a3, a4, a5, a6, a7 = _ld8(base + 8 * n * N, N, rmask)
        sc = tl.load(base + (16 + n) * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ sc
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together
        for j in tl.static_range(4):  # group 4 n + j
            u = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j)
            v = _pick8(a0, a1, a2, a3, a4, a5, a6, a7, 2 * j + 1)
            g = 4 * n + j
            acc += _iq2xs_group(u, v, (sc >> (8 * j)) & 255, tab, d, xq_ptr,
                                xd_ptr + b * 8 + g, b * 64 + 8 * g, x_ptr + b * 256 + 32 * g,
                                BLOCK_N, XV, Q8X, ASM)
    return acc


@triton.jit
def _iq2s_group(qi, sw, qh, sc, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 4 rows of 8, row r's index byte r of qi with bits 2r, 2r + 1 of
    # qh above it, its signs byte r of sw; the scale nibbles of sc as IQ2_XS's
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(2):
        r = 2 * h
        db = d * (0.5 + ((sc >> (4 * h)) & 15).to(tl.float32)) * 0.25
        s0 = sw >> (8 * r)
        s1 = sw >> (8 * r + 8)
        if Q8X:
            sg = (_byte_masks(s0 & 127, s0, ASM), _byte_masks(s1 & 127, s1, ASM))
        else:
            sg = (s0 & 255, s1 & 255)
        acc = _iq2_pair((((qi >> (8 * r)) & 255) | (((qh >> (2 * r)) & 3) << 8),
                         ((qi >> (8 * r + 8)) & 255) | (((qh >> (2 * r + 2)) & 3) << 8)),
                        sg, tab, acc, db, xq_ptr, xi, xp, r, BLOCK_N, XV, Q8X, ASM)
    if Q8X:
        return tl.load(xd_ptr) * acc
    return acc


@triton.jit
def iq2s_t_dot(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
               BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # IQ2_S: words 0-7 the index bytes (a word a group), 8-15 the signs, 16-17 qh, 18-19 the
    # scales (a byte a group each); its f16 d in the tail plane. Half a block (4 groups) per step
    tab = grid_tab(tab_ptr, True, ASM)
    dp = wh_ptr + NB * 40 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 20 * N + rows
        i0 = tl.load(base + (4 * n) * N, mask=rmask, other=0)
        i1 = tl.load(base + (4 * n + 1) * N, mask=rmask, other=0)
        i2 = tl.load(base + (4 * n + 2) * N, mask=rmask, other=0)
        i3 = tl.load(base + (4 * n + 3) * N, mask=rmask, other=0)
        s0 = tl.load(base + (8 + 4 * n) * N, mask=rmask, other=0)
        s1 = tl.load(base + (9 + 4 * n) * N, mask=rmask, other=0)
        s2 = tl.load(base + (10 + 4 * n) * N, mask=rmask, other=0)
        s3 = tl.load(base + (11 + 4 * n) * N, mask=rmask, other=0)
        qh = tl.load(base + (16 + n) * N, mask=rmask, other=0)
        sc = tl.load(base + (18 + n) * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = i1 ^ i2 ^ i3 ^ s0 ^ s1 ^ s2 ^ s3 ^ qh ^ sc
        i0 = i0 + (t & (N >> 31))  # the step's loads issued together
        for j in tl.static_range(4):  # group 4 n + j
            g = 4 * n + j
            acc += _iq2s_group(_pick4(i0, i1, i2, i3, j), _pick4(s0, s1, s2, s3, j),
                               (qh >> (8 * j)) & 255, (sc >> (8 * j)) & 255, tab, d, xq_ptr,
                               xd_ptr + b * 8 + g, b * 64 + 8 * g, x_ptr + b * 256 + 32 * g,
                               BLOCK_N, XV, Q8X, ASM)
    return acc

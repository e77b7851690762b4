"""T-layout step bodies (carve_kernels/gemv_t.py) of IQ1_S and IQ1_M: grid rows of 8 with a delta,
the other grid types' pattern (carve_kernels/gemv_t_grid.py). IQ1's grid is stored times 8 so
that ``grid + delta`` is an exact integer, the delta added to every byte (``_add_bytes``).

Blocks (GGUF order; the T layout keeps the words of a block): IQ1_S, 50 bytes: d (to the tail
plane), then 12 words: the index bytes (words 0-7, a word a group), qh (words 8-11, 16 bits a
group: 3 high index bits a row, a 3-bit scale, the delta's sign). IQ1_M, 56 bytes = 14 words,
no d of its own: the index bytes (words 0-7), qh (words 8-11, 16 bits a group: a nibble a row,
3 high index bits and the delta's sign), scales (words 12-13: 3 bits per two rows, d's 16 bits
in the top nibbles of the four halves).
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_iq import _add_bytes, grid_row, grid_tab
from carve_kernels.gemv_t_dot import _pick4
from carve_kernels.gemv_t_grid import _grid_dot


@triton.jit
def _iq1_pair(w, dl, tab, acc, db, xq_ptr, xi, xp, R: tl.constexpr, BLOCK_N: tl.constexpr,
              XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # two IQ1 grid rows of 8 (R, R + 1 of the group) sharing the scale db: w[k] their grid
    # indices, dl[k] their deltas (+-1, in the table's units of grid / 8, added to every byte)
    isum = w[0] * 0
    s = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(2):
        gr = grid_row(tab, w[k], True, ASM)
        dw = (dl[k] & 255) * 0x01010101
        isum, s = _grid_dot(_add_bytes(gr.to(tl.int32), dw),
                            _add_bytes((gr >> 32).to(tl.int32), dw), xp + 8 * (R + k), xq_ptr,
                            xi + 2 * (R + k), isum, s, 8, XV, Q8X, ASM)
    if Q8X:
        return acc + db * isum.to(tl.float32)
    return acc + db * s


@triton.jit
def _iq1s_group(qi, qh, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 4 rows of 8, row r's index byte r of qi with bits 3r..3r+2 of the
    # 16 bits qh above it; qh's bits 12-14 the group's scale, bit 15 its delta's sign
    db = d * (2 * ((qh >> 12) & 7) + 1).to(tl.float32) * 0.125
    delta = 1 - 2 * ((qh >> 15) & 1)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(2):
        r = 2 * h
        acc = _iq1_pair((((qi >> (8 * r)) & 255) | (((qh >> (3 * r)) & 7) << 8),
                         ((qi >> (8 * r + 8)) & 255) | (((qh >> (3 * r + 3)) & 7) << 8)),
                        (delta, delta), tab, acc, db, xq_ptr, xi, xp, r, BLOCK_N, XV, Q8X, ASM)
    if Q8X:
        return tl.load(xd_ptr) * acc
    return acc


@triton.jit
def iq1s_t_dot(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
               BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # IQ1_S: words 0-7 the index bytes (a word a group), 8-11 qh (16 bits a group); its f16 d
    # in the tail plane. Half a block (4 groups: 4 index words, 2 qh words) per step
    tab = grid_tab(tab_ptr, True, ASM)
    dp = wh_ptr + NB * 24 * N + rows
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 12 * N + rows
        i0 = tl.load(base + (4 * n) * N, mask=rmask, other=0)
        i1 = tl.load(base + (4 * n + 1) * N, mask=rmask, other=0)
        i2 = tl.load(base + (4 * n + 2) * N, mask=rmask, other=0)
        i3 = tl.load(base + (4 * n + 3) * N, mask=rmask, other=0)
        h0 = tl.load(base + (8 + 2 * n) * N, mask=rmask, other=0)
        h1 = tl.load(base + (9 + 2 * n) * N, mask=rmask, other=0)
        d = tl.load(dp + b * N, mask=rmask, other=0.0).to(tl.float32)
        t = i1 ^ i2 ^ i3 ^ h0 ^ h1
        i0 = i0 + (t & (N >> 31))  # the step's loads issued together
        for j in tl.static_range(4):  # group 4 n + j
            if j < 2:
                hw = h0
            else:
                hw = h1
            g = 4 * n + j
            acc += _iq1s_group(_pick4(i0, i1, i2, i3, j), (hw >> (16 * (j % 2))) & 0xFFFF, tab, d,
                               xq_ptr, xd_ptr + b * 8 + g, b * 64 + 8 * g,
                               x_ptr + b * 256 + 32 * g, BLOCK_N, XV, Q8X, ASM)
    return acc


@triton.jit
def _iq1m_group(qi, qn, sc, tab, d, xq_ptr, xd_ptr, xi, xp, BLOCK_N: tl.constexpr,
                XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # a group of 32 values: 4 rows of 8, row r's index byte r of qi with the low 3 bits of
    # nibble r of qn above it (its bit 3 the delta's sign); sc's two 3-bit scales, for rows 0-1
    # and 2-3
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for h in tl.static_range(2):
        r = 2 * h
        n0 = (qn >> (4 * r)) & 15
        n1 = (qn >> (4 * r + 4)) & 15
        db = d * (2 * ((sc >> (3 * h)) & 7) + 1).to(tl.float32) * 0.125
        acc = _iq1_pair((((qi >> (8 * r)) & 255) | ((n0 & 7) << 8),
                         ((qi >> (8 * r + 8)) & 255) | ((n1 & 7) << 8)),
                        (1 - 2 * (n0 >> 3), 1 - 2 * (n1 >> 3)), tab, acc, db, xq_ptr, xi, xp, r,
                        BLOCK_N, XV, Q8X, ASM)
    if Q8X:
        return tl.load(xd_ptr) * acc
    return acc


@triton.jit
def iq1m_t_dot(wt_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, rows, rmask, N, b_lo, b_hi,
               BLOCK_N: tl.constexpr, XV: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr):
    # IQ1_M: words 0-7 the index bytes, 8-11 qh (16 bits a group), 12-13 the scales (16 bits
    # per two groups, d's nibbles at their tops). Half a block (4 groups) per step
    tab = grid_tab(tab_ptr, True, ASM)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        n = hb % 2
        base = wt_ptr + b * 14 * N + rows
        i0 = tl.load(base + (4 * n) * N, mask=rmask, other=0)
        i1 = tl.load(base + (4 * n + 1) * N, mask=rmask, other=0)
        i2 = tl.load(base + (4 * n + 2) * N, mask=rmask, other=0)
        i3 = tl.load(base + (4 * n + 3) * N, mask=rmask, other=0)
        h0 = tl.load(base + (8 + 2 * n) * N, mask=rmask, other=0)
        h1 = tl.load(base + (9 + 2 * n) * N, mask=rmask, other=0)
        s0 = tl.load(base + 12 * N, mask=rmask, other=0)
        s1 = tl.load(base + 13 * N, mask=rmask, other=0)
        t = i1 ^ i2 ^ i3 ^ h0 ^ h1 ^ s0 ^ s1
        i0 = i0 + (t & (N >> 31))  # the step's loads issued together
        d16 = (((s0 >> 12) & 15) | (((s0 >> 28) & 15) << 4) | (((s1 >> 12) & 15) << 8)
               | (((s1 >> 28) & 15) << 12))
        d = d16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        sw = tl.where(n == 0, s0, s1)  # the scales of groups 4 n .. 4 n + 3
        for j in tl.static_range(4):  # group 4 n + j
            if j < 2:
                hw = h0
            else:
                hw = h1
            g = 4 * n + j
            sc = (sw >> (16 * (j // 2) + 6 * (j % 2))) & 63
            acc += _iq1m_group(_pick4(i0, i1, i2, i3, j), (hw >> (16 * (j % 2))) & 0xFFFF, sc,
                               tab, d, xq_ptr, xd_ptr + b * 8 + g, b * 64 + 8 * g,
                               x_ptr + b * 256 + 32 * g, BLOCK_N, XV, Q8X, ASM)
    return acc

"""GGUF-order row dot products of Q4_K, Q6_K and MXFP4 against x's int8 copy
(carve_kernels/q8x.py), through ``dp4a``: the decode GEMVs of matrices that stay in GGUF order
because something else reads them as the file has them (the routed experts, which prefill's
grouped GEMMs dequantize block by block, and which host memory holds as the file has them).

Lanes run along a block's words, not along rows: the threads of a program that share a row read
its block's consecutive words (Q4_K: 16 bytes a thread, a block's 128 quant bytes in 8 threads),
so a warp's loads are whole 128-byte lines however short the rows are (an expert's 768-value
rows are 3 blocks). x's int8 words and scales are loaded as full tiles in the weights' register
layout (the same address in the threads of other rows: L1 broadcasts, no layout conversion).

Q4_K: word j of chunk c (bytes 32c + 4j .. 32c + 4j + 3 of qs) holds values 64c + 4j .. + 3 in
its low nibbles (sub-block 2c) and 64c + 32 + 4j .. + 3 in its high ones (sub-block 2c + 1);
x's int8 words 16c + j and 16c + 8 + j. With x = d_x q_x and W = d sc q - dmin mn per
sub-block of 32 (one x group each):

    sum W x = d sc d_x (dp4a of nibbles and q_x) - dmin mn s_x      (s_x: the group's sum)

Q6_K (210-byte blocks, rows only 2-byte aligned: words are two 16-bit loads): ql word
``64n + 4t`` (a), ``64n + 32 + 4t`` (b) and qh word ``32n + 4t`` (h) of half n give quarters
k = 0..3 of l = 4t .. 4t + 3 (a's low nibbles, b's low, a's high, b's high; qh bits 2k), as
the signed bytes q - 32 into a signed ``dp4a``; scale ``sc[8n + 2k + t // 4]``, x group
``8b + 4n + k``. A lane takes t = 4s .. 4s + 3 (16 values of l, one scale per quarter).

MXFP4 (17-byte blocks of 32 values: one x group each): a thread per block, which loads the 5
aligned words that hold it and cuts its scale byte and 4 qs words out of them with funnel
shifts (byte loads, 5 a word, were the alternative); qs word t's low nibbles are values
4t..4t+3 (x's word 8b + t), its high ones 16 + 4t.. (word 8b + 4 + t); the nibbles become the
signed bytes of the doubled e2m1 values by byte permutes, and the block's E8M0 scale
2^(e - 128) undoes the doubling.

IQ4_NL (18-byte blocks of 32: f16 d, 16 bytes of qs, as Q4_0 but each nibble an index into
the format's 16 signed values): a thread per block as Q5_0's, the nibbles turned into those
values by the same byte permutes as MXFP4's, from the table's 4 words (``lut_words``, read
from the gguf package: kernel constants, not memory).
"""

from __future__ import annotations

import functools

import triton
import triton.language as tl

from carve_kernels.gemv_dot import _k4_scale, q80_rows_dot
from carve_kernels.gemv_t_dot import _dp4a, _funnel, _q6_s8
from carve_kernels.quant_blocks import _e8m0_half


@triton.jit
def _f16(v):
    # the low 16 bits of int32 v as an f16, to float32
    return (v & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _q4k_block(wi_ptr, bw, xw, xl, xh, il0, ASM: tl.constexpr):
    # one Q4_K block per (row, block) of bw ([R, B] word offsets of the blocks): the integer dots
    # of its 4 chunks' two sub-blocks with x's int8 words xl / xh ([R, B, 4, 8]), and the header
    qw = tl.load(wi_ptr + bw[:, :, None, None] + 4 + xw)  # qs: words 4..35 of the block
    il = tl.sum(_dp4a(qw & 0x0F0F0F0F, xl, il0, ASM), axis=3)
    ih = tl.sum(_dp4a((qw >> 4) & 0x0F0F0F0F, xh, il0, ASM), axis=3)
    dd = tl.load(wi_ptr + bw)  # d and dmin, two f16 in one word
    w0 = tl.load(wi_ptr + bw + 1)
    w1 = tl.load(wi_ptr + bw + 2)
    w2 = tl.load(wi_ptr + bw + 3)
    return il, ih, dd, w0, w1, w2


@triton.jit
def _q4k_mix(il, ih, dd, w0, w1, w2, c, dl, dh, sl, sh):
    # [R, B, 4] float32 sums of a block's chunks from the integer dots, the block's scales and
    # x's scales (dl, dh) and sums (sl, sh) of the chunks' low and high sub-blocks
    scl, mnl = _k4_scale(w0, w1, w2, 2 * c)
    sch, mnh = _k4_scale(w0, w1, w2, 2 * c + 1)
    d = _f16(dd)[:, :, None]
    dmin = _f16(dd >> 16)[:, :, None]
    return d * (scl * dl * il.to(tl.float32) + sch * dh * ih.to(tl.float32)) \
        - dmin * (mnl * sl + mnh * sh)


@triton.jit
def q4k_q8_rows_dot(wi_ptr, ui_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, nblk, row_bytes,
                    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, PAIR: tl.constexpr,
                    ASM: tl.constexpr):
    """([BLOCK_R], [BLOCK_R]) float32 dot products of Q4_K rows ``rows_c`` (clamped in range)
    of the weight at ``wi_ptr`` (and, PAIR, of a second one of the same shape at ``ui_ptr``;
    else the second is zeros) with x's int8 copy: ``xq_ptr`` its int8 values (4-byte aligned),
    ``xd_ptr`` / ``xs_ptr`` its scales and sums per 32 values. Both weights' rows are 4-byte
    aligned words (int32 pointers)."""
    tb = tl.arange(0, BLOCK_B)
    c = tl.arange(0, 4)
    j = tl.arange(0, 8)
    xw = ((c * 8)[:, None] + j[None, :])[None, None, :, :]  # qs word of chunk c, lane j
    xo = ((c * 16)[:, None] + j[None, :])[None, None, :, :]  # x's int8 word (low sub-block)
    xq = xq_ptr.to(tl.pointer_type(tl.int32))
    row_w = rows_c.to(tl.int64) * (row_bytes // 4)
    acc = tl.zeros([BLOCK_R, BLOCK_B, 4], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_B, 4], dtype=tl.float32)
    z = tl.zeros([BLOCK_R, BLOCK_B, 4, 8], dtype=tl.int32)
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bm = blk < nblk
        bw = row_w[:, None] + (tl.minimum(blk, nblk - 1) * 36)[None, :]  # [R, B]
        # x as full tiles in the weights' layout; blocks past the row end read x as 0
        xm = tl.broadcast_to(bm[None, :, None, None], (BLOCK_R, BLOCK_B, 4, 8))
        xp = tl.broadcast_to(xq + (blk * 64)[None, :, None, None] + xo, (BLOCK_R, BLOCK_B, 4, 8))
        xl = tl.load(xp, mask=xm, other=0)
        xh = tl.load(xp + 8, mask=xm, other=0)
        gm = tl.broadcast_to(bm[None, :, None], (BLOCK_R, BLOCK_B, 4))
        g = tl.broadcast_to((blk * 8)[None, :, None] + 2 * c[None, None, :], (BLOCK_R, BLOCK_B, 4))
        dl = tl.load(xd_ptr + g, mask=gm, other=0.0)
        dh = tl.load(xd_ptr + g + 1, mask=gm, other=0.0)
        sl = tl.load(xs_ptr + g, mask=gm, other=0.0)
        sh = tl.load(xs_ptr + g + 1, mask=gm, other=0.0)
        il, ih, dd, w0, w1, w2 = _q4k_block(wi_ptr, bw, xw, xl, xh, z, ASM)
        acc += _q4k_mix(il, ih, dd, w0, w1, w2, c, dl, dh, sl, sh)
        if PAIR:
            il, ih, dd, w0, w1, w2 = _q4k_block(ui_ptr, bw, xw, xl, xh, z, ASM)
            acc2 += _q4k_mix(il, ih, dd, w0, w1, w2, c, dl, dh, sl, sh)
    return tl.sum(tl.sum(acc, axis=2), axis=1), tl.sum(tl.sum(acc2, axis=2), axis=1)


@triton.jit
def _w16(wh_ptr, off):
    # the 32-bit word at 16-bit offset ``off`` (2-byte aligned) as two 16-bit loads
    lo = tl.load(wh_ptr + off).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = tl.load(wh_ptr + off + 1).to(tl.int16, bitcast=True).to(tl.int32)
    return lo | (hi << 16)


@triton.jit
def _quarter_step(row_h, b0, nblk, xq_ptr, xd_ptr, HALFWORDS: tl.constexpr,
                  BLOCK_B: tl.constexpr, shape: tl.constexpr):
    # a step of BLOCK_B blocks of HALFWORDS 16-bit words for the lanes (row, block, half n,
    # s: 16 values of each quarter) of the 256-value types on 2-byte aligned rows (Q6_K,
    # Q3_K): the blocks' mask, their 16-bit offsets, the lanes' x int8 word (4s of half n)
    # and x scale pointers of quarter 0, and int32 zeros of the lanes' shape
    n = tl.arange(0, 2)[:, None]
    s = tl.arange(0, 2)[None, :]
    blk = b0 + tl.arange(0, BLOCK_B)
    bm = tl.broadcast_to((blk < nblk)[None, :, None, None], shape)
    bh = (row_h[:, None] + (tl.minimum(blk, nblk - 1) * HALFWORDS)[None, :])[:, :, None, None]
    xo = (32 * n + 4 * s)[None, None]
    xg = (4 * n + 0 * s)[None, None]
    xp = tl.broadcast_to(xq_ptr.to(tl.pointer_type(tl.int32)) + (blk * 64)[None, :, None, None]
                         + xo, shape)
    gp = tl.broadcast_to(xd_ptr + (blk * 8)[None, :, None, None] + xg, shape)
    return bm, bh, xp, gp, tl.zeros(shape, dtype=tl.int32)


@triton.jit
def _quarters(s0, s1, s2, s3, gp, bm, i0, i1, i2, i3):
    # the 4 quarters' integer dots times their weight scales and x's scales per 32
    v = s0 * tl.load(gp, mask=bm, other=0.0) * i0.to(tl.float32)
    v += s1 * tl.load(gp + 1, mask=bm, other=0.0) * i1.to(tl.float32)
    v += s2 * tl.load(gp + 2, mask=bm, other=0.0) * i2.to(tl.float32)
    v += s3 * tl.load(gp + 3, mask=bm, other=0.0) * i3.to(tl.float32)
    return v


@triton.jit
def _q3_s8(q, nh, J: tl.constexpr):
    # quarter J's 4 three-bit values of qs word q (2 bits at 2J of each byte) and the inverted
    # hmask word nh (bit 4n + J of each byte, pre-shifted by 4n), as signed bytes: a clear
    # hmask bit is the sign bit of a 3-bit two's complement (q - 4), spread over bits 3-7
    v = ((q >> (2 * J)) & 0x03030303) | (((nh >> J) & 0x01010101) << 2)
    return v | ((v & 0x04040404) * 0x3E)


@triton.jit
def _q3_scale(sb, n, s, J: tl.constexpr):
    # the signed 6-bit scale of sub-block 8n + 2J + s (sb: the bytes at scales[0] of the rows'
    # blocks): low 4 bits from scales[(2J + s) % 8] (its high nibble for n = 1), high 2 bits
    # from scales[8 + (2J + s) % 4] at bit 2 (2n + J // 2)
    lo = (tl.load(sb + 2 * J + s).to(tl.int32) >> (4 * n)) & 0x0F
    hi = (tl.load(sb + 8 + (2 * J + s) % 4).to(tl.int32) >> (2 * (2 * n + J // 2))) & 0x03
    return ((lo | (hi << 4)) - 32).to(tl.float32)


@triton.jit
def quarter_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes,
                        TYPE: tl.constexpr, HALFWORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of Q6_K (``TYPE`` 14, 210-byte blocks) or Q3_K (11,
    110-byte blocks) rows ``rows_c`` (clamped in range) with x's int8 copy (``xq_ptr`` int8
    values, 4-byte aligned; ``xd_ptr`` scales per 32). ``w_ptr``: the weight as bytes,
    ``wh_ptr`` as 16-bit words (``HALFWORDS`` a block; rows 2-byte aligned; the block's f16 d
    its last). Both types keep a block as 2 halves n of 4 quarters J, word t (4 values l) of
    a half's runs feeding all 4 quarters; a lane takes half n and words 4s .. 4s + 3 (16
    values of each quarter: one scale a quarter), 4 words of each run in registers of their
    own, so that a lane's x scales and weight scales serve 4 words (lanes of one word each
    ran Q6_K's down at 15.6 against 14.2 us on an H200, 30B-A3B's 8 routed experts):

        sum W x = d sum_J scale_J d_x(4n + J) (dp4a of the quarter's signed values and q_x)

    Q6_K: ql word 64n + 4t (a) and 64n + 32 + 4t (b) and qh word 32n + 4t (h) give quarters
    0..3 (a's low nibbles, b's low, a's high, b's high; qh bits 2J), as the signed bytes
    q - 32; its scales int8 sc[8n + 2J + s]. Q3_K: hmask (words 0-7), qs (8-23: 8 words a
    half), 12 bytes of scales; qs word t of half n holds its 4 quarters (2 bits at 2J),
    hmask word t their third bits (bit 4n + J), a value the 3-bit two's complement whose
    sign is the clear hmask bit (q - 4); its scales 6-bit, 32 off (``_q3_scale``)."""
    n = tl.arange(0, 2)[:, None]  # the block's half
    s = tl.arange(0, 2)[None, :]  # the lane's 16 values of each quarter (l // 16)
    if TYPE == 14:
        qa = (32 * n + 8 * s)[None, None]  # 16-bit offset of the lane's first a word
        qh = (64 + 16 * n + 8 * s)[None, None]
        sc = (192 + 8 * n + s)[None, None]  # byte of sc[8n + s] (quarter J 2J further)
    else:
        qa = (16 + 16 * n + 8 * s)[None, None]  # 16-bit offset of the lane's first qs word
        qh = (0 * n + 8 * s)[None, None]  # and of its first hmask word
        sc = 96 + (0 * n + 0 * s)[None, None]  # the scales' first byte
    nn = (n + 0 * s)[None, None]
    ss = (0 * n + s)[None, None]
    row_h = rows_c.to(tl.int64) * (row_bytes // 2)
    shape: tl.constexpr = (BLOCK_R, BLOCK_B, 2, 2)
    acc = tl.zeros(shape, dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        bm, bh, xp, gp, i0 = _quarter_step(row_h, b0, nblk, xq_ptr, xd_ptr, HALFWORDS, BLOCK_B,
                                           shape)
        i1, i2, i3 = i0, i0, i0
        for t in tl.static_range(4):
            x0 = tl.load(xp + t, mask=bm, other=0)
            x1 = tl.load(xp + 8 + t, mask=bm, other=0)
            x2 = tl.load(xp + 16 + t, mask=bm, other=0)
            x3 = tl.load(xp + 24 + t, mask=bm, other=0)
            if TYPE == 14:
                a = _w16(wh_ptr, bh + qa + 2 * t)
                b = _w16(wh_ptr, bh + qa + 16 + 2 * t)
                h = _w16(wh_ptr, bh + qh + 2 * t)
                i0 = _dp4a(_q6_s8(a, h << 4), x0, i0, ASM, True)
                i1 = _dp4a(_q6_s8(b, h << 2), x1, i1, ASM, True)
                i2 = _dp4a(_q6_s8(a >> 4, h), x2, i2, ASM, True)
                i3 = _dp4a(_q6_s8(b >> 4, h >> 2), x3, i3, ASM, True)
            else:
                q = _w16(wh_ptr, bh + qa + 2 * t)
                nh = ~_w16(wh_ptr, bh + qh + 2 * t) >> (4 * nn)
                i0 = _dp4a(_q3_s8(q, nh, 0), x0, i0, ASM, True)
                i1 = _dp4a(_q3_s8(q, nh, 1), x1, i1, ASM, True)
                i2 = _dp4a(_q3_s8(q, nh, 2), x2, i2, ASM, True)
                i3 = _dp4a(_q3_s8(q, nh, 3), x3, i3, ASM, True)
        d = tl.load(wh_ptr + bh + (HALFWORDS - 1)).to(tl.float32)
        sb = w_ptr + (bh * 2 + sc)
        if TYPE == 14:
            s0 = tl.load(sb).to(tl.int8, bitcast=True).to(tl.float32)
            s1 = tl.load(sb + 2).to(tl.int8, bitcast=True).to(tl.float32)
            s2 = tl.load(sb + 4).to(tl.int8, bitcast=True).to(tl.float32)
            s3 = tl.load(sb + 6).to(tl.int8, bitcast=True).to(tl.float32)
        else:
            s0 = _q3_scale(sb, nn, ss, 0)
            s1 = _q3_scale(sb, nn, ss, 1)
            s2 = _q3_scale(sb, nn, ss, 2)
            s3 = _q3_scale(sb, nn, ss, 3)
        acc += d * _quarters(s0, s1, s2, s3, gp, bm, i0, i1, i2, i3)
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def _block_step(row_b, b0, nblk, BYTES: tl.constexpr, BLOCK_B: tl.constexpr):
    # a step of BLOCK_B blocks of BYTES bytes, a thread each (MXFP4, Q5_0): their ids, mask
    # and [R, B] byte offsets
    blk = b0 + tl.arange(0, BLOCK_B)
    return blk, blk < nblk, row_b[:, None] + (tl.minimum(blk, nblk - 1) * BYTES)[None, :]


@triton.jit
def _d_then_words(wh_ptr, wi, base):
    # a block of an f16 d and then its words (Q5_0, IQ4_NL) at even byte offsets ``base``: d,
    # the aligned int32 word its words start in, and their bit offset in it (0 or 16)
    d = tl.load(wh_ptr + (base >> 1)).to(tl.float32)
    return d, wi + ((base + 2) >> 2), (((base + 2) & 3) * 8).to(tl.int32)


@triton.jit
def _d_then_qs(wh_ptr, wi, base, QH: tl.constexpr, ASM: tl.constexpr):
    # a block of an f16 d, (QH: Q5_0's 4 bytes of qh,) then 16 bytes of qs (Q4_0, IQ4_NL: 18
    # bytes; Q5_0: 22) at even byte offsets ``base``: d, qh (0 without) and the 4 qs words, cut
    # out of the aligned words around them (aligned when the block is 2 past a word; the last,
    # read only when it starts on a word, reaches 2 bytes past the block, never past a 4-byte
    # boundary)
    d, wp, sh = _d_then_words(wh_ptr, wi, base)
    qh = 0
    if QH:
        w = tl.load(wp)
        wp = wp + 1
        w0 = tl.load(wp)
        qh = _funnel(w, w0, sh, ASM)
    else:
        w0 = tl.load(wp)
    w1 = tl.load(wp + 1)
    w2 = tl.load(wp + 2)
    w3 = tl.load(wp + 3)
    w4 = tl.load(wp + 4, mask=sh != 0, other=0)
    return (d, qh, _funnel(w0, w1, sh, ASM), _funnel(w1, w2, sh, ASM), _funnel(w2, w3, sh, ASM),
            _funnel(w3, w4, sh, ASM))


@triton.jit
def q50_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes,
                    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of Q5_0 rows ``rows_c`` (clamped in range) with x's int8
    copy (``xq_ptr`` int8 values, 4-byte aligned; ``xd_ptr`` scales per 32). A block (22
    bytes: f16 d, qh, 16 bytes of qs) is one x group and one thread's, as MXFP4's: its d a
    16-bit load (``wh_ptr``: the weight as 16-bit words), its qh and qs (4-byte aligned when
    the block is 2 past a word) cut out of the aligned int32 words around them by funnel
    shifts (``w_ptr`` 4-byte aligned; the sixth word, read only when the block starts on a
    word, reaches at most 2 bytes past the block, never past a 4-byte boundary):

        sum W x = d d_x (dp4a of the signed values q - 16 and q_x)"""
    return _signed_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, True,
                            BLOCK_R, BLOCK_B, ASM)


@triton.jit
def _signed_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, FIVE: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    # Q5_0 (FIVE: 22-byte blocks, qh before qs, values q - 16) or Q4_0 (18 bytes, q - 8)
    wi = w_ptr.to(tl.pointer_type(tl.int32))
    xq = xq_ptr.to(tl.pointer_type(tl.int32))
    row_b = rows_c.to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk, bm, base = _block_step(row_b, b0, nblk, 22 if FIVE else 18, BLOCK_B)
        d, qh, q0, q1, q2, q3 = _d_then_qs(wh_ptr, wi, base, FIVE, ASM)
        i, _ = _nibble_block(q0, q1, q2, q3, qh, xq, blk, bm, FIVE, 16 if FIVE else 8, ASM)
        dx = tl.load(xd_ptr + blk, mask=bm, other=0.0)
        acc += d * dx[None, :] * i.to(tl.float32)
    return tl.sum(acc, axis=1)


# MXFP4's doubled e2m1 values 0 1 2 3 4 6 8 12 and their negatives (bit 3 the sign) as the 4
# signed words of a 16-entry table (``_lut16_s8``)
MXFP4_LUT0 = tl.constexpr(0x03020100)
MXFP4_LUT1 = tl.constexpr(0x0C080604)
MXFP4_LUT2 = tl.constexpr(-0x02010100)  # 0xFDFEFF00
MXFP4_LUT3 = tl.constexpr(-0x0B070504)  # 0xF4F8FAFC


@triton.jit
def _nibbles(q, qh, T: tl.constexpr, HIGH: tl.constexpr):
    # values 4T .. 4T + 3 of a 32-value block of 4-bit quants as unsigned bytes: the low
    # nibbles of qs word T for T < 4, else the high nibbles of word T - 4; HIGH: with their
    # fifth bits (qh bits 4T .. 4T + 3, spread one to a byte by a multiply: 4 copies at 7-bit
    # steps, no carries)
    nib = (q >> (4 * (T // 4))) & 0x0F0F0F0F
    if HIGH:
        nib = nib | (((((qh >> (4 * T)) & 0xF) * 0x00204081) & 0x01010101) << 4)
    return nib


@triton.jit
def _nibble_block(q0, q1, q2, q3, qh, xq, blk, bm, HIGH: tl.constexpr, CENTRE: tl.constexpr,
                  ASM: tl.constexpr):
    # one block's dp4a sums against x's int8 words: (sum q q_x, sum q_x); CENTRE 8 or 16: the
    # signed values q - CENTRE of Q4_0 and Q5_0 (the top bit flipped is the 4- or 5-bit two's
    # complement, its sign spread over the byte's upper bits by a multiply), else (0) the
    # unsigned values and x's sum for the min term
    i = tl.zeros(q0.shape, dtype=tl.int32)
    sx = tl.zeros(q0.shape, dtype=tl.int32)
    for T in tl.static_range(8):
        if T % 4 == 0:
            q = q0
        elif T % 4 == 1:
            q = q1
        elif T % 4 == 2:
            q = q2
        else:
            q = q3
        v = _nibbles(q, qh, T, HIGH)
        xw = tl.broadcast_to(tl.load(xq + blk * 8 + T, mask=bm, other=0)[None, :], q.shape)
        if CENTRE > 0:
            v = v ^ (CENTRE * 0x01010101)
            i = _dp4a(v | ((v & (CENTRE * 0x01010101)) * (256 // CENTRE - 2)), xw, i, ASM, True)
        else:
            i = _dp4a(v, xw, i, ASM)
            sx = _dp4a(tl.full(q.shape, 0x01010101, tl.int32), xw, sx, ASM)
    return i, sx


@triton.jit
def q40_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes,
                    BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of Q4_0 rows ``rows_c`` with x's int8 copy, a thread per
    18-byte block as IQ4_NL's (f16 d, 16 bytes of qs: ``_d_then_qs``):

        sum W x = d d_x (dp4a of the signed values q - 8 and q_x)"""
    return _signed_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, False,
                            BLOCK_R, BLOCK_B, ASM)


@triton.jit
def q41_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes,
                    TYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                    ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of Q4_1 (TYPE 3: 20-byte blocks of f16 d, f16 m and 16
    bytes of qs) or Q5_1 (TYPE 7: 24 bytes, qh's 4 bytes before qs) rows ``rows_c`` with x's
    int8 copy; a thread per block, whose words are aligned (blocks of a multiple of 4 bytes,
    the weight 4-byte aligned). With W = d q + m:

        sum W x = d_x (d dp4a(q, q_x) + m dp4a(1, q_x))"""
    HIGH: tl.constexpr = TYPE == 7
    TS: tl.constexpr = 24 if HIGH else 20
    wi = w_ptr.to(tl.pointer_type(tl.int32))
    xq = xq_ptr.to(tl.pointer_type(tl.int32))
    row_b = rows_c.to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk, bm, base = _block_step(row_b, b0, nblk, TS, BLOCK_B)
        d = tl.load(wh_ptr + (base >> 1)).to(tl.float32)
        m = tl.load(wh_ptr + (base >> 1) + 1).to(tl.float32)
        wp = wi + (base >> 2) + 1
        qh = 0
        if HIGH:
            qh = tl.load(wp)
            wp = wp + 1
        i, sx = _nibble_block(tl.load(wp), tl.load(wp + 1), tl.load(wp + 2), tl.load(wp + 3),
                              qh, xq, blk, bm, HIGH, 0, ASM)
        dx = tl.load(xd_ptr + blk, mask=bm, other=0.0)
        acc += dx[None, :] * (d * i.to(tl.float32) + m * sx.to(tl.float32))
    return tl.sum(acc, axis=1)


@triton.jit
def _lut16_s8(q, L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr, L3: tl.constexpr,
              ASM: tl.constexpr):
    # the 8 nibbles of q (bytes j..j+3 of a block's qs: values j..j+3 low, j+16..j+19 high) as
    # two words of 4 signed bytes, entry n of the 16-byte table in words L0..L3 (little
    # endian) for nibble n: (values j..j+3, values j+16..j+19). ASM: byte permutes (per half
    # of q: entries 0-7 and 8-15 by each nibble's low 3 bits, then one or the other by its
    # bit 3; then the low and the high nibbles' bytes gathered)
    if ASM:
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 s, g, p, n, r0, r1;
            and.b32 s, $2, 0x7777;
            and.b32 g, $2, 0x8888;
            shr.b32 g, g, 1;
            or.b32 g, g, 0x3210;
            prmt.b32 p, $3, $4, s;
            prmt.b32 n, $5, $6, s;
            prmt.b32 r0, p, n, g;
            shr.b32 s, $2, 16;
            and.b32 g, s, 0x8888;
            and.b32 s, s, 0x7777;
            shr.b32 g, g, 1;
            or.b32 g, g, 0x3210;
            prmt.b32 p, $3, $4, s;
            prmt.b32 n, $5, $6, s;
            prmt.b32 r1, p, n, g;
            prmt.b32 $0, r0, r1, 0x6420;
            prmt.b32 $1, r0, r1, 0x7531;
            }""",
            "=r,=r,r,r,r,r,r",
            [q, tl.full(q.shape, L0, tl.int32), tl.full(q.shape, L1, tl.int32),
             tl.full(q.shape, L2, tl.int32), tl.full(q.shape, L3, tl.int32)],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    else:
        lo = q * 0
        hi = q * 0
        for k in tl.static_range(8):
            n = (q >> (4 * k)) & 15
            w = tl.where(n < 4, L0, tl.where(n < 8, L1, tl.where(n < 12, L2, L3)))
            v = (w >> (8 * (n & 3))) & 0xFF
            if k % 2 == 0:
                lo |= v << (8 * (k // 2))
            else:
                hi |= v << (8 * (k // 2))
        return lo, hi


@functools.cache
def lut_words(ggml_type: int) -> tuple[int, int, int, int]:
    """The 4 signed int32 words (little endian) of a type's 16-entry value table, as
    ``_lut16_s8`` takes them: IQ4_NL's from the gguf package; zeros for the other types."""
    if ggml_type != 20:
        return (0, 0, 0, 0)
    import numpy as np
    from gguf.quants import IQ4_NL  # numpy-heavy: imported only for the type that needs it

    words = np.asarray(IQ4_NL.kvalues, dtype=np.int8).view("<i4")
    return tuple(int(w) for w in words)


@triton.jit
def iq4nl_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes,
                      L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr, L3: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of IQ4_NL rows ``rows_c`` (clamped in range) with x's
    int8 copy (``xq_ptr`` int8 values, 4-byte aligned; ``xd_ptr`` scales per 32). A block (18
    bytes: f16 d, 16 bytes of qs) is one x group and one thread's, as Q5_0's: its d a 16-bit
    load (``wh_ptr``), its qs cut out of the aligned int32 words around them by funnel shifts
    (aligned when the block is 2 past a word; the fifth word, read only when it starts on a
    word, reaches 2 bytes past the block, never past a 4-byte boundary); the nibbles become
    the table's values (L0..L3, ``lut_words``) by byte permutes:

        sum W x = d d_x (dp4a of the values and q_x)"""
    wi = w_ptr.to(tl.pointer_type(tl.int32))
    xq = xq_ptr.to(tl.pointer_type(tl.int32))
    row_b = rows_c.to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk, bm, base = _block_step(row_b, b0, nblk, 18, BLOCK_B)
        d, _, q0, q1, q2, q3 = _d_then_qs(wh_ptr, wi, base, False, ASM)
        i = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.int32)
        i = _lut16_word(q0, xq, blk, bm, i, 0, L0, L1, L2, L3, ASM)
        i = _lut16_word(q1, xq, blk, bm, i, 1, L0, L1, L2, L3, ASM)
        i = _lut16_word(q2, xq, blk, bm, i, 2, L0, L1, L2, L3, ASM)
        i = _lut16_word(q3, xq, blk, bm, i, 3, L0, L1, L2, L3, ASM)
        dx = tl.load(xd_ptr + blk, mask=bm, other=0.0)
        acc += d * dx[None, :] * i.to(tl.float32)
    return tl.sum(acc, axis=1)


@triton.jit
def _lut16_word(q, xq, blk, bm, i, J: tl.constexpr, L0: tl.constexpr, L1: tl.constexpr,
                L2: tl.constexpr, L3: tl.constexpr, ASM: tl.constexpr):
    # qs word J of the blocks (values 4J..4J+3 low nibbles, 16+4J.. high) as the table's
    # values against x's words 8b + J and 8b + 4 + J (broadcast to the rows)
    lo, hi = _lut16_s8(q, L0, L1, L2, L3, ASM)
    xl = tl.load(xq + blk * 8 + J, mask=bm, other=0)[None, :]
    xh = tl.load(xq + blk * 8 + 4 + J, mask=bm, other=0)[None, :]
    i = _dp4a(lo, tl.broadcast_to(xl, lo.shape), i, ASM, True)
    return _dp4a(hi, tl.broadcast_to(xh, hi.shape), i, ASM, True)


@triton.jit
def mxfp4_q8_rows_dot(w_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, BLOCK_R: tl.constexpr,
                      BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of MXFP4 rows ``rows_c`` (clamped in range) with x's int8
    copy (``xq_ptr`` int8 values, 4-byte aligned; ``xd_ptr`` scales per 32). A block (17
    bytes: E8M0 e, then qs) is one x group and one thread's: the 5 aligned int32 words that
    hold its bytes (``w_ptr`` 4-byte aligned; the last word may reach 3 bytes past the
    tensor, never past a 4-byte boundary), its e and 4 qs words cut out of them by funnel
    shifts (the blocks leave rows and words 1-byte aligned):

        sum W x = 2^(e - 128) d_x (dp4a of the doubled values and q_x)"""
    wi = w_ptr.to(tl.pointer_type(tl.int32))
    xq = xq_ptr.to(tl.pointer_type(tl.int32))
    row_b = rows_c.to(tl.int64) * row_bytes
    acc = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk, bm, base = _block_step(row_b, b0, nblk, 17, BLOCK_B)
        wp = wi + (base >> 2)
        c = (base & 3).to(tl.int32)
        w0 = tl.load(wp)
        w1 = tl.load(wp + 1)
        w2 = tl.load(wp + 2)
        w3 = tl.load(wp + 3)
        w4 = tl.load(wp + 4)
        e = (w0 >> (8 * c)) & 0xFF
        s = 8 * c + 8  # qs word j: the bytes at bit s of words j, j + 1
        i = tl.zeros((BLOCK_R, BLOCK_B), dtype=tl.int32)
        i = _lut16_word(_funnel(w0, w1, s, ASM), xq, blk, bm, i, 0, MXFP4_LUT0, MXFP4_LUT1,
                        MXFP4_LUT2, MXFP4_LUT3, ASM)
        i = _lut16_word(_funnel(w1, w2, s, ASM), xq, blk, bm, i, 1, MXFP4_LUT0, MXFP4_LUT1,
                        MXFP4_LUT2, MXFP4_LUT3, ASM)
        i = _lut16_word(_funnel(w2, w3, s, ASM), xq, blk, bm, i, 2, MXFP4_LUT0, MXFP4_LUT1,
                        MXFP4_LUT2, MXFP4_LUT3, ASM)
        i = _lut16_word(_funnel(w3, w4, s, ASM), xq, blk, bm, i, 3, MXFP4_LUT0, MXFP4_LUT1,
                        MXFP4_LUT2, MXFP4_LUT3, ASM)
        dx = tl.load(xd_ptr + blk, mask=bm, other=0.0)
        acc += _e8m0_half(e) * dx[None, :] * i.to(tl.float32)
    return tl.sum(acc, axis=1)


# the types with a body here, and the values of a block each
Q8_TYPES = (12, 14, 39, 6, 11, 8)  # Q4_K, Q6_K, MXFP4, Q5_0, Q3_K, Q8_0
# bodies written and checked here, not yet measured in a decode step: decode's experts take
# them only on trial (CARVE_TRIAL names them: moe_decode.Q8_ON_TRIAL), by trial name
Q8_TRIAL_TYPES = {"iq4nl_experts": (20,), "legacy_experts": (2, 3, 7)}
Q8_BLOCK = {12: 256, 14: 256, 39: 32, 11: 256, 6: 32, 20: 32, 8: 32, 2: 32, 3: 32, 7: 32}


@triton.jit
def q8_rows_dot(w_ptr, wh_ptr, wi_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, nblk, row_bytes,
                TYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                ASM: tl.constexpr, L0: tl.constexpr = 0, L1: tl.constexpr = 0,
                L2: tl.constexpr = 0, L3: tl.constexpr = 0):
    """[BLOCK_R] float32 dot products of rows ``rows_c`` of a Q4_K, Q6_K, MXFP4, Q3_K, Q5_0,
    Q4_0, Q4_1, Q5_1, IQ4_NL or Q8_0 (carve_kernels/gemv_dot.py ``q80_rows_dot``) weight (its
    bytes, 16-bit words and int32 words; ``nblk`` blocks of ``Q8_BLOCK[TYPE]`` values a row) with x's int8
    copy (values, scales, sums); L0..L3: IQ4_NL's table (``lut_words``)."""
    if TYPE == 12:
        y, _ = q4k_q8_rows_dot(wi_ptr, wi_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, nblk, row_bytes,
                               BLOCK_R, BLOCK_B, False, ASM)
    elif TYPE == 11:
        y = quarter_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, 11, 55,
                                BLOCK_R, BLOCK_B, ASM)
    elif TYPE == 6:
        y = q50_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, BLOCK_R,
                            BLOCK_B, ASM)
    elif TYPE == 2:
        y = q40_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, BLOCK_R,
                            BLOCK_B, ASM)
    elif TYPE == 3 or TYPE == 7:
        y = q41_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, TYPE,
                            BLOCK_R, BLOCK_B, ASM)
    elif TYPE == 8:
        # x's int8 values as bytes (q80_rows_dot tells int8 x from float x by the pointer)
        y = q80_rows_dot(w_ptr, xq_ptr.to(tl.pointer_type(tl.int8)), xd_ptr, rows_c, nblk,
                         row_bytes, BLOCK_R, BLOCK_B, ASM)
    elif TYPE == 20:
        y = iq4nl_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, L0, L1,
                              L2, L3, BLOCK_R, BLOCK_B, ASM)
    elif TYPE == 39:
        y = mxfp4_q8_rows_dot(w_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, BLOCK_R, BLOCK_B,
                              ASM)
    else:
        y = quarter_q8_rows_dot(w_ptr, wh_ptr, xq_ptr, xd_ptr, rows_c, nblk, row_bytes, 14, 105,
                                BLOCK_R, BLOCK_B, ASM)
    return y

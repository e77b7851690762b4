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

"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_dot import _k4_scale, q80_rows_dot
from carve_kernels.gemv_q8_blocks import (
    iq4nl_q8_rows_dot,
    mxfp4_q8_rows_dot,
    q50_q8_rows_dot,
)
from carve_kernels.gemv_t_dot import _dp4a
from carve_kernels.gemv_t_q6k import _q6_s8


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


# the types with a body here, and the values of a block each
Q8_TYPES = (12, 14, 39, 6, 11, 8)  # Q4_K, Q6_K, MXFP4, Q5_0, Q3_K, Q8_0
# bodies written and checked here, not yet measured in a decode step: decode's experts take
# them only on trial (CARVE_TRIAL names them: moe_decode_q8.Q8_ON_TRIAL), by trial name
Q8_TRIAL_TYPES = {"iq4nl_experts": (20,)}
Q8_BLOCK = {12: 256, 14: 256, 39: 32, 11: 256, 6: 32, 20: 32, 8: 32}


@triton.jit
def q8_rows_dot(w_ptr, wh_ptr, wi_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, nblk, row_bytes,
                TYPE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                ASM: tl.constexpr, L0: tl.constexpr = 0, L1: tl.constexpr = 0,
                L2: tl.constexpr = 0, L3: tl.constexpr = 0):
    """[BLOCK_R] float32 dot products of rows ``rows_c`` of a Q4_K, Q6_K, MXFP4, Q3_K, Q5_0,
    IQ4_NL or Q8_0 (carve_kernels/gemv_dot.py ``q80_rows_dot``) weight (its
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

"""GGUF-order row dot products against x's int8 copy (carve_kernels/q8x.py) of the types whose
blocks hold 32 values (one x group each), a thread per block: Q5_0, Q4_0, Q4_1, Q5_1, MXFP4 and
IQ4_NL (Q8_0's is carve_kernels/gemv_dot.py ``q80_rows_dot``). carve_kernels/gemv_q8.py has the
256-value types and ``q8_rows_dot``, which picks a body by type.

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

from carve_kernels.gemv_t_dot import _dp4a, _funnel
from carve_kernels.quant_blocks import _e8m0_half


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

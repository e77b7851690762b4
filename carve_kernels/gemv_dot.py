"""Row dot products of the decode GEMV: ``y[r] = W[r, :] . x`` for a tile of rows, dequantizing
the GGUF blocks on the fly. One ``row_dot`` serves every kernel that multiplies a quantized
matrix by one activation row (plain GEMV, the fused gate/up + GLU, the fused q/k/v).

Q4_K (most of a Q4_K_M file's bytes) has a body of its own that walks a block in storage
order: each weight byte is loaded once, as part of a 16-byte load, and the per-sub-block scales
multiply a sum over the sub-block rather than every element:

    sum_e x_e (d sc_s q_e - dmin mn_s) = d sc_s sum_e x_e q_e - dmin mn_s sum_e x_e

Q8_0 (``q80_rows_dot``) has a row body too, on the MXFP4 expert body's pattern
(carve_kernels/gemv_q8.py): a thread per 34-byte block, which loads the 9 aligned int32 words that
hold it (rows of 34-byte blocks are only 2-byte aligned, so the generic walk loads bytes) and
cuts its f16 scale and 8 qs words out of them with funnel shifts; on decode's int8 copy of x
by ``dp4a``, one x group a block:

    sum W x = d d_x (dp4a of qs and q_x)

or on float32 / 16-bit x in 64-bit words. It needs the weight's start 4-byte aligned
(``quant_matmul.ROW_BODY_ALIGN``); an unaligned Q8_0 weight takes the generic walk.

The grid IQ types and IQ4_XS have row bodies of their own (carve_kernels/gemv_iq.py,
carve_kernels/gemv_lowbit.py; ``quant_matmul.ROW_BODY_TYPES``). The other types go through the
generic per-part walk of ``carve_kernels.quant_blocks.dequant_part``. (A Q6_K body of the same kind
as Q4_K's is slower on the H200: its 210-byte blocks allow only 2-byte loads. So are Q4_K
bodies that load int32 words or prefetch the next step.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_iq import _word_dot, _x_words, iq_rows_dot
from carve_kernels.gemv_lowbit import iq4xs_rows_dot, q2k_rows_dot
from carve_kernels.gemv_t_dot import _dp4a, _funnel
from carve_kernels.quant_blocks import dequant_part


@triton.jit
def _k4_scale(w0, w1, w2, j):
    """get_scale_min_k4 of ggml-quants.c for sub-blocks ``j`` ([J] int32, 0..7) of blocks whose
    12 scale bytes are the int32 words w0, w1, w2 ([R, B]): (scale, min) as [R, B, J] float32."""
    sh = ((j % 4) * 8)[None, None, :]
    b0 = (w0[:, :, None] >> sh) & 255  # s[j % 4]
    b1 = (w1[:, :, None] >> sh) & 255  # s[j % 4 + 4]
    b2 = (w2[:, :, None] >> sh) & 255  # s[j % 4 + 8]
    low = (j < 4)[None, None, :]
    sc = tl.where(low, b0 & 63, (b2 & 15) | ((b0 >> 6) << 4))
    mn = tl.where(low, b1 & 63, (b2 >> 4) | ((b1 >> 6) << 4))
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _q4k_dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, nblk, row_bytes,
             BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr):
    # block: d, dmin (f16), scales[12], qs[128]; qs[32c + l] holds element 64c + l in its low
    # nibble (sub-block 2c) and element 64c + 32 + l in its high nibble (sub-block 2c + 1)
    tb = tl.arange(0, BLOCK_B)
    c = tl.arange(0, 4)
    lane = tl.arange(0, 32)
    row_base = rows_c.to(tl.int64) * row_bytes
    acc = tl.zeros([BLOCK_R, BLOCK_B, 4], dtype=tl.float32)
    q_off = (16 + c * 32)[:, None] + lane[None, :]  # [4, 32], 128 contiguous bytes
    x_off = (c * 64)[:, None] + lane[None, :]
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bmask = blk < nblk
        base = row_base[:, None] + tl.minimum(blk, nblk - 1)[None, :] * 144  # [R, B]
        base = tl.multiple_of(base, [16, 16])
        qs = tl.load(w_ptr + base[:, :, None, None] + q_off[None, None, :, :]).to(tl.int32)
        # nibbles into the mantissa of 2^23 (the high one in place, as 16q): integer ops and
        # an add at full rate instead of the low-rate I2F convert
        ql = ((qs & 15) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        qh = ((qs & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        xp = xrow + (blk * 256)[:, None, None] + x_off[None, :, :]
        xl = tl.load(xp, mask=bmask[:, None, None], other=0.0).to(tl.float32)
        xh = tl.load(xp + 32, mask=bmask[:, None, None], other=0.0).to(tl.float32)
        sl = tl.sum(ql * xl[None, :, :, :], axis=3)  # [R, B, 4]
        sh = tl.sum(qh * xh[None, :, :, :], axis=3) * 0.0625
        xsl = tl.sum(xl, axis=2)[None, :, :]  # [1, B, 4]
        xsh = tl.sum(xh, axis=2)[None, :, :]
        wq = base // 4
        dd = tl.load(wi_ptr + wq)  # d and dmin, two f16 in one word
        d = (dd & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)[:, :, None]
        dmin = ((dd >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True)
        dmin = dmin.to(tl.float32)[:, :, None]
        w0 = tl.load(wi_ptr + wq + 1)
        w1 = tl.load(wi_ptr + wq + 2)
        w2 = tl.load(wi_ptr + wq + 3)
        scl, mnl = _k4_scale(w0, w1, w2, 2 * c)
        sch, mnh = _k4_scale(w0, w1, w2, 2 * c + 1)
        acc += d * (scl * sl + sch * sh) - dmin * (mnl * xsl + mnh * xsh)
    return tl.sum(tl.sum(acc, axis=2), axis=1)


@triton.jit
def _generic_dot(w_ptr, wh_ptr, g_ptr, xrow, rows_c, nblk, row_bytes,
                 TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr,
                 L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                 LANE_SUM: tl.constexpr, MAGIC: tl.constexpr):
    tb = tl.arange(0, BLOCK_B)
    lane = tl.arange(0, L)
    row_base = rows_c.to(tl.int64)[:, None, None] * row_bytes
    acc = tl.zeros([BLOCK_R, BLOCK_B, L], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bmask = blk < nblk
        blk_c = tl.minimum(blk, nblk - 1)
        base = row_base + blk_c[None, :, None] * TS
        for p in tl.static_range(NPART):
            v, e = dequant_part(w_ptr, wh_ptr, base, lane, TYPE, p, MAGIC, g_ptr)
            # blocks past the row end read x as 0 (their weights are a clamped, finite copy).
            # x comes as a full [R, B, L] tile in the weight tile's register layout: no
            # shared-memory layout conversion per part. F16/BF16 weights are as wide as x,
            # so there one x load per row costs more.
            if TYPE == 1 or TYPE == 30:
                xv = tl.load(xrow + blk[:, None] * BS + e[None, :], mask=bmask[:, None],
                             other=0.0)
                acc += v * xv.to(tl.float32)[None, :, :]
            else:
                xp = tl.broadcast_to((xrow + blk[:, None] * BS + e[None, :])[None, :, :],
                                     (BLOCK_R, BLOCK_B, L))
                xm = tl.broadcast_to(bmask[None, :, None], (BLOCK_R, BLOCK_B, L))
                xv = tl.load(xp, mask=xm, other=0.0)
                if LANE_SUM:  # reduce each part over its lanes at once
                    acc2 += tl.sum(v * xv.to(tl.float32), axis=2)
                else:
                    acc += v * xv.to(tl.float32)
    return tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc2, axis=1)


@triton.jit
def q80_rows_dot(w_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, BLOCK_R: tl.constexpr,
                 BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of Q8_0 rows ``rows_c`` (clamped in range) with the
    activation row at ``xrow``: float32, bf16 or f16 (its start 8-byte aligned, read in 64-bit
    words as ``iq4xs_rows_dot`` does), or int8, decode's int8 copy of x (its scales per 32
    values at ``xd_ptr``). A block (34 bytes: f16 d, then 32 int8 qs) is one thread's and one
    group of x: ``w_ptr``'s start must be 4-byte aligned, and a block at the (even) byte
    ``base`` lies in the 9 aligned int32 words from word ``base >> 2`` (the last may reach 2
    bytes past the block, never past a 4-byte boundary); with c = base & 3 (0 or 2), d is the
    16 bits at bit 8c of word 0 and qs word j the 32 bits at bit 8c + 16 of words j, j + 1 (a
    funnel shift; at c = 2 simply word j + 1). int8 x:

        sum W x = d d_x (dp4a of qs and q_x)"""
    XQ: tl.constexpr = xrow.dtype.element_ty == tl.int8
    X16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16 or (
        xrow.dtype.element_ty == tl.float16)
    BF16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16
    wi = w_ptr.to(tl.pointer_type(tl.int32))
    xw = _x_words(xrow)
    row_b = rows_c.to(tl.int64)[:, None] * row_bytes
    acc = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        base = row_b + (tl.minimum(blk, nblk - 1) * 34)[None, :]  # [R, B] bytes, even
        wp = wi + (base >> 2)
        c8 = 8 * (base & 3).to(tl.int32)  # 0 or 16
        s = c8 + 16
        # x's group as full tiles in the weights' register layout (no layout conversion);
        # blocks past the row end (a clamped copy of the last) read x as 0
        xb = tl.broadcast_to(blk[None, :], (BLOCK_R, BLOCK_B))
        xm = tl.broadcast_to((blk < nblk)[None, :], (BLOCK_R, BLOCK_B))
        lo = tl.load(wp)
        d = ((lo >> c8) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        isum = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.int32)
        fsum = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)
        for j in tl.static_range(8):
            hi = tl.load(wp + j + 1)
            q = _funnel(lo, hi, s, ASM)  # qs values 4j..4j+3
            if XQ:
                isum = _dp4a(q, tl.load(xw + xb * 8 + j, mask=xm, other=0), isum, ASM, True)
            elif X16:
                xa = tl.load(xw + xb * 8 + j, mask=xm, other=0)
                fsum += _word_dot(q, xa, xa, True, BF16)
            else:
                xa = tl.load(xw + xb * 16 + 2 * j, mask=xm, other=0)
                xc = tl.load(xw + xb * 16 + 2 * j + 1, mask=xm, other=0)
                fsum += _word_dot(q, xa, xc, False, BF16)
            lo = hi
        if XQ:
            acc += d * tl.load(xd_ptr + xb, mask=xm, other=0.0) * isum.to(tl.float32)
        else:
            acc += d * fsum
    return tl.sum(acc, axis=1)


@triton.jit
def row_dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, K, row_bytes,
            TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr,
            L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
            LANE_SUM: tl.constexpr, SPECIAL: tl.constexpr, MAGIC: tl.constexpr,
            xd_ptr=None, ASM: tl.constexpr = False):
    """[BLOCK_R] float32 dot products of weight rows ``rows_c`` (clamped in range) with the
    activation row at ``xrow``. ``w_ptr``/``wh_ptr``/``wi_ptr``: the weight's bytes as uint8,
    16-bit floats and int32 (for the types that read a value table, the IQ family, ``wi_ptr``
    is that table: carve_kernels.lowbit_blocks.lookup_table). SPECIAL picks the Q4_K storage-order
    body or the type's row body (``quant_matmul.ROW_BODY_TYPES``: the grid IQ types',
    carve_kernels/gemv_iq.py; IQ4_XS's and Q2_K's, carve_kernels/gemv_lowbit.py; Q8_0's here,
    which reads ``w_ptr`` as int32 words: its start 4-byte aligned), MAGIC the 2^23
    integer-to-float of the generic walk. An int8 ``xrow`` is decode's int8 copy of x, its scales
    at ``xd_ptr`` (the row bodies only); ASM: dp4a and funnel shifts as the GPU's
    instructions."""
    nblk = K // BS
    if SPECIAL and TYPE == 12:
        y = _q4k_dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, nblk, row_bytes, BLOCK_R, BLOCK_B)
    elif SPECIAL and (TYPE == 18 or TYPE == 21):  # IQ3_XXS / IQ3_S: 4-value grid rows
        y = iq_rows_dot(w_ptr, wh_ptr, wi_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, TYPE,
                        TS, 4, BLOCK_R, BLOCK_B, ASM)
    elif SPECIAL and TYPE == 10:  # Q2_K: a lane per 32 values, dp4a on int8 x
        y = q2k_rows_dot(w_ptr, wh_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, TS, BLOCK_R,
                         BLOCK_B, ASM)
    elif SPECIAL and TYPE == 8:  # Q8_0: a thread per block, its words cut by funnel shifts
        y = q80_rows_dot(w_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, BLOCK_R, BLOCK_B, ASM)
    elif SPECIAL and TYPE == 23:  # IQ4_XS: the 16-value table through byte permutes
        y = iq4xs_rows_dot(w_ptr, wh_ptr, wi_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, TS,
                           BLOCK_R, BLOCK_B, ASM)
    elif SPECIAL and (TYPE == 16 or TYPE == 17 or TYPE == 19 or TYPE == 22 or TYPE == 29):
        # IQ2_XXS, IQ2_XS, IQ1_S, IQ2_S, IQ1_M: 8-value grid rows
        y = iq_rows_dot(w_ptr, wh_ptr, wi_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes, TYPE,
                        TS, 8, BLOCK_R, BLOCK_B, ASM)
    else:
        y = _generic_dot(w_ptr, wh_ptr, wi_ptr, xrow, rows_c, nblk, row_bytes, TYPE, BS, TS,
                         NPART, L, BLOCK_R, BLOCK_B, LANE_SUM, MAGIC)
    return y

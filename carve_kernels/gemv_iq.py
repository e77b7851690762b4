"""A body of their own for the grid IQ types' decode GEMVs (``gemv_dot.row_dot`` with SPECIAL):
IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M (grid rows of 8 values) and IQ3_XXS, IQ3_S (rows of 4).

The generic walk (carve_kernels/lowbit_blocks.py) gives every lane one value: per value it loads a
grid index, gathers one grid byte and works out its sign. Here each lane holds a group of 32
values of a block (4 grid rows of 8, or 8 of 4): it reads the group's fields once, in 16-bit
loads (every grid type's block is a whole number of 16-bit words), then per grid row works out
the index, sign bits (the parity of a 7-bit sign index computed), scale and IQ1 delta, gathers
the row from the table as one 4- or 8-byte word, puts the signs into its bytes as integers (a
word of four at a time) and multiplies:

    sum_j x_j * db * v_j = db * sum_j x_j * v_j,   v_j = +-grid_j (IQ1: 8 grid_j +- 1)

x is read in 64-bit words (four 16-bit values, or two float32, a load). With ``xq`` (decode's
int8 copy of x, carve_kernels/q8x.py) the signed grid bytes multiply x's int8 values with ``dp4a``,
four a instruction, and each group's integer sum is scaled once by the group's x scale (x's
groups of 32 are the lane's group).

Block layouts as in carve_kernels/lowbit_blocks.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from carve_kernels.gemv_t_dot import _dp4a, _pick4


@triton.jit
def _ksigns(s, ASM: tl.constexpr):
    # ksigns_iq2xs[s] for a 7-bit s: s and its parity in bit 7 (ASM: the GPU's popc)
    if ASM:
        p = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [s], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:
        p = s ^ (s >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
    return s | ((p & 1) << 7)


@triton.jit
def _h(wh_ptr, hoff):
    # the u16 at 16-bit offset hoff (a field of a block; every grid type's block is whole
    # 16-bit words) as int32
    return tl.load(wh_ptr + hoff).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _group(wh_ptr, hb, g, TYPE: tl.constexpr):
    """The fields of group ``g`` (32 values) of the blocks at 16-bit offsets ``hb``: (i0, i1,
    i2, i3: 16-bit words of the group's grid indices or of its rows, a, b: type-specific words,
    d: the block's float scale)."""
    zero = tl.zeros_like(hb + g).to(tl.int32)
    i2 = zero
    i3 = zero
    b = zero
    if TYPE == 29:  # IQ1_M: qs[32], qh[16] (a nibble per row), scales 4 x u16 (d in their tops)
        i0 = _h(wh_ptr, hb + 2 * g)
        i1 = _h(wh_ptr, hb + 2 * g + 1)
        a = _h(wh_ptr, hb + 16 + g)
        b = _h(wh_ptr, hb + 24 + g // 2)
        d16 = ((_h(wh_ptr, hb + 24) >> 12) | ((_h(wh_ptr, hb + 25) >> 12) << 4)
               | ((_h(wh_ptr, hb + 26) >> 12) << 8) | ((_h(wh_ptr, hb + 27) >> 12) << 12))
        d = d16.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        d = tl.load(wh_ptr + hb).to(tl.float32)
        if TYPE == 16:  # IQ2_XXS: d, per group 4 index bytes + u32 (4 x 7 sign bits, scale)
            i0 = _h(wh_ptr, hb + 1 + 4 * g)
            i1 = _h(wh_ptr, hb + 2 + 4 * g)
            a = _h(wh_ptr, hb + 3 + 4 * g) | (_h(wh_ptr, hb + 4 + 4 * g) << 16)
        elif TYPE == 17:  # IQ2_XS: d, qs[32] u16 (9-bit index, 7 sign bits), scales[8]
            i0 = _h(wh_ptr, hb + 1 + 4 * g)
            i1 = _h(wh_ptr, hb + 2 + 4 * g)
            i2 = _h(wh_ptr, hb + 3 + 4 * g)
            i3 = _h(wh_ptr, hb + 4 + 4 * g)
            a = (_h(wh_ptr, hb + 33 + g // 2) >> (8 * (g % 2))) & 255
        elif TYPE == 22:  # IQ2_S: d, qs[32], signs[32], qh[8] (2 bits a row), scales[8]
            i0 = _h(wh_ptr, hb + 1 + 2 * g)
            i1 = _h(wh_ptr, hb + 2 + 2 * g)
            a = _h(wh_ptr, hb + 17 + 2 * g) | (_h(wh_ptr, hb + 18 + 2 * g) << 16)
            b = (((_h(wh_ptr, hb + 33 + g // 2) >> (8 * (g % 2))) & 255)
                 | (((_h(wh_ptr, hb + 37 + g // 2) >> (8 * (g % 2))) & 255) << 8))
        elif TYPE == 19:  # IQ1_S: d, qs[32], qh[8] u16 (3 bits a row, scale, delta sign)
            i0 = _h(wh_ptr, hb + 1 + 2 * g)
            i1 = _h(wh_ptr, hb + 2 + 2 * g)
            a = _h(wh_ptr, hb + 17 + g)
        elif TYPE == 18:  # IQ3_XXS: d, qs[64] (an index per 4 values), 8 u32 (signs, scale)
            i0 = _h(wh_ptr, hb + 1 + 4 * g)
            i1 = _h(wh_ptr, hb + 2 + 4 * g)
            i2 = _h(wh_ptr, hb + 3 + 4 * g)
            i3 = _h(wh_ptr, hb + 4 + 4 * g)
            a = _h(wh_ptr, hb + 33 + 2 * g) | (_h(wh_ptr, hb + 34 + 2 * g) << 16)
        else:  # IQ3_S: d, qs[64], qh[8] (top bit a row), signs[32], scales[4] nibbles
            i0 = _h(wh_ptr, hb + 1 + 4 * g)
            i1 = _h(wh_ptr, hb + 2 + 4 * g)
            i2 = _h(wh_ptr, hb + 3 + 4 * g)
            i3 = _h(wh_ptr, hb + 4 + 4 * g)
            a = (((_h(wh_ptr, hb + 33 + g // 2) >> (8 * (g % 2))) & 255)
                 | (((_h(wh_ptr, hb + 53 + g // 4) >> (8 * ((g // 2) % 2) + 4 * (g % 2))) & 15)
                    << 8))
            b = _h(wh_ptr, hb + 37 + 2 * g) | (_h(wh_ptr, hb + 38 + 2 * g) << 16)
    return i0, i1, i2, i3, a, b, d


@triton.jit
def _byte(i0, i1, i2, i3, RI: tl.constexpr):
    # index byte RI of the group (two a 16-bit word)
    return (_pick4(i0, i1, i2, i3, RI // 2) >> (8 * (RI % 2))) & 255


@triton.jit
def _grid_row(i0, i1, i2, i3, a, b, d, g, RI: tl.constexpr, TYPE: tl.constexpr,
              ASM: tl.constexpr):
    """Row RI of a group: (grid index, sign bits (bit j for value j), float scale, IQ1's
    delta in units of grid/8, else 0)."""
    delta = 0
    sgn = 0
    if TYPE == 16:  # IQ2_XXS
        gi = _byte(i0, i1, i2, i3, RI)
        sgn = _ksigns((a >> (7 * RI)) & 127, ASM)
        db = d * (0.5 + ((a >> 28) & 15).to(tl.float32)) * 0.25
    elif TYPE == 17:  # IQ2_XS: row RI's u16 is word RI
        q = _pick4(i0, i1, i2, i3, RI)
        gi = q & 511
        sgn = _ksigns(q >> 9, ASM)
        db = d * (0.5 + ((a >> (4 * (RI // 2))) & 15).to(tl.float32)) * 0.25
    elif TYPE == 22:  # IQ2_S
        gi = _byte(i0, i1, i2, i3, RI) | (((b >> (2 * RI)) & 3) << 8)
        sgn = (a >> (8 * RI)) & 255
        db = d * (0.5 + ((b >> (8 + 4 * (RI // 2))) & 15).to(tl.float32)) * 0.25
    elif TYPE == 19:  # IQ1_S
        gi = _byte(i0, i1, i2, i3, RI) | (((a >> (3 * RI)) & 7) << 8)
        db = d * (2 * ((a >> 12) & 7) + 1).to(tl.float32) * 0.125
        delta = 1 - 2 * ((a >> 15) & 1)
    elif TYPE == 29:  # IQ1_M
        nib = (a >> (4 * RI)) & 15
        gi = _byte(i0, i1, i2, i3, RI) | ((nib & 7) << 8)
        s3 = (b >> (3 * ((2 * g + RI // 2) % 4))) & 7
        db = d * (2 * s3 + 1).to(tl.float32) * 0.125
        delta = 1 - 2 * (nib >> 3)
    elif TYPE == 18:  # IQ3_XXS: 8 rows of 4
        gi = _byte(i0, i1, i2, i3, RI)
        sgn = (_ksigns((a >> (7 * (RI // 2))) & 127, ASM) >> (4 * (RI % 2))) & 15
        db = d * (0.5 + ((a >> 28) & 15).to(tl.float32)) * 0.5
    else:  # IQ3_S
        gi = _byte(i0, i1, i2, i3, RI) | (((a >> RI) & 1) << 8)
        sgn = (b >> (4 * RI)) & 15
        db = d * (1 + 2 * ((a >> 8) & 15)).to(tl.float32)
    return gi, sgn, db, delta


@triton.jit
def _sign_masks(s7, ASM: tl.constexpr):
    # the ksigns pattern of a 7-bit sign index s7 (its parity the 8th sign) as the masks of
    # _byte_masks
    if ASM:
        p = tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [s7], dtype=tl.int32,
                                      is_pure=True, pack=1)
    else:  # only bit 0 of p counts: the parity
        p = s7 ^ (s7 >> 4)
        p = p ^ (p >> 2)
        p = p ^ (p >> 1)
    return _byte_masks(s7, s7 + (p << 7), ASM)


@triton.jit
def _byte_masks(lo, s8, ASM: tl.constexpr):
    # 8 sign bits as two words of 0x00 / 0xFF bytes, for values 0-3 and 4-7: signs 0-3 the
    # low 4 bits of lo (lo < 128), signs 4-7 bits 4-7 of s8. lo * 0x10204080 puts bit k at
    # bit 8k + 7 (the shifted copies of a 7-bit number do not overlap, so nothing carries),
    # s8's high nibble goes there by 0x01020408 the same way, and a byte permute repeats each
    # byte's top bit through it
    m0 = _prmt_sign(lo * 0x10204080, ASM)
    m1 = _prmt_sign((s8 & 0xF0) * 0x01020408, ASM)
    return m0, m1


@triton.jit
def _prmt_sign(a, ASM: tl.constexpr):
    # 0xFF in each byte of a whose top bit is set, else 0x00 (prmt's sign-repeating selectors)
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, 0, 0xBA98;", "=r,r", [a],
                                          dtype=tl.int32, is_pure=True, pack=1)
    else:
        m = (a >> 7) & 0x01010101
        return m * 255


@triton.jit
def _signed(w, s4):
    # the 4 grid bytes of word w (each 1..127), byte k negated where bit k of s4 is set:
    # s4 * 0x00204081 puts bit k at bit 8k, (v ^ 0xFF) + 1 = -v in a byte, with no carry out
    # of the byte since v > 0
    m = (s4 * 0x00204081) & 0x01010101
    return (w ^ (m * 255)) + m


@triton.jit
def _sbyte(w, K: tl.constexpr):
    # signed byte K of int32 w, as int32
    return (w << (24 - 8 * K)) >> 24


@triton.jit
def _half(w, K: tl.constexpr, BF16: tl.constexpr):
    # 16-bit value K of x word w (two bf16 or f16), as float32
    if BF16:
        if K == 0:
            return (w << 16).to(tl.float32, bitcast=True)
        else:
            return (w & -65536).to(tl.float32, bitcast=True)
    else:
        return ((w >> (16 * K)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(
            tl.float32)


@triton.jit
def _x_words(xrow):
    # x as the bodies of a 4-value word read it (carve_kernels/gemv_lowbit.py, gemv_dot.py's Q8_0):
    # decode's int8 copy in int32 words, 16-bit or float32 x in 64-bit words (4 or 2 values)
    XQ: tl.constexpr = xrow.dtype.element_ty == tl.int8
    if XQ:
        return xrow.to(tl.pointer_type(tl.int32))
    else:
        return xrow.to(tl.pointer_type(tl.int64))


@triton.jit
def _word_dot(w, xa, xb, X16: tl.constexpr, BF16: tl.constexpr):
    # sum over the 4 signed bytes k of grid word w of byte k times x value k: of the 64-bit x
    # word xa (four 16-bit values), or of xa then xb (two float32 each)
    s = tl.zeros(w.shape, dtype=tl.float32)
    for k in tl.static_range(4):
        q = _sbyte(w, k).to(tl.float32)
        if X16:
            s += q * _half((xa >> (32 * (k // 2))).to(tl.int32), k % 2, BF16)
        elif k < 2:
            s += q * (xa >> (32 * k)).to(tl.int32).to(tl.float32, bitcast=True)
        else:
            s += q * (xb >> (32 * (k - 2))).to(tl.int32).to(tl.float32, bitcast=True)
    return s


@triton.jit
def _add_bytes(w, v):
    # bytewise w + v (no carry between bytes)
    return ((w & 0x7F7F7F7F) + (v & 0x7F7F7F7F)) ^ ((w ^ v) & -0x7F7F7F80)  # 0x80808080


@triton.jit
def _step(row_half, blk, nblk, g, TS: tl.constexpr, BLOCK_R: tl.constexpr,
          BLOCK_B: tl.constexpr):
    """One step of the lane-per-32-values bodies (this module's and carve_kernels/gemv_lowbit.py's)
    over blocks ``blk`` [B] of rows at 16-bit offsets ``row_half`` [R, 1, 1]: (each block's
    16-bit offset [R, B, 1], past the last block the last one's; each lane's 32-value group
    of x, as a full [R, B, 8] tile in the weights' register layout (no conversion); its
    mask)."""
    hb = row_half + (tl.minimum(blk, nblk - 1) * (TS // 2))[None, :, None]
    xg = tl.broadcast_to((blk * 8)[None, :, None] + g, (BLOCK_R, BLOCK_B, 8))
    xm = tl.broadcast_to((blk < nblk)[None, :, None], (BLOCK_R, BLOCK_B, 8))
    return hb, xg, xm


@triton.jit
def iq_rows_dot(w_ptr, wh_ptr, g_ptr, xrow, xd_ptr, rows_c, nblk, row_bytes,
                TYPE: tl.constexpr, TS: tl.constexpr, W: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_B: tl.constexpr, ASM: tl.constexpr):
    """[BLOCK_R] float32 dot products of rows ``rows_c`` (of a grid IQ type, ``W`` values per
    grid row) with the activation row at ``xrow`` (float32, bf16 or f16, its start 8-byte
    aligned; or int8: decode's int8 copy of x, its scales per 32 values at ``xd_ptr``);
    ``wh_ptr``: the weight as 16-bit words; ``g_ptr``: the type's grid
    (carve_kernels.lowbit_blocks.lookup_table, its start 8-byte aligned), read a row per word.
    ASM: dp4a as the GPU's instruction (else integer ops: the interpreter)."""
    NR: tl.constexpr = 32 // W  # grid rows per group of 32 values
    # one scale for the whole group (the others: one per 16 values)
    PER_GROUP: tl.constexpr = TYPE == 16 or TYPE == 18 or TYPE == 19 or TYPE == 21
    IQ1: tl.constexpr = TYPE == 19 or TYPE == 29
    XQ: tl.constexpr = xrow.dtype.element_ty == tl.int8
    X16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16 or (
        xrow.dtype.element_ty == tl.float16)
    BF16: tl.constexpr = xrow.dtype.element_ty == tl.bfloat16
    # x values per word: a grid row's worth of int8 values (one word), four 16-bit values or
    # two float32 in 64 bits
    XV: tl.constexpr = W if XQ else (4 if X16 else 2)
    if W == 4:
        gw = g_ptr.to(tl.pointer_type(tl.int32))
    else:
        gw = g_ptr.to(tl.pointer_type(tl.int64))
    if XQ and W == 4:
        xw = xrow.to(tl.pointer_type(tl.int32))
    else:
        xw = xrow.to(tl.pointer_type(tl.int64))
    tb = tl.arange(0, BLOCK_B)
    g = tl.arange(0, 8)[None, None, :]  # the lane's group in its block
    row_half = rows_c.to(tl.int64)[:, None, None] * (row_bytes // 2)
    acc = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        hb, xg, xm = _step(row_half, b0 + tb, nblk, g, TS, BLOCK_R, BLOCK_B)
        i0, i1, i2, i3, a, b, d = _group(wh_ptr, hb, g, TYPE)
        xo = xg * (32 // XV)  # the group's first x word
        gsum = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.float32)
        isum = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.int32)
        for i in tl.static_range(NR):
            gi, sgn, db, delta = _grid_row(i0, i1, i2, i3, a, b, d, g, i, TYPE, ASM)
            gr = tl.load(gw + gi)  # the row's 4 or 8 grid bytes
            if W == 4:
                w0 = gr
                w1 = gr
            else:
                w0 = gr.to(tl.int32)
                w1 = (gr >> 32).to(tl.int32)
            if IQ1:  # signed grid values times 8, plus the row's delta in every byte
                dw = (delta & 255) * 0x01010101
                w0 = _add_bytes(w0, dw)
                w1 = _add_bytes(w1, dw)
            else:
                w0 = _signed(w0, sgn & 15)
                w1 = _signed(w1, (sgn >> 4) & 15)
            v0 = W * i  # the row's first value in the group
            if XQ:  # the row's int8 x values are one word; integer sums over the group (or
                # over the row when its scale is its own)
                xa = tl.load(xw + xo + i, mask=xm, other=0)
                if not PER_GROUP:
                    isum = tl.zeros([BLOCK_R, BLOCK_B, 8], dtype=tl.int32)
                if W == 4:
                    isum = _dp4a(w0, xa, isum, ASM, True)
                else:
                    isum = _dp4a(w0, xa.to(tl.int32), isum, ASM, True)
                    isum = _dp4a(w1, (xa >> 32).to(tl.int32), isum, ASM, True)
                if PER_GROUP:
                    if i == NR - 1:
                        gsum = db * isum.to(tl.float32)
                else:
                    gsum += db * isum.to(tl.float32)
            elif X16:
                xa = tl.load(xw + xo + v0 // 4, mask=xm, other=0)
                s = _word_dot(w0, xa, xa, True, BF16)
                if W == 8:
                    xb = tl.load(xw + xo + v0 // 4 + 1, mask=xm, other=0)
                    s += _word_dot(w1, xb, xb, True, BF16)
                gsum += db * s
            else:
                xa = tl.load(xw + xo + v0 // 2, mask=xm, other=0)
                xb = tl.load(xw + xo + v0 // 2 + 1, mask=xm, other=0)
                s = _word_dot(w0, xa, xb, False, BF16)
                if W == 8:
                    xc = tl.load(xw + xo + v0 // 2 + 2, mask=xm, other=0)
                    xd = tl.load(xw + xo + v0 // 2 + 3, mask=xm, other=0)
                    s += _word_dot(w1, xc, xd, False, BF16)
                gsum += db * s
        if XQ:  # x's scale of the group
            gsum = gsum * tl.load(xd_ptr + xg, mask=xm, other=0.0)
        acc += gsum
    return tl.sum(tl.sum(acc, axis=2), axis=1)


# A T body's grid in shared memory (ASM == 2, gemv_t.SMEM_TYPES): its rows read by `ld.shared`
# in the loop instead of gathered from L1. Triton gives a kernel no shared array of its own to
# index, so the array is a static `.shared` variable declared by the inline asm that returns
# its address (not pure: a rematerialized copy would declare a second, empty array), filled
# once a program from the table in global memory, then a barrier.
@triton.jit
def _smem_base(BYTES: tl.constexpr):
    if BYTES <= 1024:
        a = tl.inline_asm_elementwise(
            "{ .shared .align 16 .b8 carve_grid[1024]; mov.u32 $0, carve_grid; }", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1)
    elif BYTES <= 2048:
        a = tl.inline_asm_elementwise(
            "{ .shared .align 16 .b8 carve_grid[2048]; mov.u32 $0, carve_grid; }", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1)
    elif BYTES <= 4096:
        a = tl.inline_asm_elementwise(
            "{ .shared .align 16 .b8 carve_grid[4096]; mov.u32 $0, carve_grid; }", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1)
    elif BYTES <= 8192:
        a = tl.inline_asm_elementwise(
            "{ .shared .align 16 .b8 carve_grid[8192]; mov.u32 $0, carve_grid; }", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.static_assert(BYTES <= 16384, "a grid of at most 16 KiB")
        a = tl.inline_asm_elementwise(
            "{ .shared .align 16 .b8 carve_grid[16384]; mov.u32 $0, carve_grid; }", "=r", [],
            dtype=tl.int32, is_pure=False, pack=1)
    return a


@triton.jit
def grid_fill(tab_ptr, BYTES: tl.constexpr, BLOCK_N: tl.constexpr):
    """A shared copy of the grid of BYTES bytes at tab_ptr (8-byte aligned), made by the
    program's BLOCK_N lanes, then a barrier: its shared address, for `grid_tab`. Called once
    a program, where every thread of it passes."""
    base = _smem_base(BYTES)
    src = tab_ptr.to(tl.pointer_type(tl.int64))
    W: tl.constexpr = BYTES // 8
    offs = tl.arange(0, BLOCK_N)
    for i in tl.static_range((W + BLOCK_N - 1) // BLOCK_N):
        k = tl.minimum(i * BLOCK_N + offs, W - 1)  # lanes past the end write the last again
        tl.inline_asm_elementwise("st.shared.b64 [$1], $2; mov.u32 $0, 0;", "=r,r,l",
                                  [base + 8 * k, tl.load(src + k)], dtype=tl.int32,
                                  is_pure=False, pack=1)
    tl.inline_asm_elementwise("bar.sync 0; mov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                              is_pure=False, pack=1)
    return base


@triton.jit
def grid_tab(tab_ptr, W64: tl.constexpr, ASM: tl.constexpr):
    """What a T body's `grid_row` reads: with ASM == 2 tab_ptr is already the shared copy
    (`grid_fill`'s address), else the grid in global memory as int64 (W64) or int32 rows."""
    if ASM == 2:
        tab = tab_ptr
    elif W64:
        tab = tab_ptr.to(tl.pointer_type(tl.int64))
    else:
        tab = tab_ptr.to(tl.pointer_type(tl.int32))
    return tab


@triton.jit
def grid_row(tab, i, W64: tl.constexpr, ASM: tl.constexpr):
    """Grid row i (int64 rows if W64, else int32) of what `grid_tab` gave."""
    if ASM == 2:
        if W64:
            r = tl.inline_asm_elementwise("ld.shared.b64 $0, [$1];", "=l,r", [tab + 8 * i],
                                          dtype=tl.int64, is_pure=False, pack=1)
        else:
            r = tl.inline_asm_elementwise("ld.shared.b32 $0, [$1];", "=r,r", [tab + 4 * i],
                                          dtype=tl.int32, is_pure=False, pack=1)
    else:
        r = tl.load(tab + i)
    return r

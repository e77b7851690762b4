"""Dequantize one part of a GGUF block inside a Triton program.

Every quantized kernel (decode GEMV, dequantize-to-f16 for prefill, embedding gather) walks a
tile of ``[rows, blocks]`` GGUF blocks and, for each of a type's NPART parts, gets the part's
values ``[rows, blocks, L]`` in float32 and the element index of each of the L lanes inside the
block. Splitting a block into parts whose scale is a per-block scalar keeps the scale arithmetic
out of the per-element work (one FMA per element for the scale, one for the product).

Block layouts are ggml's ``ggml-common.h``; the arithmetic mirrors ``dequantize_row_*`` of
``ggml-quants.c`` (the torch twin is ``carve_kernels.dequant``).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from carve_kernels.lowbit_blocks import LOWBIT_PLANS, lowbit_part
from spec import quant_types as qt


class BlockPlan(NamedTuple):
    block: int  # elements per block
    nbytes: int  # bytes per block
    parts: int  # parts per block
    lanes: int  # elements per part


# F16/BF16 rows are walked in 32-element "blocks" so that one kernel serves every type.
PLANS: dict[int, BlockPlan] = {
    qt.F16: BlockPlan(32, 64, 1, 32),
    qt.BF16: BlockPlan(32, 64, 1, 32),
    qt.Q4_0: BlockPlan(32, 18, 2, 16),
    qt.Q5_0: BlockPlan(32, 22, 2, 16),
    qt.Q8_0: BlockPlan(32, 34, 1, 32),
    qt.Q4_K: BlockPlan(256, 144, 8, 32),
    qt.Q5_K: BlockPlan(256, 176, 8, 32),
    qt.Q6_K: BlockPlan(256, 210, 16, 16),
    qt.MXFP4: BlockPlan(32, 17, 2, 16),
    # Q4_1, Q5_1, Q2_K, Q3_K and the IQ family: carve_kernels/lowbit_blocks.py
    **{t: BlockPlan(*p) for t, p in LOWBIT_PLANS.items()},
}


@triton.jit
def _u8(ptr, off):
    return tl.load(ptr + off).to(tl.int32)


@triton.jit
def _i8(ptr, off):
    v = tl.load(ptr + off).to(tl.int32)
    return tl.where(v > 127, v - 256, v)


@triton.jit
def _f32(q, bias: tl.constexpr, MAGIC: tl.constexpr = False):
    # int (0..2^22) -> float32 minus ``bias``. MAGIC: OR q into the mantissa of 2^23 and
    # subtract (one integer op and one add at full rate instead of the low-rate I2F convert)
    if MAGIC:
        return (q | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + bias)
    else:
        return q.to(tl.float32) - bias


@triton.jit
def _scale_min_k4(w_ptr, base, J: tl.constexpr):
    # get_scale_min_k4(j, scales) of ggml-quants.c; J is known at compile time
    s = base + 4
    if J < 4:
        sc = _u8(w_ptr, s + J) & 63
        mn = _u8(w_ptr, s + J + 4) & 63
    else:
        q4 = _u8(w_ptr, s + J + 4)
        sc = (q4 & 15) | ((_u8(w_ptr, s + J - 4) >> 6) << 4)
        mn = (q4 >> 4) | ((_u8(w_ptr, s + J) >> 6) << 4)
    return sc.to(tl.float32), mn.to(tl.float32)


@triton.jit
def _e8m0_half(x):
    # ggml_e8m0_to_fp32_half: 2^(x - 128) as float32 bits (a subnormal for x < 2)
    bits = tl.where(x < 2, 0x00200000 << x, (x - 1) << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _mxfp4_int(q):
    # the doubled e2m1 value of a nibble as an integer: 0 1 2 3 4 6 8 12, bit 3 the sign
    m = q & 7
    mag = tl.where(m < 4, m, (2 + (m & 1)) << ((m >> 1) - 1))
    return tl.where(q >= 8, -mag, mag)


@triton.jit
def _mxfp4_value(q):
    # the doubled e2m1 value of a nibble, float32
    return _mxfp4_int(q).to(tl.float32)


@triton.jit
def dequant_part(w_ptr, wh_ptr, base, lane, TYPE: tl.constexpr, P: tl.constexpr,
                 MAGIC: tl.constexpr = False, g_ptr=None):
    """Part P of the blocks at byte offsets ``base`` ([R, B, 1], even): values [R, B, L] float32
    and the element index of each lane inside the block ([L]).

    ``w_ptr`` is the tensor's bytes, ``wh_ptr`` the same memory as 16-bit floats (f16, or bf16
    for a BF16 tensor) so that scale fields load as one access. ``g_ptr``: the type's value
    table (carve_kernels.lowbit_blocks.lookup_table) for the IQ types.
    """
    if TYPE == 1 or TYPE == 30:  # F16 / BF16
        e = lane
        v = tl.load(wh_ptr + base // 2 + lane[None, None, :]).to(tl.float32)
    elif TYPE == 2:  # Q4_0: d, qs[16]; element j low nibble, j+16 high nibble
        e = lane + 16 * P
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        q = (_u8(w_ptr, base + 2 + lane[None, None, :]) >> (4 * P)) & 15
        v = _f32(q, 8.0, MAGIC) * d
    elif TYPE == 6:  # Q5_0: d, qh[4] (bit j: 5th bit of element j), qs[16]
        e = lane + 16 * P
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        q = (_u8(w_ptr, base + 6 + lane[None, None, :]) >> (4 * P)) & 15
        hb = (_u8(w_ptr, base + 2 + 2 * P + lane[None, None, :] // 8) >> (lane[None, None, :] % 8)) & 1
        v = _f32(q | (hb << 4), 16.0, MAGIC) * d
    elif TYPE == 8:  # Q8_0: d, qs[32] int8
        e = lane
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        v = _f32(_u8(w_ptr, base + 2 + lane[None, None, :]) ^ 128, 128.0, MAGIC) * d
    elif TYPE == 12:  # Q4_K: d, dmin, scales[12], qs[128]; part P = sub-block P of 32
        e = lane + 32 * P
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        dmin = tl.load(wh_ptr + base // 2 + 1).to(tl.float32)
        sc, mn = _scale_min_k4(w_ptr, base, P)
        q = (_u8(w_ptr, base + 16 + 32 * (P // 2) + lane[None, None, :]) >> (4 * (P % 2))) & 15
        v = _f32(q, 0.0, MAGIC) * (d * sc) - dmin * mn
    elif TYPE == 13:  # Q5_K: d, dmin, scales[12], qh[32], qs[128]; 5th bit = bit P of qh[l]
        e = lane + 32 * P
        d = tl.load(wh_ptr + base // 2).to(tl.float32)
        dmin = tl.load(wh_ptr + base // 2 + 1).to(tl.float32)
        sc, mn = _scale_min_k4(w_ptr, base, P)
        q = (_u8(w_ptr, base + 48 + 32 * (P // 2) + lane[None, None, :]) >> (4 * (P % 2))) & 15
        hb = (_u8(w_ptr, base + 16 + lane[None, None, :]) >> P) & 1
        v = _f32(q | (hb << 4), 0.0, MAGIC) * (d * sc) - dmin * mn
    elif TYPE == 39:  # MXFP4: e (E8M0), qs[16]; element j low nibble, j+16 high nibble
        # 17-byte blocks: ``base`` may be odd here (nothing loads through wh_ptr)
        e = lane + 16 * P
        q = (_u8(w_ptr, base + 1 + lane[None, None, :]) >> (4 * P)) & 15
        v = _mxfp4_value(q) * _e8m0_half(_u8(w_ptr, base))
    elif (TYPE == 3 or TYPE == 7 or TYPE == 10 or TYPE == 11 or TYPE == 16 or TYPE == 17
          or TYPE == 18 or TYPE == 19 or TYPE == 20 or TYPE == 21 or TYPE == 22 or TYPE == 23
          or TYPE == 29):
        v, e = lowbit_part(w_ptr, wh_ptr, g_ptr, base, lane, TYPE, P)
    else:  # Q6_K: ql[128], qh[64], scales[16] int8, d; part P = 16 elements of one scale
        # P = 8n + 2g + h: half n (128 elements), quarter g (32), half-quarter h (16)
        n = P // 8
        g = (P // 2) % 4
        h = P % 2
        e = lane + 128 * n + 32 * g + 16 * h
        d = tl.load(wh_ptr + base // 2 + 104).to(tl.float32)
        sc = _i8(w_ptr, base + 192 + 8 * n + 2 * g + h).to(tl.float32)
        ql = _u8(w_ptr, base + 64 * n + 32 * (g % 2) + 16 * h + lane[None, None, :])
        qh = _u8(w_ptr, base + 128 + 32 * n + 16 * h + lane[None, None, :])
        q = ((ql >> (4 * (g // 2))) & 15) | (((qh >> (2 * g)) & 3) << 4)
        v = _f32(q, 32.0, MAGIC) * (d * sc)
    return v, e


def plan(ggml_type: int) -> BlockPlan:
    """The block plan of a type the kernels run; CarveError names the type otherwise."""
    from spec.errors import CarveError

    p = PLANS.get(ggml_type)
    if p is None:
        names = ", ".join(qt.type_name(t) for t in PLANS)
        raise CarveError(
            f"no GPU kernel for tensor type {qt.type_name(ggml_type)}; the GPU engine runs {names}"
        )
    return p


__all__ = ["PLANS", "BlockPlan", "dequant_part", "plan", "triton"]

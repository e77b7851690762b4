"""The parts of the low-bit types inside a Triton program: Q4_1, Q5_1, Q2_K, Q3_K and the IQ
family (IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M).

``lowbit_part`` is ``carve_kernels.quant_blocks.dequant_part`` for these types: part P of a tile of
blocks as float32 values ``[R, B, L]`` and the element index of each lane, every part one scale
per block. Block layouts are ggml's ``ggml-common.h``, the arithmetic that of
``dequantize_row_*`` in ``ggml-quants.c`` (the torch twin is ``carve_kernels.dequant``).

The IQ types read values from tables of the format (a 16-value list, or grids of 4 or 8 values
per row). They come from the installed gguf package, the reference itself, on first use, and
live on the device as one small int8 tensor per type (``lookup_table``); kernels get it as their
table pointer. IQ1's grid is stored times 8 so that ``grid + delta`` (delta = +-1/8) is an exact
integer and one multiply by ``dl / 8`` rounds as the reference does. The sign patterns of
IQ2_XXS, IQ2_XS and IQ3_XXS (``ksigns_iq2xs``: seven bits and their parity) are computed, not
looked up.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl

from spec import launch
from spec import quant_types as qt

# (block elements, bytes, parts, lanes) as carve_kernels.quant_blocks.BlockPlan
LOWBIT_PLANS: dict[int, tuple[int, int, int, int]] = {
    qt.Q4_1: (32, 20, 2, 16),
    qt.Q5_1: (32, 24, 2, 16),
    qt.Q2_K: (256, 84, 16, 16),
    qt.Q3_K: (256, 110, 16, 16),
    qt.IQ4_NL: (32, 18, 2, 16),
    qt.IQ4_XS: (256, 136, 16, 16),
    qt.IQ2_XXS: (256, 66, 8, 32),
    qt.IQ2_XS: (256, 74, 16, 16),
    qt.IQ2_S: (256, 82, 16, 16),
    qt.IQ3_XXS: (256, 98, 8, 32),
    qt.IQ3_S: (256, 110, 8, 32),
    qt.IQ1_S: (256, 50, 8, 32),
    qt.IQ1_M: (256, 56, 16, 16),
}

# type -> (gguf.quants class whose table it reads, factor)
_TABLES: dict[int, tuple[str, int]] = {
    qt.IQ4_NL: ("IQ4_NL", 1), qt.IQ4_XS: ("IQ4_NL", 1),
    qt.IQ2_XXS: ("IQ2_XXS", 1), qt.IQ2_XS: ("IQ2_XS", 1), qt.IQ2_S: ("IQ2_S", 1),
    qt.IQ3_XXS: ("IQ3_XXS", 1), qt.IQ3_S: ("IQ3_S", 1),
    qt.IQ1_S: ("IQ1_S", 8), qt.IQ1_M: ("IQ1_S", 8),  # one grid (iq1s_grid) for both
}
TABLE_TYPES = frozenset(_TABLES)


@functools.cache
def _table_values(name: str, times: int) -> np.ndarray:
    import gguf.quants  # numpy-heavy, and only these types need it: imported on first use

    cls = getattr(gguf.quants, name)
    if name == "IQ4_NL":
        return np.array(cls.kvalues, dtype=np.int8)
    cls.init_grid()
    return (cls.grid.reshape(-1) * times).astype(np.int8)


_DEVICE_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def _layout() -> dict[tuple[str, int], int]:
    """Byte offset of each distinct table in the lookup buffer, each in whole 256-byte lines."""
    out, off = {}, 0
    for src in dict.fromkeys(_TABLES.values()):
        out[src] = off
        off += -(-_table_values(*src).size // 256) * 256
    return out


def lookup_table(ggml_type: int, device: torch.device | str) -> torch.Tensor | None:
    """The int8 value table the kernels of ``ggml_type`` read on ``device`` (a 16-value list,
    or grid rows of 4 or 8 values one after the other); None for types that read no table.
    A view into the device's installed lookup buffer (``install_tables``: the GPU runner's
    priced buf.lookup), else a tensor of its own made on first use (tests, benchmarks; call it
    before capturing a CUDA graph: that first call copies to the device)."""
    src = _TABLES.get(ggml_type)
    if src is None:
        return None
    key = (ggml_type, str(torch.device(device)))
    t = _DEVICE_TABLES.get(key)
    if t is None:
        t = torch.from_numpy(_table_values(*src).copy()).to(device)
        _DEVICE_TABLES[key] = t
    return t


def install_tables(buf: torch.Tensor) -> torch.Tensor:
    """Write every table into ``buf`` (uint8 [LOOKUP_BYTES] on a device: a stage's
    buf.lookup) and serve its views from ``lookup_table`` on that device; returns the int32
    flags of its last 256-byte line (carve_kernels/scale_scan.py). Nothing is allocated on the
    device: the host tables are copied straight into ``buf``."""
    if buf.dtype != torch.uint8 or buf.numel() != launch.LOOKUP_BYTES:
        raise ValueError(f"the lookup buffer is uint8 [{launch.LOOKUP_BYTES}]")
    dev = str(buf.device)
    for t, src in _TABLES.items():
        values = torch.from_numpy(_table_values(*src).copy())
        off = _layout()[src]
        view = buf[off:off + values.numel()]
        view.copy_(values.view(torch.uint8))
        _DEVICE_TABLES[(t, dev)] = view.view(torch.int8)
    return buf[-4 * launch.LOOKUP_FLAGS:].view(torch.int32)


def uninstall_tables(buf: torch.Tensor) -> None:
    """Forget the views into ``buf`` (its stage is closing: nothing may keep its arena)."""
    base = buf.untyped_storage().data_ptr()
    for key, t in list(_DEVICE_TABLES.items()):
        if t.untyped_storage().data_ptr() == base:
            del _DEVICE_TABLES[key]


@triton.jit
def _u8(ptr, off):
    return tl.load(ptr + off).to(tl.int32)


@triton.jit
def _u16(ptr, off):
    # a little-endian u16 from two byte loads (the fields need not be 2-byte aligned)
    return _u8(ptr, off) | (_u8(ptr, off + 1) << 8)


@triton.jit
def _f16(wh_ptr, base, k):
    # the half-float field k (2 bytes each) of the blocks at byte offsets ``base``
    return tl.load(wh_ptr + base // 2 + k).to(tl.float32)


@triton.jit
def _look(g_ptr, idx):
    return tl.load(g_ptr + idx).to(tl.int32)


@triton.jit
def _ksign(s, j):
    # bit j of ksigns_iq2xs[s], s 7 bits: bits 0-6 are s itself, bit 7 its parity
    p = s ^ (s >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return tl.where(j == 7, p & 1, (s >> j) & 1)


@triton.jit
def lowbit_part(w_ptr, wh_ptr, g_ptr, base, lane, TYPE: tl.constexpr, P: tl.constexpr):
    """Part P of the blocks at byte offsets ``base`` ([R, B, 1], even): values [R, B, L] float32
    and the element index of each lane inside the block ([L]). ``g_ptr``: the type's
    ``lookup_table`` (unused by Q4_1, Q5_1, Q2_K, Q3_K)."""
    ln = lane[None, None, :]
    if TYPE == 3:  # Q4_1: d, m, qs[16]; element j low nibble, j + 16 high nibble; d * q + m
        e = lane + 16 * P
        q = (_u8(w_ptr, base + 4 + ln) >> (4 * P)) & 15
        v = q.to(tl.float32) * _f16(wh_ptr, base, 0) + _f16(wh_ptr, base, 1)
    elif TYPE == 7:  # Q5_1: d, m, qh u32 (bit j: 5th bit of element j), qs[16]
        e = lane + 16 * P
        q = (_u8(w_ptr, base + 8 + ln) >> (4 * P)) & 15
        hb = (_u8(w_ptr, base + 4 + 2 * P + ln // 8) >> (ln % 8)) & 1
        v = (q | (hb << 4)).to(tl.float32) * _f16(wh_ptr, base, 0) + _f16(wh_ptr, base, 1)
    elif TYPE == 10 or TYPE == 11:  # Q2_K / Q3_K: P = 8n + 2j + h, 16 values of one scale
        n = P // 8
        j = (P // 2) % 4
        h = P % 2
        e = lane + 128 * n + 32 * j + 16 * h
        if TYPE == 10:  # scales[16] (scale | min << 4), qs[64], d, dmin
            sc = _u8(w_ptr, base + P)
            q = (_u8(w_ptr, base + 16 + 32 * n + 16 * h + ln) >> (2 * j)) & 3
            dl = _f16(wh_ptr, base, 40) * (sc & 15).to(tl.float32)
            v = dl * q.to(tl.float32) - _f16(wh_ptr, base, 41) * (sc >> 4).to(tl.float32)
        else:  # hmask[32], qs[64], scales[12] (16 six-bit scales - 32), d
            lo = (_u8(w_ptr, base + 96 + P % 8) >> (4 * (P // 8))) & 15
            hi = (_u8(w_ptr, base + 104 + P % 4) >> (2 * (P // 4))) & 3
            dl = _f16(wh_ptr, base, 54) * ((lo | (hi << 4)) - 32).to(tl.float32)
            q = (_u8(w_ptr, base + 32 + 32 * n + 16 * h + ln) >> (2 * j)) & 3
            hm = (_u8(w_ptr, base + 16 * h + ln) >> (4 * n + j)) & 1
            v = dl * (q - 4 + 4 * hm).to(tl.float32)
    elif TYPE == 20:  # IQ4_NL: d, qs[16]; nibbles index the 16 values as Q4_0's
        e = lane + 16 * P
        q = (_u8(w_ptr, base + 2 + ln) >> (4 * P)) & 15
        v = _look(g_ptr, q).to(tl.float32) * _f16(wh_ptr, base, 0)
    elif TYPE == 23:  # IQ4_XS: d, scales_h u16, scales_l[4], qs[128]; P = 2 * sub-block + h
        ib = P // 2
        e = lane + 16 * P
        hi = (_u8(w_ptr, base + 2 + ib // 4) >> (2 * (ib % 4))) & 3
        lo = (_u8(w_ptr, base + 4 + ib // 2) >> (4 * (ib % 2))) & 15
        dl = _f16(wh_ptr, base, 0) * ((lo | (hi << 4)) - 32).to(tl.float32)
        q = (_u8(w_ptr, base + 8 + 16 * ib + ln) >> (4 * (P % 2))) & 15
        v = _look(g_ptr, q).to(tl.float32) * dl
    elif TYPE == 16:  # IQ2_XXS: d, per 32 values 4 grid bytes + a u32 (4 x 7 sign bits, scale)
        e = lane + 32 * P
        o = base + 2 + 8 * P
        gi = _u8(w_ptr, o + ln // 8)
        aux = (_u8(w_ptr, o + 4) | (_u8(w_ptr, o + 5) << 8) | (_u8(w_ptr, o + 6) << 16)
               | ((_u8(w_ptr, o + 7) & 15) << 24))
        db = _f16(wh_ptr, base, 0) * (0.5 + (_u8(w_ptr, o + 7) >> 4).to(tl.float32)) * 0.25
        sb = _ksign((aux >> (7 * (ln // 8))) & 127, ln % 8)
        v = (_look(g_ptr, gi * 8 + ln % 8) * (1 - 2 * sb)).to(tl.float32) * db
    elif TYPE == 17:  # IQ2_XS: d, qs[32] u16 (9-bit grid row, 7 sign bits), scales[8] nibbles
        e = lane + 16 * P
        q = _u16(w_ptr, base + 2 + 2 * (2 * P + ln // 8))
        s = (_u8(w_ptr, base + 66 + P // 2) >> (4 * (P % 2))) & 15
        db = _f16(wh_ptr, base, 0) * (0.5 + s.to(tl.float32)) * 0.25
        sb = _ksign(q >> 9, ln % 8)
        v = (_look(g_ptr, (q & 511) * 8 + ln % 8) * (1 - 2 * sb)).to(tl.float32) * db
    elif TYPE == 22:  # IQ2_S: d, qs[32], signs[32], qh[8] (2 top bits per row), scales[8]
        e = lane + 16 * P
        r = 2 * P + ln // 8  # grid row (8 values) within the block
        gi = _u8(w_ptr, base + 2 + r) | (((_u8(w_ptr, base + 66 + P // 2) >> (2 * (r % 4))) & 3)
                                         << 8)
        sb = (_u8(w_ptr, base + 34 + r) >> (ln % 8)) & 1
        s = (_u8(w_ptr, base + 74 + P // 2) >> (4 * (P % 2))) & 15
        db = _f16(wh_ptr, base, 0) * (0.5 + s.to(tl.float32)) * 0.25
        v = (_look(g_ptr, gi * 8 + ln % 8) * (1 - 2 * sb)).to(tl.float32) * db
    elif TYPE == 18:  # IQ3_XXS: d, qs[64] (a 4-value grid row each), 8 u32 (signs, scale)
        e = lane + 32 * P
        gi = _u8(w_ptr, base + 2 + 8 * P + ln // 4)
        o = base + 66 + 4 * P
        aux = (_u8(w_ptr, o) | (_u8(w_ptr, o + 1) << 8) | (_u8(w_ptr, o + 2) << 16)
               | ((_u8(w_ptr, o + 3) & 15) << 24))
        db = _f16(wh_ptr, base, 0) * (0.5 + (_u8(w_ptr, o + 3) >> 4).to(tl.float32)) * 0.5
        sb = _ksign((aux >> (7 * (ln // 8))) & 127, ln % 8)
        v = (_look(g_ptr, gi * 4 + ln % 4) * (1 - 2 * sb)).to(tl.float32) * db
    elif TYPE == 21:  # IQ3_S: d, qs[64], qh[8] (top bit per row), signs[32], scales[4]
        e = lane + 32 * P
        r = ln // 4  # 4-value grid row within the 32 values
        gi = _u8(w_ptr, base + 2 + 8 * P + r) | (((_u8(w_ptr, base + 66 + P) >> r) & 1) << 8)
        sb = (_u8(w_ptr, base + 74 + 4 * P + ln // 8) >> (ln % 8)) & 1
        s = (_u8(w_ptr, base + 106 + P // 2) >> (4 * (P % 2))) & 15
        db = _f16(wh_ptr, base, 0) * (1 + 2 * s).to(tl.float32)
        v = (_look(g_ptr, gi * 4 + ln % 4) * (1 - 2 * sb)).to(tl.float32) * db
    elif TYPE == 19:  # IQ1_S: d, qs[32], qh[8] u16 (3 top bits per row, scale, delta sign)
        e = lane + 32 * P
        qh = _u16(w_ptr, base + 34 + 2 * P)
        gi = _u8(w_ptr, base + 2 + 4 * P + ln // 8) | (((qh >> (3 * (ln // 8))) & 7) << 8)
        dl = _f16(wh_ptr, base, 0) * (2 * ((qh >> 12) & 7) + 1).to(tl.float32)
        v = (_look(g_ptr, gi * 8 + ln % 8) + 1 - 2 * (qh >> 15)).to(tl.float32) * (dl * 0.125)
    else:  # IQ1_M: qs[32], qh[16] (a nibble per row: 3 top bits, delta sign), scales 4 x u16
        e = lane + 16 * P
        r = 2 * P + ln // 8
        nib = (_u8(w_ptr, base + 32 + r // 2) >> (4 * (r % 2))) & 15
        gi = _u8(w_ptr, base + r) | ((nib & 7) << 8)
        # the f16 d is the top nibbles of the four scale words
        d16 = ((_u8(w_ptr, base + 49) >> 4) | (_u8(w_ptr, base + 51) & 0xF0)
               | ((_u8(w_ptr, base + 53) >> 4) << 8) | ((_u8(w_ptr, base + 55) & 0xF0) << 8))
        d = d16.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
        s3 = (_u16(w_ptr, base + 48 + 2 * (P // 4)) >> (3 * (P % 4))) & 7
        dl = d * (2 * s3 + 1).to(tl.float32)
        v = (_look(g_ptr, gi * 8 + ln % 8) + 1 - 2 * (nib >> 3)).to(tl.float32) * (dl * 0.125)
    return v, e

"""CPU dequantization of the lookup types: IQ4_NL, IQ4_XS, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S, IQ1_S, IQ1_M and MXFP4, as kinds for carve_kernels/dequant.py's table (which runs them chunk
by chunk through its scratch). Bit-equal to `gguf.quants.dequantize`, as the other types are."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import numpy as np
import torch

from carve_kernels.dequant_scratch import Kind, Scratch, f16_field, split_bits
from spec import quant_types as qt

_I8 = torch.int8
_I16 = torch.int16
_I32 = torch.int32
_I64 = torch.int64
_F32 = torch.float32


# The values come from tables of the format (value lists, grids of 4 or 8 values, sign
# patterns). The tables are read from the installed gguf package, the reference itself, on first
# use and kept as torch tensors: one int word per row (a grid row of 8 int8 values is one int64),
# so one index_select fetches 2, 4 or 8 values at a time into uint8 scratch.
# A sign applied to the integer grid value before the float multiply gives the reference's
# (scale * grid) * sign exactly, since rounding to nearest is symmetric.


def _gguf_quants() -> ModuleType:
    import gguf.quants  # numpy-heavy, and only these types need it: imported on first use

    return gguf.quants


@functools.cache
def _nibble_pairs(name: str, device: torch.device) -> torch.Tensor:
    """gguf.quants.<name>.kvalues (16 int8 values) as int16 [256]: entry x holds the values of
    nibbles x & 15 (low byte) and x >> 4 (high byte)."""
    kv = np.array(getattr(_gguf_quants(), name).kvalues, dtype=np.int8)
    x = np.arange(256)
    pairs = np.stack([kv[x & 15], kv[x >> 4]], axis=1)  # [256, 2]
    return torch.from_numpy(pairs).view(_I16).reshape(256).to(device)


@functools.cache
def _grid(name: str, device: torch.device, times: int = 1) -> torch.Tensor:
    """gguf.quants.<name>'s grid times ``times`` as int8 rows, one int word per row: int64 [rows]
    for rows of 8 values, int32 [rows] for rows of 4."""
    cls = getattr(_gguf_quants(), name)
    cls.init_grid()
    rows = (cls.grid.reshape(cls.grid_shape) * times).astype(np.int8)
    word = _I64 if rows.shape[1] == 8 else _I32
    return torch.from_numpy(rows).view(word).reshape(-1).to(device)


@functools.cache
def _signs(device: torch.device, ksigns: bool) -> torch.Tensor:
    """Sign patterns as int64 [entries], 8 int8 values of +-1 each: value j of entry x is -1 where
    bit j of ``ksigns[x]`` (IQ2_XXS.ksigns, 128 entries, indexed by 7 bits) or of ``x`` itself
    (256 entries: a whole sign byte) is set."""
    if ksigns:
        patterns = np.frombuffer(_gguf_quants().IQ2_XXS.ksigns, dtype=np.uint8)
    else:
        patterns = np.arange(256, dtype=np.uint8)
    bits = ((patterns.reshape(-1, 1) >> np.arange(8, dtype=np.uint8)) & 1).astype(np.int8)
    values = 1 - 2 * bits  # [entries, 8] int8
    return torch.from_numpy(values).view(_I64).reshape(-1).to(device)


def _gather(table: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """``table[idx]`` written into the uint8 scratch ``dst`` (bytes for every fetched word);
    returns ``dst`` read as int8."""
    torch.index_select(table, 0, idx.reshape(-1), out=dst.view(-1).view(table.dtype))
    return dst.view(_I8)


def _nibble_scales(b: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The 4-bit fields of bytes ``b[:, start:stop]``, low nibble first, as uint8 [n, 2 * bytes]."""
    f = b[:, start:stop]
    return torch.stack([f & 0x0F, f >> 4], dim=2).view(b.shape[0], -1)


def _sc_iq4_nl(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (f16_field(b, 0).view(-1, 1, 1),)


def _iq4_nl(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_iq4_nl: d f16, qs[16]; element j = kvalues[low nibble of qs[j]], j + 16 the high one
    _nibble_lookup("IQ4_NL", b[:, 2:18], sc[0], out.view(-1, 2, 16), s)


def _nibble_lookup(
    name: str, qs: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, s: Scratch
) -> None:
    """out [..., 2, 16] = scale * kvalues[nibbles of qs [n, m * 16]] (low nibbles of 16 bytes,
    then their high nibbles), with scale broadcast over out."""
    n, m = qs.shape
    idx = s.i32("i", n, m).copy_(qs)
    pairs = _gather(_nibble_pairs(name, qs.device), idx, s.u8("q", n, 2 * m))
    pairs = pairs.view(*out.shape[:-2], 16, 2).transpose(-1, -2)  # [..., 2, 16]
    torch.mul(pairs, scale, out=out)


def _sc_mxfp4(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # e8m0 exponent byte, as ggml_e8m0_to_fp32_half: 2^(e - 128) (subnormal for e < 2)
    e = b[:, 0].to(_I32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(0x00200000, e), (e - 1) << 23)
    return (bits.view(_F32).view(-1, 1, 1),)


def _mxfp4(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_mxfp4: e u8, qs[16]; nibbles index the doubled e2m1 values as in IQ4_NL
    _nibble_lookup("MXFP4", b[:, 1:17], sc[0], out.view(-1, 2, 16), s)


def _sc_iq4_xs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # d f16, scales_h u16 (2 high bits of scale k at 2k), scales_l[4] (low nibbles): 6 bits - 32
    n = b.shape[0]
    sh = b[:, 2].to(_I32) | (b[:, 3].to(_I32) << 8)
    hi = (sh.view(n, 1) >> torch.arange(0, 16, 2, device=b.device)) & 3
    ls = (_nibble_scales(b, 4, 8).to(_I32) | (hi << 4)) - 32
    return ((f16_field(b, 0) * ls.to(_F32)).view(n, 8, 1, 1),)


def _iq4_xs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[128] at 8: 16 bytes per sub-block of 32, nibbles as in IQ4_NL
    _nibble_lookup("IQ4_NL", b[:, 8:136], sc[0], out.view(-1, 8, 2, 16), s)


def _sc_iq2_xxs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # per 32 values a u32 pair; the scale is bits 28-31 of the second: d * (0.5 + s) * 0.25
    n = b.shape[0]
    s4 = (b[:, 2:66].reshape(n, 8, 8)[:, :, 7] >> 4).to(_F32)
    return ((f16_field(b, 0) * (0.5 + s4) * 0.25).view(n, 8, 1),)


def _seven_bit_signs(aux: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Four 7-bit ksigns indices (bits 0, 7, 14, 21) of each int32 ``aux`` [n, g] into ``dst``
    [n, g, 4]."""
    for k in range(4):
        torch.bitwise_right_shift(aux, 7 * k, out=dst[:, :, k])
    dst &= 0x7F
    return dst


def _signed_grid(
    grid: torch.Tensor, gi: torch.Tensor, signs: torch.Tensor, si: torch.Tensor, s: Scratch
) -> torch.Tensor:
    """int8 [n, 256]: grid rows ``gi`` times sign patterns ``si``."""
    n = gi.shape[0]
    q = _gather(grid, gi, s.u8("q", n, 256))
    q *= _gather(signs, si, s.u8("t", n, 256))
    return q


def _iq2_xxs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[32] u16 at 2: per 32 values 4 grid bytes, then a u32 of 4 ksigns indices and the scale
    n = b.shape[0]
    c = s.u8("c", n, 64).copy_(b[:, 2:66])
    gi = s.i32("i", n, 8, 4).copy_(c.view(n, 8, 8)[:, :, 0:4])
    si = _seven_bit_signs(c.view(_I32).view(n, 8, 2)[:, :, 1], s.i32("j", n, 8, 4))
    q = _signed_grid(_grid("IQ2_XXS", b.device), gi, _signs(b.device, True), si, s)
    torch.mul(q.view(n, 8, 32), sc[0], out=out.view(n, 8, 32))


def _sc_iq2_xs_s(start: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, ...]]:
    """IQ2_XS / IQ2_S: scales[8] at ``start``, a nibble per 16 values: d * (0.5 + s) * 0.25."""

    def scales(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
        s4 = _nibble_scales(b, start, start + 8).to(_F32)
        return ((f16_field(b, 0) * (0.5 + s4) * 0.25).view(-1, 16, 1),)

    return scales


def _iq2_xs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[32] u16 at 2: bits 0-8 a grid row (512), bits 9-15 a ksigns index, per 8 values
    n = b.shape[0]
    qs = s.u8("c", n, 64).copy_(b[:, 2:66]).view(_I16)  # [n, 32]
    gi = torch.bitwise_and(qs, 0x1FF, out=s.i32("i", n, 32))
    si = torch.bitwise_right_shift(qs, 9, out=s.i32("j", n, 32))
    si &= 0x7F
    q = _signed_grid(_grid("IQ2_XS", b.device), gi, _signs(b.device, True), si, s)
    torch.mul(q.view(n, 16, 16), sc[0], out=out.view(n, 16, 16))


def _iq2_s(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[32] at 2 (low 8 bits of grid row, 1024), signs[32] at 34 (a bit per value), qh[8] at 66
    # (bits 2k..2k+1 of qh[i] are the top bits of row 4i + k)
    n = b.shape[0]
    gi = split_bits(b[:, 66:74], 2, s.i32("i", n, 8, 4), 2, shift=8)
    gi |= b[:, 2:34].view(n, 8, 4)
    si = s.i32("j", n, 32).copy_(b[:, 34:66])
    q = _signed_grid(_grid("IQ2_S", b.device), gi, _signs(b.device, False), si, s)
    torch.mul(q.view(n, 16, 16), sc[0], out=out.view(n, 16, 16))


def _sc_iq3_xxs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales_and_signs: 8 u32 at 66, the scale in bits 28-31: d * (0.5 + s) * 0.5
    n = b.shape[0]
    s4 = (b[:, 66:98].reshape(n, 8, 4)[:, :, 3] >> 4).to(_F32)
    return ((f16_field(b, 0) * (0.5 + s4) * 0.5).view(n, 8, 1),)


def _iq3_xxs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[64] at 2: a grid row of 4 values (256) each; 8 u32 at 66 with 4 ksigns indices each
    n = b.shape[0]
    gi = s.i32("i", n, 64).copy_(b[:, 2:66])
    aux = s.u8("c", n, 32).copy_(b[:, 66:98]).view(_I32)  # [n, 8]
    si = _seven_bit_signs(aux, s.i32("j", n, 8, 4))
    q = _signed_grid(_grid("IQ3_XXS", b.device), gi, _signs(b.device, True), si, s)
    torch.mul(q.view(n, 8, 32), sc[0], out=out.view(n, 8, 32))


def _sc_iq3_s(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[4] at 106, a nibble per 32 values: d * (1 + 2 * s)
    s4 = _nibble_scales(b, 106, 110).to(_I32)
    return ((f16_field(b, 0) * (1 + 2 * s4).to(_F32)).view(-1, 8, 1),)


def _iq3_s(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[64] at 2 (low 8 bits of a 4-value grid row, 512), qh[8] at 66 (bit j of qh[i]: top bit
    # of row 8i + j), signs[32] at 74 (a bit per value)
    n = b.shape[0]
    gi = split_bits(b[:, 66:74], 1, s.i32("i", n, 8, 8), 2, shift=8)
    gi |= b[:, 2:66].view(n, 8, 8)
    si = s.i32("j", n, 32).copy_(b[:, 74:106])
    q = _signed_grid(_grid("IQ3_S", b.device), gi, _signs(b.device, False), si, s)
    torch.mul(q.view(n, 8, 32), sc[0], out=out.view(n, 8, 32))


# IQ1_S / IQ1_M values are dl * (grid + delta) with grid in {-1, 0, 1} and delta +-1/8. They are
# computed as (dl / 8) * (8 * grid +- 1): scaling by 8 is exact, so the one rounding is the same.


def _sc_iq1_s(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # qh[8] u16 at 34: bits 12-14 the scale, bit 15 the sign of delta, per 32 values
    n = b.shape[0]
    hi = b[:, 35:50:2]  # high bytes of qh
    dl = f16_field(b, 0) * (2 * ((hi >> 4) & 7).to(_I32) + 1).to(_F32)
    delta = 1 - 2 * (hi >> 7).to(_I8)
    return (dl * 0.125).view(n, 8, 1), delta.view(n, 8, 1)


def _iq1_s(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[32] at 2: low 8 bits of a grid row (2048); bits 3k..3k+2 of qh[i] the top bits of 4i + k
    n = b.shape[0]
    qh = s.u8("c", n, 16).copy_(b[:, 34:50]).view(_I16)  # [n, 8]
    gi = s.i32("i", n, 8, 4)
    for k in range(4):
        torch.bitwise_right_shift(qh, 3 * k, out=gi[:, :, k])
    gi &= 7
    gi <<= 8
    gi |= b[:, 2:34].view(n, 8, 4)
    q = _gather(_grid("IQ1_S", b.device, 8), gi, s.u8("q", n, 256)).view(n, 8, 32)
    q += sc[1]
    torch.mul(q, sc[0], out=out.view(n, 8, 32))


def _sc_iq1_m(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales: 4 u16 at 48; bits 3j..3j+2 of u16 k scale 16 values (4k + j); their top nibbles
    # together are the f16 d
    n = b.shape[0]
    sc = b[:, 48:56]
    d16 = torch.stack([(sc[:, 1] >> 4) | (sc[:, 3] & 0xF0), (sc[:, 5] >> 4) | (sc[:, 7] & 0xF0)], 1)
    d = d16.view(torch.float16).to(_F32)  # [n, 1]
    u16 = sc[:, 0::2].to(_I32) | (sc[:, 1::2].to(_I32) << 8)  # [n, 4]
    s3 = (u16.view(n, 4, 1) >> torch.arange(0, 12, 3, device=b.device)) & 7
    dl = d * (2 * s3.view(n, 16) + 1).to(_F32)
    return ((dl * 0.125).view(n, 16, 1),)


def _iq1_m(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[32] at 0: low 8 bits of a grid row (2048); qh[16] at 32: nibble h of qh[i] belongs to
    # row 2i + h, bits 0-2 the row's top bits, bit 3 the sign of its delta
    n = b.shape[0]
    qh = b[:, 32:48]
    gi = s.i32("i", n, 16, 2)
    torch.bitwise_and(qh, 7, out=gi[:, :, 0])
    torch.bitwise_right_shift(qh, 4, out=gi[:, :, 1])
    gi &= 7
    gi <<= 8
    gi |= b[:, 0:32].view(n, 16, 2)
    delta = s.u8("c", n, 16, 2)
    torch.bitwise_right_shift(qh, 3, out=delta[:, :, 0])
    torch.bitwise_right_shift(qh, 7, out=delta[:, :, 1])
    delta &= 1
    delta *= 254  # uint8 wraps: 0 or -2 read as int8
    delta += 1  # +1 or -1
    q = _gather(_grid("IQ1_M", b.device, 8), gi, s.u8("q", n, 256)).view(n, 32, 8)
    q += delta.view(_I8).view(n, 32, 1)
    torch.mul(q.view(n, 16, 16), sc[0], out=out.view(n, 16, 16))


LOOKUP_KINDS: dict[int, Kind] = {
    qt.IQ4_NL: Kind(_sc_iq4_nl, _iq4_nl),
    qt.IQ4_XS: Kind(_sc_iq4_xs, _iq4_xs),
    qt.IQ2_XXS: Kind(_sc_iq2_xxs, _iq2_xxs),
    qt.IQ2_XS: Kind(_sc_iq2_xs_s(66), _iq2_xs),
    qt.IQ2_S: Kind(_sc_iq2_xs_s(74), _iq2_s),
    qt.IQ3_XXS: Kind(_sc_iq3_xxs, _iq3_xxs),
    qt.IQ3_S: Kind(_sc_iq3_s, _iq3_s),
    qt.IQ1_S: Kind(_sc_iq1_s, _iq1_s),
    qt.IQ1_M: Kind(_sc_iq1_m, _iq1_m),
    qt.MXFP4: Kind(_sc_mxfp4, _mxfp4),
}

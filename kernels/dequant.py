"""GGUF tensor bytes -> float tensors, in torch, for every type the engine runs.

Block layouts follow ggml's `ggml-common.h` and the arithmetic follows `ggml-quants.c`
(`dequantize_row_*`). The reference is `gguf.quants.dequantize`; every float op here is done in
float32 in the same order as there (d * scale first, then * q, then - min), and every integer step
is exact, so results are bit-equal to it (tests/engine/test_dequant.py). The lookup types (IQ
family, MXFP4) take their value lists, grids and sign patterns from the installed gguf package,
read once on first use.

How it is fast enough in plain torch on a CPU: each block's quants are assembled as exact
integers in uint8 scratch (shifts and masks on whole chunks, read as int8), and one mixed-dtype
multiply `int8 * float32 scale -> out` turns them into floats; the per-block scales are computed
once per *group* of chunks, so their many tiny ops are paid rarely.

Memory: work goes in chunks of whole blocks through scratch allocated once per call; a
[151936, 896] embedding needs no int64 or output-sized intermediate.
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch

from spec import quant_types as qt
from spec.errors import CarveError

# Output elements per chunk: 128K values keep a chunk's scratch (~1 MiB) in L2 while torch's
# per-op cost (~2-4 us of dispatch, which dominated at 32K) is paid 4x less often.
CHUNK_ELEMENTS = 1 << 17
# Chunks per group that share one computation of the per-block scales.
GROUP_CHUNKS = 8

_U8 = torch.uint8
_I8 = torch.int8
_I16 = torch.int16
_I32 = torch.int32
_I64 = torch.int64
_BYTES = 0x0101010101010101  # a byte mask repeated over the 8 bytes of an int64
_F32 = torch.float32


class _Scratch:
    """uint8 and float32 buffers of one chunk, reused for every chunk of a call."""

    def __init__(self, elements: int, device: torch.device) -> None:
        self.q = torch.empty(elements, dtype=_U8, device=device)
        self.t = torch.empty(elements, dtype=_U8, device=device)
        self.c = torch.empty(elements, dtype=_U8, device=device)  # aligned copies of fields
        self.f = torch.empty(elements, dtype=_F32, device=device)
        # table indices of the lookup types: nibble pairs / grid rows, and sign patterns
        self.i = torch.empty(elements // 2, dtype=_I32, device=device)
        self.j = torch.empty(elements // 4, dtype=_I32, device=device)
        self.bits_x16 = _BITS_TO_BYTES_X16.to(device)

    def u8(self, name: str, *shape: int) -> torch.Tensor:
        buf = getattr(self, name)
        return buf[: math.prod(shape)].view(shape)

    def f32(self, *shape: int) -> torch.Tensor:
        return self.f[: math.prod(shape)].view(shape)

    def i32(self, name: str, *shape: int) -> torch.Tensor:
        buf = getattr(self, name)
        return buf[: math.prod(shape)].view(shape)


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte ``offset`` of each block, as float32 [n, 1]."""
    field = blocks[:, offset : offset + 2]
    if field.storage_offset() % 2:  # bytes sliced at an odd address cannot be viewed as f16
        field = field.contiguous()
    # otherwise a strided dtype view (type sizes are all even), no copy of the blocks
    return field.view(torch.float16).to(_F32)


def _split_bits(
    src: torch.Tensor, bits: int, dst: torch.Tensor, slot_dim: int, shift: int = 0
) -> torch.Tensor:
    """Write field k (``bits`` wide, lowest first) of every byte of ``src`` to
    ``dst.select(slot_dim, k)``, shifted left by ``shift``. One shift per field, then one mask
    (and one shift) over all of ``dst``."""
    for k in range(8 // bits):
        torch.bitwise_right_shift(src, k * bits, out=dst.select(slot_dim, k))
    dst &= (1 << bits) - 1
    if shift:
        dst <<= shift
    return dst


def _words(b: torch.Tensor, start: int, stop: int, s: _Scratch) -> torch.Tensor:
    """Bytes ``b[:, start:stop]`` as int64 words [n, (stop - start) / 8]: a view when rows and
    the field are 8-byte aligned, else an aligned copy in scratch."""
    field = b[:, start:stop]
    if b.stride(0) % 8 or field.storage_offset() % 8:
        field = s.u8("c", b.shape[0], stop - start).copy_(field)
    return field.view(_I64)


def _unpack(words: torch.Tensor, bits: int, dst: torch.Tensor, shift: int = 0) -> torch.Tensor:
    """SWAR unpacking, 8 bytes per op: field k (``bits`` wide, lowest first) of byte l of group
    g in ``words`` [n, G, W] (int64) goes to byte ``dst[n, g, k, l]`` (uint8 [n, G, 8 // bits,
    8 * W]), shifted left by ``shift``. Shifted-in bits from the neighbouring byte (or the sign)
    are masked off, and bits + shift <= 8 keeps each field inside its byte."""
    dw = dst.view(_I64)  # [n, G, 8 // bits, W]
    for k in range(8 // bits):
        torch.bitwise_right_shift(words, k * bits, out=dw[:, :, k])
    dw &= ((1 << bits) - 1) * _BYTES
    if shift:
        dw <<= shift
    return dst


# Byte j of entry x = (bit j of x) << 4: the 5th bit of 8 Q5_0 / Q5_1 quants from one qh byte.
_BITS_TO_BYTES_X16 = torch.tensor(
    [sum(((x >> j) & 1) << (8 * j + 4) for j in range(8)) for x in range(256)], dtype=_I64
)


@dataclass(slots=True)
class _Kind:
    scales: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # blocks -> per-block floats
    values: Callable[..., None]  # (blocks, scales, out, scratch) -> None


# --- 32-element blocks ----------------------------------------------------------------------


def _nibbles32(b: torch.Tensor, start: int, s: _Scratch) -> torch.Tensor:
    """qs = b[:, start:start+16] -> uint8 [n, 2, 16]: element j is the low nibble of qs[j],
    element j + 16 its high nibble."""
    n = b.shape[0]
    return _unpack(_words(b, start, start + 16, s).view(n, 1, 2), 4, s.u8("q", n, 1, 2, 16))[:, 0]


def _high_bits32(qh: torch.Tensor, s: _Scratch) -> torch.Tensor:
    """qh [n, 4] (a little-endian uint32 per block) -> (bit j) << 4 as uint8 [n, 2, 16]."""
    idx = qh.reshape(-1).to(torch.int32)
    return s.bits_x16.index_select(0, idx).view(_U8).view(-1, 2, 16)


def _sc_d(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (_f16(b, 0).view(-1, 1, 1),)


def _sc_dm(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _f16(b, 0).view(-1, 1, 1), _f16(b, 2).view(-1, 1, 1)


def _q4_0(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_q4_0: d f16, qs[16]; x = d * (nibble - 8)
    n = b.shape[0]
    q = _nibbles32(b, 2, s)
    q -= 8  # uint8 wraps; read as int8 it is nibble - 8
    torch.mul(q.view(_I8), sc[0], out=out.view(n, 2, 16))


def _q4_1(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_q4_1: d f16, m f16, qs[16]; x = d * nibble + m
    n = b.shape[0]
    q = _nibbles32(b, 4, s)
    f = torch.mul(q, sc[0], out=s.f32(n, 2, 16))
    torch.add(f, sc[1], out=out.view(n, 2, 16))


def _q5_0(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_q5_0: d f16, qh[4] (bit j = 5th bit of element j), qs[16]; x = d * (q - 16)
    n = b.shape[0]
    q = _nibbles32(b, 6, s)
    q |= _high_bits32(b[:, 2:6], s)
    q -= 16
    torch.mul(q.view(_I8), sc[0], out=out.view(n, 2, 16))


def _q5_1(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_q5_1: d f16, m f16, qh[4], qs[16]; x = d * q + m
    n = b.shape[0]
    q = _nibbles32(b, 8, s)
    q |= _high_bits32(b[:, 4:8], s)
    f = torch.mul(q, sc[0], out=s.f32(n, 2, 16))
    torch.add(f, sc[1], out=out.view(n, 2, 16))


def _q8_0(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_q8_0: d f16, qs[32] int8; x = q * d
    torch.mul(b[:, 2:34].view(_I8), sc[0].view(-1, 1), out=out)


# --- 256-element super-blocks ---------------------------------------------------------------


def _sc_q2_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[16] at 0: low nibble scales a sub-block of 16, high nibble its min; d, dmin at 80
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = _f16(b, 80) * (scales & 0x0F).to(_F32)
    ml = _f16(b, 82) * (scales >> 4).to(_F32)
    return dl.view(n, 16, 1), ml.view(n, 16, 1)


def _q2_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qs[64] at 16: each half of 32 bytes holds 4 groups of 32 two-bit values
    n = b.shape[0]
    q = _unpack(_words(b, 16, 80, s).view(n, 2, 4), 2, s.u8("q", n, 2, 4, 32))
    f = torch.mul(q.view(n, 16, 16), sc[0], out=s.f32(n, 16, 16))
    torch.sub(f, sc[1], out=out.view(n, 16, 16))


def _sc_q3_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[12] at 96: 16 six-bit scales (low 4 bits in bytes 0-7, high 2 bits in 8-11), d at 108
    n = b.shape[0]
    sc = b[:, 96:108]
    lo = torch.empty(n, 2, 8, dtype=_U8, device=b.device)
    torch.bitwise_and(sc[:, 0:8], 0x0F, out=lo[:, 0])
    torch.bitwise_right_shift(sc[:, 0:8], 4, out=lo[:, 1])
    hi = _split_bits(sc[:, 8:12], 2, torch.empty(n, 4, 4, dtype=_U8, device=b.device), 1, shift=4)
    scales = (lo.view(n, 16) | hi.view(n, 16)).view(_I8).to(_F32) - 32
    return ((_f16(b, 108) * scales).view(n, 16, 1),)


def _q3_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # hmask[32] at 0, qs[64] at 32; q = 2 low bits + 4 * hmask bit - 4 (a clear bit subtracts 4)
    n = b.shape[0]
    w = _words(b, 0, 96, s)
    q = _unpack(w[:, 4:12].view(n, 2, 4), 2, s.u8("q", n, 2, 4, 32))
    # element (half g, group k, l) takes bit 4g + k of hmask[l]
    h = _unpack(w[:, 0:4].view(n, 1, 4), 1, s.u8("t", n, 1, 8, 32), shift=2).view(n, 8, 32)
    q = q.view(n, 8, 32)
    q += h
    q -= 4
    torch.mul(q.view(n, 16, 16).view(_I8), sc[0], out=out.view(n, 16, 16))


def _sc_k4(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q4_K / Q5_K: d, dmin at 0, 2 and get_scale_min_k4 over scales[12] at 4, for all 8
    sub-blocks: bytes 0-3 low 6 bits = scales 0-3, bytes 4-7 = mins 0-3, bytes 8-11 low/high
    nibble = low 4 bits of scale/min 4-7, whose high 2 bits are the top bits of bytes 0-3/4-7."""
    n = b.shape[0]
    s = b[:, 4:16].reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    dl = _f16(b, 0) * scale.to(_F32)
    ml = _f16(b, 2) * mins.to(_F32)
    return dl.view(n, 8, 1), ml.view(n, 8, 1)


def _q4_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qs[128] at 16: 4 groups of 32 bytes; low nibbles are sub-block 2g, high ones 2g + 1
    n = b.shape[0]
    q = _unpack(_words(b, 16, 144, s).view(n, 4, 4), 4, s.u8("q", n, 4, 2, 32))
    f = torch.mul(q.view(n, 8, 32), sc[0], out=s.f32(n, 8, 32))
    torch.sub(f, sc[1], out=out.view(n, 8, 32))


def _q5_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qh[32] at 16, qs[128] at 48; sub-block i takes its 5th bit from bit i of qh[l]
    n = b.shape[0]
    w = _words(b, 16, 176, s)
    q = _unpack(w[:, 4:20].view(n, 4, 4), 4, s.u8("q", n, 4, 2, 32)).view(n, 8, 32)
    q |= _unpack(w[:, 0:4].view(n, 1, 4), 1, s.u8("t", n, 1, 8, 32), shift=4).view(n, 8, 32)
    f = torch.mul(q, sc[0], out=s.f32(n, 8, 32))
    torch.sub(f, sc[1], out=out.view(n, 8, 32))


def _sc_q6_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[16] int8 at 192, d at 208
    n = b.shape[0]
    return ((_f16(b, 208) * b[:, 192:208].view(_I8).to(_F32)).view(n, 16, 1),)


def _q6_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # ql[128] at 0, qh[64] at 128. Per half h of 128 values: element k*64 + l takes nibble k of
    # ql[h, l] (l < 64) and element c*32 + l takes bits 2c..2c+1 of qh[h, l] (l < 32); q - 32.
    n = b.shape[0]
    w = _words(b, 0, 192, s)
    q = _unpack(w[:, 0:16].view(n, 2, 8), 4, s.u8("q", n, 2, 2, 64))
    h = _unpack(w[:, 16:24].view(n, 2, 4), 2, s.u8("t", n, 2, 4, 32), shift=4)
    q = q.view(n, 8, 32)
    q |= h.view(n, 8, 32)
    q -= 32
    torch.mul(q.view(n, 16, 16).view(_I8), sc[0], out=out.view(n, 16, 16))


# --- lookup types: IQ family and MXFP4 ------------------------------------------------------
# Their values come from tables of the format (value lists, grids of 4 or 8 values, sign
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
    return (_f16(b, 0).view(-1, 1, 1),)


def _iq4_nl(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_iq4_nl: d f16, qs[16]; element j = kvalues[low nibble of qs[j]], j + 16 the high one
    _nibble_lookup("IQ4_NL", b[:, 2:18], sc[0], out.view(-1, 2, 16), s)


def _nibble_lookup(
    name: str, qs: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, s: _Scratch
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


def _mxfp4(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # block_mxfp4: e u8, qs[16]; nibbles index the doubled e2m1 values as in IQ4_NL
    _nibble_lookup("MXFP4", b[:, 1:17], sc[0], out.view(-1, 2, 16), s)


def _sc_iq4_xs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # d f16, scales_h u16 (2 high bits of scale k at 2k), scales_l[4] (low nibbles): 6 bits - 32
    n = b.shape[0]
    sh = b[:, 2].to(_I32) | (b[:, 3].to(_I32) << 8)
    hi = (sh.view(n, 1) >> torch.arange(0, 16, 2, device=b.device)) & 3
    ls = (_nibble_scales(b, 4, 8).to(_I32) | (hi << 4)) - 32
    return ((_f16(b, 0) * ls.to(_F32)).view(n, 8, 1, 1),)


def _iq4_xs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qs[128] at 8: 16 bytes per sub-block of 32, nibbles as in IQ4_NL
    _nibble_lookup("IQ4_NL", b[:, 8:136], sc[0], out.view(-1, 8, 2, 16), s)


def _sc_iq2_xxs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # per 32 values a u32 pair; the scale is bits 28-31 of the second: d * (0.5 + s) * 0.25
    n = b.shape[0]
    s4 = (b[:, 2:66].reshape(n, 8, 8)[:, :, 7] >> 4).to(_F32)
    return ((_f16(b, 0) * (0.5 + s4) * 0.25).view(n, 8, 1),)


def _seven_bit_signs(aux: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Four 7-bit ksigns indices (bits 0, 7, 14, 21) of each int32 ``aux`` [n, g] into ``dst``
    [n, g, 4]."""
    for k in range(4):
        torch.bitwise_right_shift(aux, 7 * k, out=dst[:, :, k])
    dst &= 0x7F
    return dst


def _signed_grid(
    grid: torch.Tensor, gi: torch.Tensor, signs: torch.Tensor, si: torch.Tensor, s: _Scratch
) -> torch.Tensor:
    """int8 [n, 256]: grid rows ``gi`` times sign patterns ``si``."""
    n = gi.shape[0]
    q = _gather(grid, gi, s.u8("q", n, 256))
    q *= _gather(signs, si, s.u8("t", n, 256))
    return q


def _iq2_xxs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
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
        return ((_f16(b, 0) * (0.5 + s4) * 0.25).view(-1, 16, 1),)

    return scales


def _iq2_xs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qs[32] u16 at 2: bits 0-8 a grid row (512), bits 9-15 a ksigns index, per 8 values
    n = b.shape[0]
    qs = s.u8("c", n, 64).copy_(b[:, 2:66]).view(_I16)  # [n, 32]
    gi = torch.bitwise_and(qs, 0x1FF, out=s.i32("i", n, 32))
    si = torch.bitwise_right_shift(qs, 9, out=s.i32("j", n, 32))
    si &= 0x7F
    q = _signed_grid(_grid("IQ2_XS", b.device), gi, _signs(b.device, True), si, s)
    torch.mul(q.view(n, 16, 16), sc[0], out=out.view(n, 16, 16))


def _iq2_s(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qs[32] at 2 (low 8 bits of grid row, 1024), signs[32] at 34 (a bit per value), qh[8] at 66
    # (bits 2k..2k+1 of qh[i] are the top bits of row 4i + k)
    n = b.shape[0]
    gi = _split_bits(b[:, 66:74], 2, s.i32("i", n, 8, 4), 2, shift=8)
    gi |= b[:, 2:34].view(n, 8, 4)
    si = s.i32("j", n, 32).copy_(b[:, 34:66])
    q = _signed_grid(_grid("IQ2_S", b.device), gi, _signs(b.device, False), si, s)
    torch.mul(q.view(n, 16, 16), sc[0], out=out.view(n, 16, 16))


def _sc_iq3_xxs(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales_and_signs: 8 u32 at 66, the scale in bits 28-31: d * (0.5 + s) * 0.5
    n = b.shape[0]
    s4 = (b[:, 66:98].reshape(n, 8, 4)[:, :, 3] >> 4).to(_F32)
    return ((_f16(b, 0) * (0.5 + s4) * 0.5).view(n, 8, 1),)


def _iq3_xxs(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
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
    return ((_f16(b, 0) * (1 + 2 * s4).to(_F32)).view(-1, 8, 1),)


def _iq3_s(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
    # qs[64] at 2 (low 8 bits of a 4-value grid row, 512), qh[8] at 66 (bit j of qh[i]: top bit
    # of row 8i + j), signs[32] at 74 (a bit per value)
    n = b.shape[0]
    gi = _split_bits(b[:, 66:74], 1, s.i32("i", n, 8, 8), 2, shift=8)
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
    dl = _f16(b, 0) * (2 * ((hi >> 4) & 7).to(_I32) + 1).to(_F32)
    delta = 1 - 2 * (hi >> 7).to(_I8)
    return (dl * 0.125).view(n, 8, 1), delta.view(n, 8, 1)


def _iq1_s(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
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


def _iq1_m(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: _Scratch) -> None:
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


_KINDS: dict[int, _Kind] = {
    qt.Q4_0: _Kind(_sc_d, _q4_0),
    qt.Q4_1: _Kind(_sc_dm, _q4_1),
    qt.Q5_0: _Kind(_sc_d, _q5_0),
    qt.Q5_1: _Kind(_sc_dm, _q5_1),
    qt.Q8_0: _Kind(_sc_d, _q8_0),
    qt.Q2_K: _Kind(_sc_q2_k, _q2_k),
    qt.Q3_K: _Kind(_sc_q3_k, _q3_k),
    qt.Q4_K: _Kind(_sc_k4, _q4_k),
    qt.Q5_K: _Kind(_sc_k4, _q5_k),
    qt.Q6_K: _Kind(_sc_q6_k, _q6_k),
    qt.IQ4_NL: _Kind(_sc_iq4_nl, _iq4_nl),
    qt.IQ4_XS: _Kind(_sc_iq4_xs, _iq4_xs),
    qt.IQ2_XXS: _Kind(_sc_iq2_xxs, _iq2_xxs),
    qt.IQ2_XS: _Kind(_sc_iq2_xs_s(66), _iq2_xs),
    qt.IQ2_S: _Kind(_sc_iq2_xs_s(74), _iq2_s),
    qt.IQ3_XXS: _Kind(_sc_iq3_xxs, _iq3_xxs),
    qt.IQ3_S: _Kind(_sc_iq3_s, _iq3_s),
    qt.IQ1_S: _Kind(_sc_iq1_s, _iq1_s),
    qt.IQ1_M: _Kind(_sc_iq1_m, _iq1_m),
    qt.MXFP4: _Kind(_sc_mxfp4, _mxfp4),
}
_FLOAT_VIEWS = {qt.F32: torch.float32, qt.F16: torch.float16, qt.BF16: torch.bfloat16}

SUPPORTED_TYPES: tuple[int, ...] = (*_FLOAT_VIEWS, *_KINDS)


# --- public API -----------------------------------------------------------------------------


def _as_bytes(raw: torch.Tensor | np.ndarray) -> torch.Tensor:
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():
            # GGUF data is a read-only mmap; nothing here writes to it.
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(raw)
    if raw.dtype != _U8:
        raise TypeError(f"dequantize expects uint8 bytes, got {raw.dtype}")
    return raw.reshape(-1)


def _check(raw: torch.Tensor, ggml_type: int, shape: Sequence[int]) -> tuple[int, ...]:
    """Validate type, shape and byte count; return the torch shape (GGUF shape reversed)."""
    if ggml_type not in _KINDS and ggml_type not in _FLOAT_VIEWS:
        supported = ", ".join(qt.type_name(t) for t in SUPPORTED_TYPES)
        raise CarveError(
            f"tensor type {qt.type_name(ggml_type)} (ggml id {ggml_type}) is not supported by "
            f"the engine; use a GGUF quantized as one of: {supported}"
        )
    q = qt.quant(ggml_type)
    shape = tuple(int(s) for s in shape)
    if not shape or shape[0] % q.block_size:
        raise CarveError(
            f"{q.name} tensor of shape {shape}: rows of {shape[0] if shape else 0} values are not "
            f"whole blocks of {q.block_size}; the file is malformed"
        )
    want = qt.tensor_nbytes(ggml_type, math.prod(shape))
    if raw.numel() != want:
        raise CarveError(
            f"{q.name} tensor of shape {shape} needs {want} bytes but {raw.numel()} were given; "
            f"the file is truncated or malformed"
        )
    return shape[::-1]


def dequantize_to(
    raw: torch.Tensor | np.ndarray,
    ggml_type: int,
    shape: Sequence[int],
    dtype: torch.dtype = torch.float32,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize ``raw`` (the tensor's bytes, uint8) of a GGUF tensor of ``shape`` (GGUF order,
    ne0 innermost) into a ``dtype`` tensor of the reversed shape ([ne1, ne0] for a matrix).

    Values are computed in float32 exactly as ``gguf.quants.dequantize`` does, then rounded once to
    ``dtype``. With ``out`` (contiguous, ``dtype``, that shape, e.g. a span of a dequant-cache
    arena) the result is written there and nothing of output size is allocated. The result
    never shares memory with ``raw``.
    """
    raw = _as_bytes(raw)
    tshape = _check(raw, ggml_type, shape)
    if out is not None and (
        out.dtype != dtype or tuple(out.shape) != tshape or not out.is_contiguous()
    ):
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {tshape}, got "
            f"{out.dtype} {tuple(out.shape)}"
        )
    view = _FLOAT_VIEWS.get(ggml_type)
    if view is not None:
        src = raw.view(view).view(tshape)
        if out is None:
            # never a view: raw is often a read-only mmap that the caller will close
            out = torch.empty(tshape, dtype=dtype, device=raw.device)
        with _serial_torch():
            return out.copy_(src)

    q = qt.quant(ggml_type)
    blocks = raw.view(-1, q.type_size)  # [n_blocks, type_size]
    if out is None:
        out = torch.empty(tshape, dtype=dtype, device=raw.device)
    flat = out.view(-1, q.block_size)  # [n_blocks, block_size]
    step = max(1, CHUNK_ELEMENTS // q.block_size)
    group = step * GROUP_CHUNKS
    with _serial_torch():
        _run(_KINDS[ggml_type], blocks, flat, step, group)
    return out


@contextmanager
def _serial_torch() -> Iterator[None]:
    """Run torch ops on the calling thread only. Measured on this project's busy 2-core CI
    machine: an elementwise op split across OpenMP threads waited ~6 ms at the barrier whenever
    another process held the other core (1000x slower than serial). The setting is process-wide:
    a load and a generation must not run at once (the engine runs both on one worker)."""
    n = torch.get_num_threads()
    if n == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def _run(kind: _Kind, blocks: torch.Tensor, flat: torch.Tensor, step: int, group: int) -> None:
    """Dequantize ``blocks`` [n, type_size] into ``flat`` [n, block_size], chunk by chunk."""
    n_blocks = blocks.shape[0]
    scratch = _Scratch(min(step, n_blocks) * flat.shape[1], blocks.device)
    for g0 in range(0, n_blocks, group):
        g1 = min(g0 + group, n_blocks)
        scales = kind.scales(blocks[g0:g1])
        for i in range(g0, g1, step):
            j = min(i + step, g1)
            part = tuple(s[i - g0 : j - g0] for s in scales)
            # the last op of each kernel writes float32 results rounded once into out's dtype
            kind.values(blocks[i:j], part, flat[i:j], scratch)


def dequantize(
    raw: torch.Tensor | np.ndarray, ggml_type: int, shape: Sequence[int]
) -> torch.Tensor:
    """float32 values of a GGUF tensor; torch shape is ``shape`` reversed (rows = ne1, cols = ne0).
    CarveError for a type the engine does not run or a byte count that does not match."""
    return dequantize_to(raw, ggml_type, shape, torch.float32)

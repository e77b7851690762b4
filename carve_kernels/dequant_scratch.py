"""Scratch buffers, block-field readers and bit unpacking shared by the CPU dequantizers:
carve_kernels/dequant.py (legacy and K types, and the public API) and
carve_kernels/dequant_lookup.py (IQ family, MXFP4). All of it works on uint8 blocks [n_blocks,
type_size] in torch."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

_U8 = torch.uint8
_I32 = torch.int32
_I64 = torch.int64
_BYTES = 0x0101010101010101  # a byte mask repeated over the 8 bytes of an int64
_F32 = torch.float32


class Scratch:
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


def f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte ``offset`` of each block, as float32 [n, 1]."""
    field = blocks[:, offset : offset + 2]
    if field.storage_offset() % 2:  # bytes sliced at an odd address cannot be viewed as f16
        field = field.contiguous()
    # otherwise a strided dtype view (type sizes are all even), no copy of the blocks
    return field.view(torch.float16).to(_F32)


def split_bits(
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


def words(b: torch.Tensor, start: int, stop: int, s: Scratch) -> torch.Tensor:
    """Bytes ``b[:, start:stop]`` as int64 words [n, (stop - start) / 8]: a view when rows and
    the field are 8-byte aligned, else an aligned copy in scratch."""
    field = b[:, start:stop]
    if b.stride(0) % 8 or field.storage_offset() % 8:
        field = s.u8("c", b.shape[0], stop - start).copy_(field)
    return field.view(_I64)


def unpack(words: torch.Tensor, bits: int, dst: torch.Tensor, shift: int = 0) -> torch.Tensor:
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
class Kind:
    scales: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]  # blocks -> per-block floats
    values: Callable[..., None]  # (blocks, scales, out, scratch) -> None

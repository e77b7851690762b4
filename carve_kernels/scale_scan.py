"""Blocks whose scale is not finite: a damaged file's inf/NaN half-float d would turn every value
of its block, and every product summed with them, into inf/NaN, silently. The loaders scan every
quantized matrix's scale fields once (one byte per field read) and name the tensor.

    scan(w, ggml_type, flags, tag)   # GPU runner: flags[0] = max(flags[0], tag) if a block of
                                     # w (its GGUF bytes) has a non-finite scale; no allocation
    first_bad_block(raw, ggml_type)  # torch twin (the CPU engine's check): its index, or None

A half float is inf or NaN exactly when its five exponent bits are all set: bits 2-6 of its high
byte. The fields are spec.quant_types.SCALE_FIELDS' "f16" ones, and IQ1_M's d, spread over the
top nibbles of its four scale words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from spec import quant_types as qt

_IQ1M_SCALES = 48  # IQ1_M: scales[4] u16 at byte 48; d's high byte is bytes 55 and 53's tops
CHUNK_BLOCKS = 1 << 20  # the torch twin's blocks per step (bounds its temporaries)


def _fields(ggml_type: int) -> tuple[int, int, bool]:
    """(offset of the first f16 field's high byte or -1, the second's or -1, IQ1_M's d)."""
    offs = [off + 1 for off in qt.f16_fields(ggml_type)][:2]
    offs += [-1] * (2 - len(offs))
    return offs[0], offs[1], ggml_type == qt.IQ1_M


def scanned(ggml_type: int) -> bool:
    """Whether the type has scale fields the scan reads."""
    return _fields(ggml_type) != (-1, -1, False) and qt.QUANT[ggml_type].block_size > 1


@triton.jit
def _bad(hb):
    return (hb & 0x7C) == 0x7C


@triton.jit
def _scan_kernel(w_ptr, nblk, flag_ptr, tag, TS: tl.constexpr, O0: tl.constexpr,
                 O1: tl.constexpr, IQ1M: tl.constexpr, SC: tl.constexpr, BLOCK: tl.constexpr):
    # SC: IQ1_M's scales offset (a kernel reads no plain global of its module)
    b = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = b < nblk
    base = w_ptr + b * TS
    bad = tl.zeros([BLOCK], dtype=tl.int1)
    if O0 >= 0:
        bad = bad | _bad(tl.load(base + O0, mask=m, other=0).to(tl.int32))
    if O1 >= 0:
        bad = bad | _bad(tl.load(base + O1, mask=m, other=0).to(tl.int32))
    if IQ1M:
        hi = (tl.load(base + SC + 7, mask=m, other=0).to(tl.int32) & 0xF0) | (
            tl.load(base + SC + 5, mask=m, other=0).to(tl.int32) >> 4)
        bad = bad | _bad(hi)
    if tl.sum((bad & m).to(tl.int32), axis=0) > 0:
        tl.atomic_max(flag_ptr, tag)


def scan(w: torch.Tensor, ggml_type: int, flags: torch.Tensor, tag: int) -> None:
    """Raise ``flags[0]`` to ``tag`` (> 0) when a block of ``w`` (a matrix's GGUF bytes, any
    shape, contiguous uint8) has a non-finite scale. Types without scale fields: nothing."""
    if not scanned(ggml_type):
        return
    q = qt.QUANT[ggml_type]
    flat = w.reshape(-1)
    nblk = flat.numel() // q.type_size
    o0, o1, iq1m = _fields(ggml_type)
    block = 1024
    _scan_kernel[(triton.cdiv(nblk, block),)](flat, nblk, flags, tag, TS=q.type_size, O0=o0,
                                               O1=o1, IQ1M=iq1m, SC=_IQ1M_SCALES, BLOCK=block,
                                               num_warps=4)


def first_bad_block(raw: torch.Tensor, ggml_type: int) -> int | None:
    """Index of the first block of ``raw`` (a tensor's GGUF bytes, uint8) whose scale is not
    finite, or None."""
    if not scanned(ggml_type):
        return None
    q = qt.QUANT[ggml_type]
    blocks = raw.reshape(-1, q.type_size)
    o0, o1, iq1m = _fields(ggml_type)
    for i in range(0, blocks.shape[0], CHUNK_BLOCKS):
        b = blocks[i:i + CHUNK_BLOCKS]
        his = [b[:, o].to(torch.int32) for o in (o0, o1) if o >= 0]
        if iq1m:
            s = _IQ1M_SCALES
            his.append((b[:, s + 7].to(torch.int32) & 0xF0) | (b[:, s + 5].to(torch.int32) >> 4))
        bad = torch.zeros(b.shape[0], dtype=torch.bool, device=b.device)
        for hb in his:
            bad |= (hb & 0x7C) == 0x7C
        hit = torch.nonzero(bad)
        if hit.numel():
            return i + int(hit[0, 0])
    return None

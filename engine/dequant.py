"""GGUF tensor bytes -> float tensors, in torch, for every type the engine runs.

Block layouts follow ggml's `ggml-common.h` and the arithmetic follows `ggml-quants.c`
(`dequantize_row_*`). The reference is `gguf.quants.dequantize`; every float op here is done in
float32 in the same order as there, so results are bit-equal to it (tests/engine/test_dequant.py).

Work is done in chunks of whole blocks: the intermediates (uint8 nibbles, float32 scales) of a
chunk stay in cache, never exceed a few MiB, and a [151936, 896] embedding never needs an int64
or full-size scratch copy.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine import quant_types as qt
from engine.errors import CarveError

QK_K = 256
# Output elements per chunk: large enough that torch's per-op overhead (~5 us) stays small, small
# enough that a chunk's intermediates stay in L2 and that every op stays under torch's parallel
# grain size (32768): on a busy 2-core machine an OpenMP-split op waited ~6 ms at its barrier
# (1000x slower) whenever the other core was taken.
CHUNK_ELEMENTS = 1 << 14

_U8 = torch.uint8
_F32 = torch.float32


def _f16(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The f16 field at byte ``offset`` of each block, as float32 [n, 1]."""
    return blocks[:, offset : offset + 2].contiguous().view(torch.float16).to(_F32)


def _nibbles(qs: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    """Low then high nibbles: qs [n, groups*width] -> uint8 [n, groups, 2, width]
    (ggml packs element j of a group in the low nibble, j + width in the high one)."""
    n = qs.shape[0]
    src = qs.reshape(n, groups, width)
    out = torch.empty(n, groups, 2, width, dtype=_U8)
    torch.bitwise_and(src, 0x0F, out=out[:, :, 0])
    torch.bitwise_right_shift(src, 4, out=out[:, :, 1])
    return out


def _fields(qs: torch.Tensor, bits: int, groups: int, width: int) -> torch.Tensor:
    """Fields of ``bits`` bits, lowest first: qs [n, groups*width] ->
    uint8 [n, groups, 8 // bits, width], field k of byte l at [.., k, l]."""
    n = qs.shape[0]
    src = qs.reshape(n, groups, width)
    per = 8 // bits
    out = torch.empty(n, groups, per, width, dtype=_U8)
    mask = (1 << bits) - 1
    for k in range(per):  # 2, 4 or 8 passes, each over the whole chunk
        dst = out[:, :, k]
        if k:
            torch.bitwise_right_shift(src, k * bits, out=dst)
            dst &= mask
        else:
            torch.bitwise_and(src, mask, out=dst)
    return out


def _bits32(qh: torch.Tensor) -> torch.Tensor:
    """qh [n, 4] little-endian uint32 -> bit j of it as uint8 [n, 32]."""
    return _fields(qh, 1, 4, 1).reshape(qh.shape[0], 32)


# --- 32-element blocks -------------------------------------------------------------------


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_0: d f16, qs[16]
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18], 1, 16).reshape(n, 32)
    torch.mul(d, q.to(_F32).sub_(8), out=out)


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_1: d f16, m f16, qs[16]
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20], 1, 16).reshape(n, 32)
    torch.mul(d, q.to(_F32), out=out).add_(m)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_0: d f16, qh[4] (bit j = 5th bit of element j), qs[16]
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 6:22], 1, 16).reshape(n, 32) | (_bits32(b[:, 2:6]) << 4)
    torch.mul(d, q.to(_F32).sub_(16), out=out)


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_1: d f16, m f16, qh[4], qs[16]
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 8:24], 1, 16).reshape(n, 32) | (_bits32(b[:, 4:8]) << 4)
    torch.mul(d, q.to(_F32), out=out).add_(m)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q8_0: d f16, qs[32] int8
    d = _f16(b, 0)
    torch.mul(b[:, 2:34].view(torch.int8).to(_F32), d, out=out)


# --- 256-element super-blocks -------------------------------------------------------------


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q2_K: scales[16] (low 4 bits scale, high 4 bits min), qs[64], d f16, dmin f16
    n = b.shape[0]
    scales = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(_F32)).view(n, 16, 1)
    ml = (dmin * (scales >> 4).to(_F32)).view(n, 16, 1)
    # each of the 2 halves of qs holds 4 groups of 32 two-bit values
    q = _fields(b[:, 16:80], 2, 2, 32).reshape(n, 16, 16).to(_F32)
    torch.mul(dl, q, out=out.view(n, 16, 16)).sub_(ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q3_K: hmask[32], qs[64], scales[12] (16 six-bit scales), d f16
    n = b.shape[0]
    d = _f16(b, 108)
    sc = b[:, 96:108]
    lo = _nibbles(sc[:, 0:8], 1, 8).reshape(n, 16)
    hi = _fields(sc[:, 8:12], 2, 1, 4).reshape(n, 16)
    scales = (lo | (hi << 4)).view(torch.int8).to(_F32).sub_(32)
    dl = (d * scales).view(n, 16, 1)
    ql = _fields(b[:, 32:96], 2, 2, 32)
    hm = _fields(b[:, 0:32], 1, 1, 32)
    # a clear hmask bit means "subtract 4"
    q = ql.reshape(n, 16, 16).to(_F32).sub_(((hm ^ 1) << 2).reshape(n, 16, 16).to(_F32))
    torch.mul(dl, q, out=out.view(n, 16, 16))


def _scale_min_k4(sc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """get_scale_min_k4 of ggml-quants.c for all 8 sub-blocks: 12 bytes -> 8 scales, 8 mins."""
    n = sc.shape[0]
    s = sc.reshape(n, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mins = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale, mins


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_K: d f16, dmin f16, scales[12], qs[128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(_F32)).view(n, 8, 1)
    ml = (dmin * mn.to(_F32)).view(n, 8, 1)
    q = _nibbles(b[:, 16:144], 4, 32).reshape(n, 8, 32).to(_F32)
    torch.mul(dl, q, out=out.view(n, 8, 32)).sub_(ml)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_K: d f16, dmin f16, scales[12], qh[32], qs[128]
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _scale_min_k4(b[:, 4:16])
    dl = (d * sc.to(_F32)).view(n, 8, 1)
    ml = (dmin * mn.to(_F32)).view(n, 8, 1)
    ql = _nibbles(b[:, 48:176], 4, 32).reshape(n, 8, 32)
    # sub-block i takes its 5th bit from bit i of qh[l]
    qh = _fields(b[:, 16:48], 1, 1, 32).reshape(n, 8, 32) << 4
    q = (ql | qh).to(_F32)
    torch.mul(dl, q, out=out.view(n, 8, 32)).sub_(ml)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    # block_q6_K: ql[128], qh[64], scales[16] int8, d f16
    n = b.shape[0]
    d = _f16(b, 208)
    scales = b[:, 192:208].view(torch.int8).to(_F32)
    dl = (d * scales).view(n, 16, 1)
    ql = _nibbles(b[:, 0:128], 2, 64).reshape(n, 8, 32)
    qh = _fields(b[:, 128:192], 2, 2, 32).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(_F32).sub_(32)
    torch.mul(dl, q.view(n, 16, 16), out=out.view(n, 16, 16))


_BLOCK_KERNELS: dict[int, Callable[[torch.Tensor, torch.Tensor], None]] = {
    qt.Q4_0: _q4_0,
    qt.Q4_1: _q4_1,
    qt.Q5_0: _q5_0,
    qt.Q5_1: _q5_1,
    qt.Q8_0: _q8_0,
    qt.Q2_K: _q2_k,
    qt.Q3_K: _q3_k,
    qt.Q4_K: _q4_k,
    qt.Q5_K: _q5_k,
    qt.Q6_K: _q6_k,
}
_FLOAT_VIEWS = {qt.F32: torch.float32, qt.F16: torch.float16, qt.BF16: torch.bfloat16}

SUPPORTED_TYPES: tuple[int, ...] = (*_FLOAT_VIEWS, *_BLOCK_KERNELS)


# --- public API ---------------------------------------------------------------------------


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
    if ggml_type not in _BLOCK_KERNELS and ggml_type not in _FLOAT_VIEWS:
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
    arena) the result is written there and nothing of output size is allocated. For F32 without
    ``out`` the result may share memory with ``raw``.
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
            return src if src.dtype == dtype else src.to(dtype)
        return out.copy_(src)

    q = qt.quant(ggml_type)
    kernel = _BLOCK_KERNELS[ggml_type]
    blocks = raw.view(-1, q.type_size)  # [n_blocks, type_size]
    n_blocks = blocks.shape[0]
    if out is None:
        out = torch.empty(tshape, dtype=dtype, device=raw.device)
    flat = out.view(n_blocks, q.block_size)  # [n_blocks, block_size]
    step = max(1, CHUNK_ELEMENTS // q.block_size)
    scratch = None if dtype == _F32 else torch.empty(step, q.block_size, dtype=_F32)
    for i in range(0, n_blocks, step):
        j = min(i + step, n_blocks)
        if scratch is None:
            kernel(blocks[i:j], flat[i:j])
        else:
            part = scratch[: j - i]
            kernel(blocks[i:j], part)
            flat[i:j].copy_(part)
    return out


def dequantize(
    raw: torch.Tensor | np.ndarray, ggml_type: int, shape: Sequence[int]
) -> torch.Tensor:
    """float32 values of a GGUF tensor; torch shape is ``shape`` reversed (rows = ne1, cols = ne0).
    CarveError for a type the engine does not run or a byte count that does not match."""
    return dequantize_to(raw, ggml_type, shape, torch.float32)

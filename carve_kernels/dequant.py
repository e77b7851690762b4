"""GGUF tensor bytes -> float tensors, in torch, for every type the engine runs.

Block layouts follow ggml's `ggml-common.h` and the arithmetic follows `ggml-quants.c`
(`dequantize_row_*`). The reference is `gguf.quants.dequantize`; every float op here is done in
float32 in the same order as there (d * scale first, then * q, then - min), and every integer step
is exact, so results are bit-equal to it (tests/engine/test_dequant.py). The lookup types (IQ
family, MXFP4) are in carve_kernels/dequant_lookup.py, the scratch and field readers every type uses
in carve_kernels/dequant_scratch.py; this module holds the legacy and K types and runs them all.

How it is fast enough in plain torch on a CPU: each block's quants are assembled as exact
integers in uint8 scratch (shifts and masks on whole chunks, read as int8), and one mixed-dtype
multiply `int8 * float32 scale -> out` turns them into floats; the per-block scales are computed
once per *group* of chunks, so their many tiny ops are paid rarely.

Memory: work goes in chunks of whole blocks through scratch allocated once per call; a
[151936, 896] embedding needs no int64 or output-sized intermediate.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from carve_kernels.dequant_lookup import LOOKUP_KINDS
from carve_kernels.dequant_scratch import Kind, Scratch, f16_field, split_bits, unpack, words
from spec import quant_types as qt
from spec.errors import CarveError

# Output elements per chunk: 128K values keep a chunk's scratch (~1 MiB) in L2 while torch's
# per-op cost (~2-4 us of dispatch, which dominated at 32K) is paid 4x less often.
CHUNK_ELEMENTS = 1 << 17
# Chunks per group that share one computation of the per-block scales.
GROUP_CHUNKS = 8

_U8 = torch.uint8
_I8 = torch.int8
_F32 = torch.float32


# --- 32-element blocks ----------------------------------------------------------------------


def _nibbles32(b: torch.Tensor, start: int, s: Scratch) -> torch.Tensor:
    """qs = b[:, start:start+16] -> uint8 [n, 2, 16]: element j is the low nibble of qs[j],
    element j + 16 its high nibble."""
    n = b.shape[0]
    return unpack(words(b, start, start + 16, s).view(n, 1, 2), 4, s.u8("q", n, 1, 2, 16))[:, 0]


def _high_bits32(qh: torch.Tensor, s: Scratch) -> torch.Tensor:
    """qh [n, 4] (a little-endian uint32 per block) -> (bit j) << 4 as uint8 [n, 2, 16]."""
    idx = qh.reshape(-1).to(torch.int32)
    return s.bits_x16.index_select(0, idx).view(_U8).view(-1, 2, 16)


def _sc_d(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (f16_field(b, 0).view(-1, 1, 1),)


def _sc_dm(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return f16_field(b, 0).view(-1, 1, 1), f16_field(b, 2).view(-1, 1, 1)


def _q4_0(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_q4_0: d f16, qs[16]; x = d * (nibble - 8)
    n = b.shape[0]
    q = _nibbles32(b, 2, s)
    q -= 8  # uint8 wraps; read as int8 it is nibble - 8
    torch.mul(q.view(_I8), sc[0], out=out.view(n, 2, 16))


def _q4_1(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_q4_1: d f16, m f16, qs[16]; x = d * nibble + m
    n = b.shape[0]
    q = _nibbles32(b, 4, s)
    f = torch.mul(q, sc[0], out=s.f32(n, 2, 16))
    torch.add(f, sc[1], out=out.view(n, 2, 16))


def _q5_0(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_q5_0: d f16, qh[4] (bit j = 5th bit of element j), qs[16]; x = d * (q - 16)
    n = b.shape[0]
    q = _nibbles32(b, 6, s)
    q |= _high_bits32(b[:, 2:6], s)
    q -= 16
    torch.mul(q.view(_I8), sc[0], out=out.view(n, 2, 16))


def _q5_1(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_q5_1: d f16, m f16, qh[4], qs[16]; x = d * q + m
    n = b.shape[0]
    q = _nibbles32(b, 8, s)
    q |= _high_bits32(b[:, 4:8], s)
    f = torch.mul(q, sc[0], out=s.f32(n, 2, 16))
    torch.add(f, sc[1], out=out.view(n, 2, 16))


def _q8_0(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # block_q8_0: d f16, qs[32] int8; x = q * d
    torch.mul(b[:, 2:34].view(_I8), sc[0].view(-1, 1), out=out)


# --- 256-element super-blocks ---------------------------------------------------------------


def _sc_q2_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[16] at 0: low nibble scales a sub-block of 16, high nibble its min; d, dmin at 80
    n = b.shape[0]
    scales = b[:, 0:16]
    dl = f16_field(b, 80) * (scales & 0x0F).to(_F32)
    ml = f16_field(b, 82) * (scales >> 4).to(_F32)
    return dl.view(n, 16, 1), ml.view(n, 16, 1)


def _q2_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[64] at 16: each half of 32 bytes holds 4 groups of 32 two-bit values
    n = b.shape[0]
    q = unpack(words(b, 16, 80, s).view(n, 2, 4), 2, s.u8("q", n, 2, 4, 32))
    f = torch.mul(q.view(n, 16, 16), sc[0], out=s.f32(n, 16, 16))
    torch.sub(f, sc[1], out=out.view(n, 16, 16))


def _sc_q3_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[12] at 96: 16 six-bit scales (low 4 bits in bytes 0-7, high 2 bits in 8-11), d at 108
    n = b.shape[0]
    sc = b[:, 96:108]
    lo = torch.empty(n, 2, 8, dtype=_U8, device=b.device)
    torch.bitwise_and(sc[:, 0:8], 0x0F, out=lo[:, 0])
    torch.bitwise_right_shift(sc[:, 0:8], 4, out=lo[:, 1])
    hi = split_bits(sc[:, 8:12], 2, torch.empty(n, 4, 4, dtype=_U8, device=b.device), 1, shift=4)
    scales = (lo.view(n, 16) | hi.view(n, 16)).view(_I8).to(_F32) - 32
    return ((f16_field(b, 108) * scales).view(n, 16, 1),)


def _q3_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # hmask[32] at 0, qs[64] at 32; q = 2 low bits + 4 * hmask bit - 4 (a clear bit subtracts 4)
    n = b.shape[0]
    w = words(b, 0, 96, s)
    q = unpack(w[:, 4:12].view(n, 2, 4), 2, s.u8("q", n, 2, 4, 32))
    # element (half g, group k, l) takes bit 4g + k of hmask[l]
    h = unpack(w[:, 0:4].view(n, 1, 4), 1, s.u8("t", n, 1, 8, 32), shift=2).view(n, 8, 32)
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
    dl = f16_field(b, 0) * scale.to(_F32)
    ml = f16_field(b, 2) * mins.to(_F32)
    return dl.view(n, 8, 1), ml.view(n, 8, 1)


def _q4_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qs[128] at 16: 4 groups of 32 bytes; low nibbles are sub-block 2g, high ones 2g + 1
    n = b.shape[0]
    q = unpack(words(b, 16, 144, s).view(n, 4, 4), 4, s.u8("q", n, 4, 2, 32))
    f = torch.mul(q.view(n, 8, 32), sc[0], out=s.f32(n, 8, 32))
    torch.sub(f, sc[1], out=out.view(n, 8, 32))


def _q5_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # qh[32] at 16, qs[128] at 48; sub-block i takes its 5th bit from bit i of qh[l]
    n = b.shape[0]
    w = words(b, 16, 176, s)
    q = unpack(w[:, 4:20].view(n, 4, 4), 4, s.u8("q", n, 4, 2, 32)).view(n, 8, 32)
    q |= unpack(w[:, 0:4].view(n, 1, 4), 1, s.u8("t", n, 1, 8, 32), shift=4).view(n, 8, 32)
    f = torch.mul(q, sc[0], out=s.f32(n, 8, 32))
    torch.sub(f, sc[1], out=out.view(n, 8, 32))


def _sc_q6_k(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    # scales[16] int8 at 192, d at 208
    n = b.shape[0]
    return ((f16_field(b, 208) * b[:, 192:208].view(_I8).to(_F32)).view(n, 16, 1),)


def _q6_k(b: torch.Tensor, sc: tuple, out: torch.Tensor, s: Scratch) -> None:
    # ql[128] at 0, qh[64] at 128. Per half h of 128 values: element k*64 + l takes nibble k of
    # ql[h, l] (l < 64) and element c*32 + l takes bits 2c..2c+1 of qh[h, l] (l < 32); q - 32.
    n = b.shape[0]
    w = words(b, 0, 192, s)
    q = unpack(w[:, 0:16].view(n, 2, 8), 4, s.u8("q", n, 2, 2, 64))
    h = unpack(w[:, 16:24].view(n, 2, 4), 2, s.u8("t", n, 2, 4, 32), shift=4)
    q = q.view(n, 8, 32)
    q |= h.view(n, 8, 32)
    q -= 32
    torch.mul(q.view(n, 16, 16).view(_I8), sc[0], out=out.view(n, 16, 16))


_KINDS: dict[int, Kind] = {
    qt.Q4_0: Kind(_sc_d, _q4_0),
    qt.Q4_1: Kind(_sc_dm, _q4_1),
    qt.Q5_0: Kind(_sc_d, _q5_0),
    qt.Q5_1: Kind(_sc_dm, _q5_1),
    qt.Q8_0: Kind(_sc_d, _q8_0),
    qt.Q2_K: Kind(_sc_q2_k, _q2_k),
    qt.Q3_K: Kind(_sc_q3_k, _q3_k),
    qt.Q4_K: Kind(_sc_k4, _q4_k),
    qt.Q5_K: Kind(_sc_k4, _q5_k),
    qt.Q6_K: Kind(_sc_q6_k, _q6_k),
    **LOOKUP_KINDS,
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


def _run(kind: Kind, blocks: torch.Tensor, flat: torch.Tensor, step: int, group: int) -> None:
    """Dequantize ``blocks`` [n, type_size] into ``flat`` [n, block_size], chunk by chunk."""
    n_blocks = blocks.shape[0]
    scratch = Scratch(min(step, n_blocks) * flat.shape[1], blocks.device)
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

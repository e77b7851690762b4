"""q8_0 for the KV cache: ggml's block layout (f16 d, then 32 int8) built and read in torch.

The bytes are exactly what ggml's `quantize_row_q8_0_ref` writes, so a cache span priced at
34 bytes per 32 values holds them as they are, and `carve_kernels.dequant` reads them back bit-equal
to `gguf.quants.dequantize`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

QK8_0 = 32
BLOCK_BYTES = 34  # f16 d + 32 int8


def q8_0_nbytes(n_values: int) -> int:
    """Bytes of ``n_values`` values as q8_0 (``n_values`` a multiple of 32)."""
    if n_values % QK8_0:
        raise ValueError(f"q8_0 needs a multiple of {QK8_0} values, got {n_values}")
    return n_values // QK8_0 * BLOCK_BYTES


def _roundf(x: torch.Tensor) -> torch.Tensor:
    """C roundf (half away from zero) without forming x + 0.5, which itself rounds
    (0.49999997 + 0.5 == 1.0 in float32); same formula as gguf's np_roundf."""
    a = x.abs()
    f = a.floor()
    return (f + (2 * (a - f)).floor()).copysign_(x)


def quantize_q8_0(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., n*32] (any float dtype) -> uint8 [..., n*34], ggml's q8_0 blocks bit for bit.

    As ggml: per block d = amax / 127 in float32, q = roundf(x * (1/d)) (0 where d == 0), d
    stored as f16. ``out`` (uint8, that shape, contiguous — e.g. rows of a KV span) receives the
    bytes without a new allocation of output size.
    """
    if x.shape[-1] % QK8_0:
        raise ValueError(f"q8_0 rows must be a multiple of {QK8_0} values, got {x.shape[-1]}")
    lead = x.shape[:-1]
    nb = x.shape[-1] // QK8_0
    blocks = x.reshape(-1, QK8_0).to(torch.float32)  # [n_blocks, 32]
    d = blocks.abs().amax(dim=1, keepdim=True) / 127  # [n_blocks, 1]
    inv = torch.where(d == 0, torch.zeros_like(d), 1.0 / d)
    q = _roundf(blocks * inv).to(torch.int8)
    if out is None:
        out = torch.empty(*lead, nb * BLOCK_BYTES, dtype=torch.uint8, device=x.device)
    elif out.dtype != torch.uint8 or tuple(out.shape) != (*lead, nb * BLOCK_BYTES):
        raise ValueError(
            f"out must be uint8 {(*lead, nb * BLOCK_BYTES)}, got {out.dtype} {out.shape}"
        )
    ob = out.view(-1, BLOCK_BYTES)  # [n_blocks, 34]
    ob[:, :2] = d.to(torch.float16).view(torch.uint8)
    ob[:, 2:] = q.view(torch.uint8)
    return out


def dequantize_q8_0(
    raw: torch.Tensor, shape: Sequence[int], dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """uint8 q8_0 blocks -> ``dtype`` tensor of ``shape`` (the value shape, last dim n*32).

    Computed as float32 d * q, as ggml and gguf.quants do, then cast once to ``dtype``.
    """
    shape = tuple(int(s) for s in shape)
    n_values = 1
    for s in shape:
        n_values *= s
    if raw.dtype != torch.uint8 or raw.numel() != q8_0_nbytes(n_values):
        raise ValueError(
            f"raw must be {q8_0_nbytes(n_values)} uint8 bytes for q8_0 {shape}, "
            f"got {raw.numel()} {raw.dtype}"
        )
    b = raw.reshape(-1, BLOCK_BYTES)  # [n_blocks, 34]
    d = b[:, :2]
    if d.storage_offset() % 2:  # bytes at an odd address cannot be viewed as f16
        d = d.contiguous()
    # one mixed-dtype op: int8 quants times float32 d, the product ggml computes
    vals = torch.mul(b[:, 2:].view(torch.int8), d.view(torch.float16).to(torch.float32))
    return vals.view(shape).to(dtype)

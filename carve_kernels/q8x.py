"""int8 copies of one activation row for the decode GEMVs that multiply with ``dp4a``
(carve_kernels/gemv_t.py, ``xq=``): llama.cpp quantizes x the same way (q8_1) for its decode.

A row of K values (K a multiple of 32) is three arrays: ``q`` K int8 (the GEMV reads them as
int32 words of four), ``d`` K/32 float32 scales (amax / 127, IEEE division) and ``s`` K/32
float32 sums of the dequantized values (d times the sum of q), which the K-quants' min terms
need. The kernels that produce an activation (RMSNorm, the GLU epilogue) write this copy beside
their usual output, so no launch is added.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def quant32(x, AXIS: tl.constexpr):
    # q8_0 of the groups of 32 along AXIS of float32 x: (d = amax / 127, q = x / d rounded half
    # away from 0, as floats). IEEE divisions as in ggml's C: Triton's ``/`` is the approximate
    # div.full.f32 on a GPU, which moved q by one at some roundings. The KV cache's q8_0 and
    # the int8 x copies both quantize here.
    amax = tl.max(tl.abs(x), axis=AXIS)
    d = tl.div_rn(amax, 127.0)
    inv = tl.where(d > 0, tl.div_rn(tl.full(d.shape, 1.0, tl.float32), tl.where(d > 0, d, 1.0)),
                   0.0)
    z = x * tl.expand_dims(inv, AXIS)
    return d, tl.where(z < 0, -tl.floor(-z + 0.5), tl.floor(z + 0.5))


@triton.jit
def store_q8(v, start, valid, q_ptr, d_ptr, s_ptr, NV: tl.constexpr):
    # v [NV] float32 values at row offsets start .. start + NV - 1 (NV and start multiples of
    # 32), of which the first ``valid`` are stored (a multiple of 32, or all) -> their int8
    # values, scales and sums. The groups' offsets are arithmetic: no reduction finds them
    d, q = quant32(tl.reshape(v, [NV // 32, 32]), 1)
    s = tl.sum(q, axis=1) * d
    gi = tl.arange(0, NV // 32)
    i = gi[:, None] * 32 + tl.arange(0, 32)[None, :]
    tl.store(q_ptr.to(tl.pointer_type(tl.int8)) + start + i, q.to(tl.int8), mask=i < valid)
    grp = start // 32 + gi
    gm = gi * 32 < valid
    tl.store(d_ptr + grp, d, mask=gm)
    tl.store(s_ptr + grp, s, mask=gm)


def buffers(q: torch.Tensor, ds: torch.Tensor, k: int, at: int = 0):
    """(q as int32 words, d, s) views for a row of k values at value offset ``at`` of the
    priced buffers ``q`` (int32 words) and ``ds`` (float32 [2, groups])."""
    if k % 32 or at % 32:
        raise ValueError(f"an int8 row of {k} values at {at} is not whole groups of 32")
    return q[at // 4:(at + k) // 4], ds[0, at // 32:(at + k) // 32], ds[1, at // 32:(at + k) // 32]


def fits(bufs, k: int) -> bool:
    """Do the (q words, d, s) buffers hold an int8 copy of a row of k values?"""
    q, d, s = bufs
    return q.dtype == torch.int32 and q.numel() * 4 >= k and min(d.numel(), s.numel()) >= k // 32


def usable(xq, x2: torch.Tensor) -> bool:
    """Whether a GEMV of the rows ``x2`` [M, K] multiplies the int8 copy ``xq`` (q words, d, s)
    instead of x: there is one (decode writes it for one row) and x is one row; a copy too
    small for the row is a caller's mistake (ValueError)."""
    if xq is None or x2.shape[0] != 1:
        return False
    if not fits(xq, x2.shape[1]):
        raise ValueError(f"int8 x buffers too small for a row of {x2.shape[1]}")
    return True


def quantize_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [K] -> (int8 [K], d [K/32], s [K/32]) as the kernels write them (reference)."""
    v = x.to(torch.float32).reshape(-1, 32)
    d = v.abs().amax(-1) / 127.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    z = v * inv[:, None]
    q = torch.where(z < 0, -torch.floor(-z + 0.5), torch.floor(z + 0.5))
    return q.to(torch.int8).reshape(-1), d, q.sum(-1) * d


def dequantize_ref(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """The float32 values an int8 row stands for."""
    return (q.view(torch.int8).to(torch.float32).reshape(-1, 32) * d[:, None]).reshape(-1)


def copy_ref(x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                                        torch.Tensor]:
    """x [K] -> ((q as int32 words, d, s): the int8 copy as the GEMVs take it (``xq=``), and
    the float32 row [1, K] it stands for: the input of their reference)."""
    q, d, s = quantize_ref(x)
    return (q.view(torch.int32), d, s), dequantize_ref(q, d)[None]

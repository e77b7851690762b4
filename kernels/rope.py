"""Rotary position embedding, in place: "normal" (llama: adjacent pairs) and "neox" (halves)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, stride_t, stride_h, n_heads, log2_base, freq_scale,
                 D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < n_heads
    i = tl.arange(0, HALF)
    pos = tl.load(pos_ptr + t).to(tl.float32) * freq_scale
    # theta_i = pos * base^(-2i/D), as ggml computes it (powf of the base)
    theta = pos * tl.exp2(-(2.0 * i.to(tl.float32) / D) * log2_base)
    cos = tl.cos(theta)[None, :]
    sin = tl.sin(theta)[None, :]
    if NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    row = x_ptr + t.to(tl.int64) * stride_t + heads[:, None] * stride_h
    m = hmask[:, None]
    x1 = tl.load(row + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(row + i2[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(row + i1[None, :], (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=m)
    tl.store(row + i2[None, :], (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=m)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float, neox: bool,
         freq_scale: float = 1.0) -> torch.Tensor:
    """Rotate x [T, n_heads, head_dim] in place by positions [T] (int32, on x's device, so a
    captured decode graph reads the new position each step)."""
    t, nh, d = x.shape
    if x.stride(2) != 1:
        raise ValueError("rope needs the head dim contiguous")
    bh = min(16, triton.next_power_of_2(nh))
    grid = (t, triton.cdiv(nh, bh))
    _rope_kernel[grid](x, positions, x.stride(0), x.stride(1), nh, math.log2(base), freq_scale,
                       D=d, HALF=d // 2, NEOX=neox, BLOCK_H=bh, num_warps=4)
    return x


def rope_ref(x: torch.Tensor, positions: torch.Tensor, base: float, neox: bool,
             freq_scale: float = 1.0) -> torch.Tensor:
    t, nh, d = x.shape
    i = torch.arange(d // 2, device=x.device, dtype=torch.float64)
    inv = base ** (-2.0 * i / d)
    theta = (positions.to(torch.float64) * freq_scale)[:, None] * inv[None, :]  # [T, d/2]
    cos, sin = torch.cos(theta)[:, None, :], torch.sin(theta)[:, None, :]
    xf = x.to(torch.float64)
    if neox:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(t, nh, d)
    return x.copy_(out.to(x.dtype))

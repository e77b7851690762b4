"""Rotary position embedding, in place: "normal" (llama: adjacent pairs) and "neox" (halves);
and, for decode, the same rotation fused with storing the new key and value into the cache."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x
from carve_kernels.kv_cache import _kv_store_one, _views


@triton.jit
def _rope_kernel(x_ptr, pos_ptr, f_ptr, stride_t, stride_h, n_heads, log2_base, freq_scale,
                 mscale, D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
                 BLOCK_H: tl.constexpr, FREQS: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    _rope_heads(x_ptr, pos_ptr, f_ptr, stride_t, stride_h, tl.program_id(1) * BLOCK_H,
                n_heads, log2_base, freq_scale, mscale, tl.program_id(0), D, HALF, NEOX,
                BLOCK_H, FREQS, x_ptr, x_ptr, 0, 0.0, False)


@triton.jit
def _rope_heads(x_ptr, pos_ptr, f_ptr, stride_t, stride_h, h0, h_end, log2_base, freq_scale,
                mscale, t, D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
                BLOCK_H: tl.constexpr, FREQS: tl.constexpr, wq_ptr, wk_ptr, n_q, eps,
                QK_NORM: tl.constexpr):
    # rotate heads [h0, min(h0 + BLOCK_H, h_end)) of token t in place; returns them (two
    # halves, float32). QK_NORM: each head RMS-normed first (heads below n_q by wq, the rest
    # by wk) and rounded to x's dtype, the values norm.rmsnorm_heads would have stored
    heads = h0 + tl.arange(0, BLOCK_H)
    hmask = heads < h_end
    i = tl.arange(0, HALF)
    if FREQS:  # a frequency per pair (YaRN's ramp), angles and cos/sin scaled as the CPU's
        theta = tl.load(pos_ptr + t).to(tl.float32) * tl.load(f_ptr + i)
        cos = (tl.cos(theta) * mscale)[None, :]
        sin = (tl.sin(theta) * mscale)[None, :]
    else:
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
    if QK_NORM:
        inv = (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps))[:, None]
        isq = (heads < n_q)[:, None]
        w1 = tl.where(isq, tl.load(wq_ptr + i1)[None, :], tl.load(wk_ptr + i1)[None, :])
        w2 = tl.where(isq, tl.load(wq_ptr + i2)[None, :], tl.load(wk_ptr + i2)[None, :])
        x1 = (x1 * inv * w1.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
        x2 = (x2 * inv * w2.to(tl.float32)).to(x_ptr.dtype.element_ty).to(tl.float32)
    y1 = (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty)
    tl.store(row + i1[None, :], y1, mask=m)
    tl.store(row + i2[None, :], y2, mask=m)
    return heads, i1, i2, y1, y2


@triton.jit
def _q8_rows(c8_ptr, ch_ptr, blk0, y, BLOCK_H: tl.constexpr, HALF: tl.constexpr,
             m):
    # quantize y [BLOCK_H, HALF] (HALF a multiple of 32) as q8_0 blocks blk0[h] + 0, 1, ...
    d, q = q8x.quant32(tl.reshape(y.to(tl.float32), [BLOCK_H, HALF // 32, 32]), 2)
    blk = blk0[:, None] + tl.arange(0, HALF // 32)[None, :]
    tl.store(ch_ptr + blk * 17, d.to(tl.float16), mask=m[:, None])
    j = tl.arange(0, 32)
    tl.store(c8_ptr + blk[:, :, None] * 34 + 2 + j[None, None, :], q.to(tl.int8),
             mask=m[:, None, None])


@triton.jit
def rope_store_heads(x_ptr, pos_ptr, kc, kc8, kch, cells, n_q, KVH, stride_t, stride_h,
                     log2_base, freq_scale, f_ptr, mscale, wq_ptr, wk_ptr, eps, t, h0, h_end,
                     D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr,
                     BLOCK_H: tl.constexpr, Q8: tl.constexpr, FREQS: tl.constexpr,
                     QK_NORM: tl.constexpr):
    # heads [h0, min(h0 + BLOCK_H, h_end)) of token t's q heads then k heads rotated in place,
    # the k heads among them (from n_q on) also stored into the cache; also the epilogue of
    # q/k/v's T GEMV (carve_kernels/gemv_t3.py gemv_t3 with ``rope=``)
    heads, i1, i2, y1, y2 = _rope_heads(x_ptr, pos_ptr, f_ptr, stride_t, stride_h, h0, h_end,
                                        log2_base, freq_scale, mscale, t, D, HALF, NEOX,
                                        BLOCK_H, FREQS, wq_ptr, wk_ptr, n_q, eps, QK_NORM)
    kh = heads - n_q
    km = (kh >= 0) & (heads < h_end)
    cell = (tl.load(pos_ptr + t) % cells).to(tl.int64)
    row = cell * KVH + tl.maximum(kh, 0)
    if Q8:  # neox only: each half is whole 32-element blocks
        _q8_rows(kc8, kch, row * (D // 32), y1, BLOCK_H, HALF, km)
        _q8_rows(kc8, kch, row * (D // 32) + HALF // 32, y2, BLOCK_H, HALF, km)
    else:
        base = kc + row[:, None] * D
        tl.store(base + i1[None, :], y1.to(kc.dtype.element_ty), mask=km[:, None])
        tl.store(base + i2[None, :], y2.to(kc.dtype.element_ty), mask=km[:, None])


@triton.jit
def _rope_store_kernel(x_ptr, v_ptr, stride_t, stride_h, v_stride_t, v_stride_h, pos_ptr, kc,
                       kc8, kch, vc, vc8, vch, cells, n_q, KVH, log2_base, freq_scale, f_ptr,
                       mscale, wq_ptr, wk_ptr, eps, D: tl.constexpr, HALF: tl.constexpr,
                       NEOX: tl.constexpr, Q8: tl.constexpr, FREQS: tl.constexpr,
                       QK_NORM: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    # programs [0, NB) rotate q and k heads (k heads also go into the cache), the rest store
    # one value head each
    t = tl.program_id(0)
    hb = tl.program_id(1)
    nb = tl.cdiv(n_q + KVH, BLOCK_H)
    if hb < nb:
        rope_store_heads(x_ptr, pos_ptr, kc, kc8, kch, cells, n_q, KVH, stride_t, stride_h,
                         log2_base, freq_scale, f_ptr, mscale, wq_ptr, wk_ptr, eps, t,
                         hb * BLOCK_H, n_q + KVH, D, HALF, NEOX, BLOCK_H, Q8, FREQS, QK_NORM)
    else:
        _kv_store_one(v_ptr, pos_ptr, vc, vc8, vch, cells, KVH, v_stride_t, v_stride_h, t,
                      hb - nb, D, Q8)


def rope(x: torch.Tensor, positions: torch.Tensor, base: float, neox: bool,
         freq_scale: float = 1.0, use_pdl: bool = True, freqs: torch.Tensor | None = None,
         mscale: float = 1.0) -> torch.Tensor:
    """Rotate x [T, n_heads, head_dim] in place by positions [T] (int32, on x's device, so a
    captured decode graph reads the new position each step). ``use_pdl``: launch with PDL
    where the GPU has it (carve_kernels/pdl.py). ``freqs``: float32 [head_dim / 2], each pair's
    frequency (YaRN), in place of ``base`` and ``freq_scale``; cos and sin times ``mscale``."""
    t, nh, d = x.shape
    if x.stride(2) != 1:
        raise ValueError("rope needs the head dim contiguous")
    bh = min(16, triton.next_power_of_2(nh))
    grid = (t, triton.cdiv(nh, bh))
    _rope_kernel[grid](x, positions, freqs if freqs is not None else x, x.stride(0),
                       x.stride(1), nh, math.log2(base), freq_scale, float(mscale), D=d,
                       HALF=d // 2, NEOX=neox, BLOCK_H=bh, FREQS=freqs is not None,
                       num_warps=4, **pdl.opts(x, use_pdl))
    return x


def can_fuse_store(neox: bool, k_cache: torch.Tensor, head_dim: int) -> bool:
    """Whether rope_store handles this cache (q8_0 needs the neox halves as whole blocks)."""
    return k_cache.dtype != torch.uint8 or (neox and head_dim % 64 == 0)


def store_args(positions: torch.Tensor, base: float, neox: bool, freq_scale: float, n_q: int,
               n_kv: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
               cells: int, freqs: torch.Tensor | None = None, mscale: float = 1.0,
               qk_norm: tuple | None = None) -> tuple[tuple, dict]:
    """(arguments, constexprs) of decode's rotation and cache store (``rope_store_heads`` and
    ``_kv_store_one``): what ``rope_store`` and the q/k/v GEMV that rotates in its epilogue
    (carve_kernels/gemv_t3.py gemv_t3 ``rope=``) pass; arguments from ``pos_ptr`` to ``eps``,
    constexprs D, HALF, NEOX, Q8, FREQS, QK_NORM. Checked as ``rope_store`` documents."""
    d = head_dim
    if not can_fuse_store(neox, k_cache, d) or d & (d - 1):
        raise ValueError("rope_store needs a power-of-two head dim and an f16 or neox q8_0 "
                         "cache")
    wq, wk, eps = qk_norm if qk_norm is not None else (positions, positions, 0.0)
    if qk_norm is not None and (wq.numel() != d or wk.numel() != d):
        raise ValueError(f"rope_store's q/k norm weights must hold head_dim ({d}) values")
    args = (positions, *_views(k_cache), *_views(v_cache), cells, n_q, n_kv, math.log2(base),
            freq_scale, freqs if freqs is not None else positions, float(mscale), wq, wk,
            float(eps))
    meta = {"D": d, "HALF": d // 2, "NEOX": neox, "Q8": k_cache.dtype == torch.uint8,
            "FREQS": freqs is not None, "QK_NORM": qk_norm is not None}
    return args, meta


def no_store_args(like: torch.Tensor) -> tuple[tuple, dict]:
    """``store_args``' shape with placeholders (``like`` for every pointer), for a kernel that
    takes those arguments and leaves its rotation off."""
    args = (like,) * 7 + (1, 1, 1, 0.0, 0.0, like, 0.0, like, like, 0.0)
    meta = {"D": 1, "HALF": 1, "NEOX": False, "Q8": False, "FREQS": False, "QK_NORM": False}
    return args, meta


def rope_store(qk: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, base: float,
               neox: bool, freq_scale: float, n_q: int, k_cache: torch.Tensor,
               v_cache: torch.Tensor, cells: int, use_pdl: bool = True,
               freqs: torch.Tensor | None = None, mscale: float = 1.0,
               qk_norm: tuple | None = None) -> None:
    """Decode's rotation and cache store in one launch: qk [T, n_q + n_kv, head_dim] (q heads
    then k heads) rotated in place, the rotated keys and v [T, n_kv, head_dim] stored at cells
    positions % cells of the caches (as carve_kernels.kv_cache.kv_store lays them out). ``use_pdl``
    as in ``rope``. ``qk_norm``: (q_weight, k_weight, eps), the per-head RMSNorm of
    ``norm.rmsnorm_heads`` before the rotation, in the same launch."""
    t, nh, d = qk.shape
    kvh = nh - n_q
    if qk.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("rope_store needs contiguous head dims")
    args, meta = store_args(positions, base, neox, freq_scale, n_q, kvh, d, k_cache, v_cache,
                            cells, freqs, mscale, qk_norm)
    bh = min(16, triton.next_power_of_2(nh))
    grid = (t, triton.cdiv(nh, bh) + kvh)
    _rope_store_kernel[grid](qk, v, qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), *args,
                             **meta, BLOCK_H=bh, num_warps=4, **pdl.opts(k_cache, use_pdl))


def rope_ref(x: torch.Tensor, positions: torch.Tensor, base: float, neox: bool,
             freq_scale: float = 1.0, use_pdl: bool = True, freqs: torch.Tensor | None = None,
             mscale: float = 1.0) -> torch.Tensor:
    t, nh, d = x.shape
    i = torch.arange(d // 2, device=x.device, dtype=torch.float64)
    if freqs is None:
        inv = base ** (-2.0 * i / d)
        theta = (positions.to(torch.float64) * freq_scale)[:, None] * inv[None, :]  # [T, d/2]
    else:  # the angle as a float32 product, as the CPU engine's rope_angles forms it
        theta = (positions.float()[:, None] * freqs.float()[None, :]).to(torch.float64)
    cos, sin = torch.cos(theta)[:, None, :] * mscale, torch.sin(theta)[:, None, :] * mscale
    xf = x.to(torch.float64)
    if neox:
        x1, x2 = xf[..., : d // 2], xf[..., d // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).reshape(t, nh, d)
    return x.copy_(out.to(x.dtype))

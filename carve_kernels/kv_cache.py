"""Write new keys/values into the KV cache: f16 copy or q8_0 quantization (ggml's
``quantize_row_q8_0_ref``: d = amax/127, q = roundf(x/d)), at cell = position % cells so that a
sliding-window layer's min(ctx, window) cells form a ring.

A chunk of several rows stores only the rows that are their position's first occurrence and
among its last ``cells`` positions: a ring keeps one row a cell, and a chunk padded to a
graph's length (the padding repeats the last row's position) leaves nothing of its padding.

Cache layouts (the priced KV spans, docs/DESIGN.md): f16 ``[cells, n_kv_heads, head_dim]``;
q8_0 raw blocks ``[cells * n_kv_heads * head_dim // 32 * 34]`` uint8 in the same element order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import dequant as _dq
from carve_kernels import pdl, q8x
from spec import quant_types as qt


@triton.jit
def _kv_store_kernel(src_ptr, pos_ptr, c_ptr, c8_ptr, ch_ptr, src2_ptr, c2_ptr, c82_ptr, ch2_ptr,
                     cells, KVH, stride_t, stride_h, stride2_t, stride2_h,
                     D: tl.constexpr, Q8: tl.constexpr, CHUNK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.start(PDL)
    # program_id(2) picks the pair: 0 = keys, 1 = values (one launch stores both)
    t = tl.program_id(0)
    h = tl.program_id(1)
    if CHUNK:  # a row repeating the one before (padding), or older than the last `cells`
        p = tl.load(pos_ptr + t)
        last = tl.load(pos_ptr + tl.num_programs(0) - 1)
        before = tl.load(pos_ptr + tl.maximum(t - 1, 0))
        if (t > 0 and before == p) or p <= last - cells:
            return
    if tl.program_id(2) == 0:
        _kv_store_one(src_ptr, pos_ptr, c_ptr, c8_ptr, ch_ptr, cells, KVH, stride_t, stride_h,
                      t, h, D, Q8)
    else:
        _kv_store_one(src2_ptr, pos_ptr, c2_ptr, c82_ptr, ch2_ptr, cells, KVH, stride2_t,
                      stride2_h, t, h, D, Q8)


@triton.jit
def _kv_store_one(src_ptr, pos_ptr, c_ptr, c8_ptr, ch_ptr, cells, KVH, stride_t, stride_h, t, h,
                  D: tl.constexpr, Q8: tl.constexpr):
    cell = (tl.load(pos_ptr + t) % cells).to(tl.int64)
    src = src_ptr + t.to(tl.int64) * stride_t + h * stride_h
    if Q8:
        b = tl.arange(0, D // 32)
        j = tl.arange(0, 32)
        x = tl.load(src + b[:, None] * 32 + j[None, :]).to(tl.float32)  # [D/32, 32]
        d, q = q8x.quant32(x, 1)
        blk = (cell * KVH + h) * (D // 32) + b
        tl.store(ch_ptr + blk * 17, d.to(tl.float16))
        tl.store(c8_ptr + blk[:, None] * 34 + 2 + j[None, :], q.to(tl.int8))
    else:
        d = tl.arange(0, D)
        x = tl.load(src + d)
        tl.store(c_ptr + (cell * KVH + h) * D + d, x.to(c_ptr.dtype.element_ty))


@triton.jit
def _q8_roundtrip_kernel(x_ptr, stride_t, stride_h, D: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.start(PDL)
    # x[t, h, :] := its q8_0 blocks dequantized (kv_store's quantization, d through f16)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    b = tl.arange(0, D // 32)
    j = tl.arange(0, 32)
    p = x_ptr + t * stride_t + h * stride_h + b[:, None] * 32 + j[None, :]
    d, q = q8x.quant32(tl.load(p).to(tl.float32), 1)  # as kv_store
    dh = d.to(tl.float16).to(tl.float32)
    tl.store(p, (q * dh[:, None]).to(x_ptr.dtype.element_ty))


def q8_roundtrip_(x: torch.Tensor, use_pdl: bool = True) -> torch.Tensor:
    """x [T, heads, head_dim] in place: the values a q8_0 cache gives back for it (a prefill
    chunk attends its own keys as the cache holds them, like the CPU engine and llama.cpp).
    ``use_pdl``: launch with PDL where the GPU has it (carve_kernels/pdl.py)."""
    t, h, d = x.shape
    if x.stride(2) != 1 or d % 32:
        raise ValueError("q8_roundtrip_ needs contiguous head dims of whole 32-value blocks")
    _q8_roundtrip_kernel[(t, h)](x, x.stride(0), x.stride(1), D=d,
                                 num_warps=1 if d <= 128 else 2,
                                 **pdl.opts(x, use_pdl))
    return x


def q8_roundtrip_ref(x: torch.Tensor) -> torch.Tensor:
    t, h, d = x.shape
    cache = torch.zeros(t * h * d // 32 * 34, dtype=torch.uint8, device=x.device)
    kv_store_ref(x, cache, torch.arange(t, device=x.device), t)
    return x.copy_(kv_load_ref(cache, t, h, d).to(x.dtype))


def _views(cache: torch.Tensor):
    q8 = cache.dtype == torch.uint8
    return (cache, cache.view(torch.int8) if q8 else cache,
            cache.view(torch.float16) if q8 else cache)


def kv_store(src: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, cells: int,
             src2: torch.Tensor | None = None, cache2: torch.Tensor | None = None,
             use_pdl: bool = True) -> None:
    """Store src [T, n_kv_heads, head_dim] at cells positions % cells of ``cache`` (f16
    [cells, n_kv_heads, head_dim], or uint8 q8_0 blocks); with src2/cache2 (the values) too,
    in the same launch. Of T > 1 rows only each position's first row among the last ``cells``
    positions (``positions`` non-decreasing: a padded chunk repeats its last one). ``use_pdl``
    as in ``q8_roundtrip_``."""
    t, kvh, d = src.shape
    q8 = cache.dtype == torch.uint8
    pair = src2 is not None
    s2 = src2 if pair else src
    c2 = cache2 if pair else cache
    _kv_store_kernel[(t, kvh, 2 if pair else 1)](
        src, positions, *_views(cache), s2, *_views(c2), cells, kvh, src.stride(0),
        src.stride(1), s2.stride(0), s2.stride(1), D=d, Q8=q8, CHUNK=t > 1,
        num_warps=1 if d <= 128 else 2, **pdl.opts(cache, use_pdl))


def kv_store_ref(src: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, cells: int,
                 src2: torch.Tensor | None = None, cache2: torch.Tensor | None = None) -> None:
    if src2 is not None:
        kv_store_ref(src2, cache2, positions, cells)
    pos = positions.long()
    keep = pos > pos[-1] - cells
    keep[1:] &= pos[1:] != pos[:-1]  # a row repeating the one before: padding
    src, pos = src[keep], pos[keep]
    t, kvh, d = src.shape
    cell = pos % cells
    if cache.dtype != torch.uint8:
        cache.view(cells, kvh, d)[cell] = src.to(cache.dtype)
        return
    x = src.to(torch.float32).reshape(t, kvh * d // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    dd = amax / 127.0
    inv = torch.where(dd > 0, 1.0 / dd, torch.zeros_like(dd))
    q = torch.round(x * inv)  # ties: torch rounds half to even, ggml away from zero
    y = x * inv
    q = torch.where((y - torch.trunc(y)).abs() == 0.5, torch.trunc(y) + torch.sign(y), q)
    blocks = torch.empty(t, kvh * d // 32, 34, dtype=torch.uint8, device=cache.device)
    blocks[..., :2] = dd.to(torch.float16).view(torch.uint8)
    blocks[..., 2:] = q.to(torch.int8).view(torch.uint8)
    cache.view(cells, kvh * d // 32 * 34)[cell] = blocks.view(t, -1)


def kv_load_ref(cache: torch.Tensor, cells: int, n_kv_heads: int, head_dim: int) -> torch.Tensor:
    """The whole cache as float32 [cells, n_kv_heads, head_dim] (reference only)."""
    if cache.dtype != torch.uint8:
        return cache.view(cells, n_kv_heads, head_dim).to(torch.float32)
    n = cells * n_kv_heads * head_dim
    # carve_kernels.dequant allocates its scratch on the CPU, so the reference runs there
    y = _dq.dequantize_to(cache.reshape(-1).cpu(), qt.Q8_0, (n,), torch.float32)
    return y.to(cache.device).view(cells, n_kv_heads, head_dim)

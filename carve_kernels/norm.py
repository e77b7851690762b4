"""RMSNorm with the residual add fused: one read of x and the residual, one write of each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace


def row_warps(block: int) -> int:
    # warps of a row's program: 16 from 4096 values (padded), 8 from 2048, else 4. H200 tg128,
    # one call each (2026-12-04): Qwen3-30B-A3B (2048) 415.4-415.6 against 412.5-412.6 t/s
    # with 4 (397 with 2), Qwen2-7B (3584) 457.0 against 456.2 with 8 (450.8 with 4),
    # Qwen2-0.5B (896) level at 8 (1,235.0 against 1,236.1-1,236.5), so it keeps 4
    return 16 if block >= 4096 else 8 if block >= 2048 else 4


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, q_ptr, d_ptr, s_ptr, H, eps, stride_x,
                    stride_r, stride_y, trace_ptr, HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
                    Q8: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < H
    # the norm's weights are no kernel's output: read them while the one before finishes
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    trace.wait(trace_ptr, PDL, TRACE)
    h = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        # the norm reads the stream as stored (bf16 rounds here): a stage boundary, where the
        # next stage's first norm reads the stored stream, then changes no bit
        h = h.to(res_ptr.dtype.element_ty)
        tl.store(res_ptr + row * stride_r + c, h, mask=mask)
        h = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    y = h * inv * w
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(y_ptr + row * stride_y + c, y.to(y_ptr.dtype.element_ty), mask=mask)
    if Q8:  # one row: its int8 copy for the dp4a GEMVs (carve_kernels/q8x.py)
        q8x.store_q8(y, 0, H, q_ptr, d_ptr, s_ptr, BLOCK)
    trace.stamp(trace_ptr, 3, TRACE)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
            q8=None, use_pdl: bool = True) -> torch.Tensor:
    """y = rmsnorm(x + residual) * weight over the last dim. With ``residual`` [T, H] the sum
    x + residual is also written back into ``residual`` (the residual stream moves on), and y
    is the norm of the sum as written there (rounded to residual's dtype), so that a norm
    reading a stored stream (a stage's first) gives the bits a fused one does.
    ``q8``: (q, d, s) buffers (carve_kernels/q8x.py) that also get y's int8 copy (one row, H a
    multiple of 32). ``use_pdl``: launch with PDL where the GPU has it (carve_kernels/pdl.py)."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    y = torch.empty_like(x2) if out is None else out.view(-1, h)
    r = residual.view(-1, h) if residual is not None else x2
    block = triton.next_power_of_2(h)
    if q8 is not None and (x2.shape[0] != 1 or h % 32 or not q8x.fits(q8, h)):
        raise ValueError(f"no int8 copy of {x2.shape[0]} rows of {h} in these buffers")
    q, d, s = q8 if q8 is not None else (y, y, y)
    _rmsnorm_kernel[(x2.shape[0],)](x2, r, weight, y, q, d, s, h, eps, x2.stride(0),
                                   r.stride(0), y.stride(0),
                                   **trace.args("rmsnorm", (x2.shape[0],), y),
                                   HAS_RES=residual is not None,
                                   BLOCK=block, Q8=q8 is not None,
                                   num_warps=row_warps(block),
                                   **pdl.opts(y, use_pdl))
    return y.view(x.shape) if out is None else out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    h = x.to(torch.float32)
    if residual is not None:
        residual.copy_(h + residual.to(torch.float32))
        h = residual.to(torch.float32)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)
    y = y.to(x.dtype)
    return y if out is None else out.copy_(y)


@triton.jit
def _post_rmsnorm_kernel(x_ptr, res_ptr, wp_ptr, w_ptr, y_ptr, H, eps, stride_x, stride_r,
                         stride_y, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < H
    wp = tl.load(wp_ptr + c, mask=mask, other=0.0).to(tl.float32)  # weights: before the wait
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    pdl.start(PDL)
    x = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    # the sub-layer output's own norm stays in float32 on its way into the residual
    h = x / tl.sqrt(tl.sum(x * x, axis=0) / H + eps) * wp
    h += tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
    h = h.to(res_ptr.dtype.element_ty)  # the stream as stored, as in _rmsnorm_kernel
    tl.store(res_ptr + row * stride_r + c, h, mask=mask)
    h = h.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    tl.store(y_ptr + row * stride_y + c, (h * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm_post(x: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor, out: torch.Tensor, use_pdl: bool = True) -> torch.Tensor:
    """Gemma's sandwich norm and the next pre-norm in one launch: residual += rmsnorm(x) *
    post_weight, then out = rmsnorm(residual) * weight. x, residual, out [T, H]. ``use_pdl``
    as in ``rmsnorm``."""
    h = x.shape[-1]
    x2, r, y = x.view(-1, h), residual.view(-1, h), out.view(-1, h)
    block = triton.next_power_of_2(h)
    _post_rmsnorm_kernel[(x2.shape[0],)](x2, r, post_weight, weight, y, h, eps, x2.stride(0),
                                        r.stride(0), y.stride(0), BLOCK=block,
                                        num_warps=row_warps(block),
                                        **pdl.opts(y, use_pdl))
    return out


def rmsnorm_post_ref(x: torch.Tensor, post_weight: torch.Tensor, weight: torch.Tensor,
                     eps: float, residual: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    xf = x.to(torch.float32)
    h = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * post_weight.float()
    return rmsnorm_ref(h, weight, eps, residual, out)


@triton.jit
def _heads_kernel(x_ptr, wq_ptr, wk_ptr, n_q, n_heads, eps, stride_t, stride_h,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                  PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (heads < n_heads)[:, None] & (d < D)[None, :]
    ptr = x_ptr + t * stride_t + heads[:, None] * stride_h + d[None, :]
    x = tl.load(ptr, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    wq = tl.load(wq_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    wk = tl.load(wk_ptr + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    w = tl.where((heads < n_q)[:, None], wq, wk)
    tl.store(ptr, (x * inv[:, None] * w).to(x_ptr.dtype.element_ty), mask=m)


def rmsnorm_heads(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor, n_q: int,
                  eps: float, use_pdl: bool = True) -> torch.Tensor:
    """Per-head RMSNorm in place (qwen3/gemma3 q/k norm): x [T, n_heads, head_dim] with the
    first ``n_q`` heads normed by q_weight [head_dim], the rest by k_weight; one launch.
    ``use_pdl`` as in ``rmsnorm``."""
    t, nh, d = x.shape
    if x.stride(2) != 1:
        raise ValueError("rmsnorm_heads needs the head dim contiguous")
    bh = min(16, triton.next_power_of_2(nh))
    _heads_kernel[(t, triton.cdiv(nh, bh))](x, q_weight, k_weight, n_q, nh, eps, x.stride(0),
                                            x.stride(1), D=d, BLOCK_D=triton.next_power_of_2(d),
                                            BLOCK_H=bh, num_warps=4, **pdl.opts(x, use_pdl))
    return x


def rmsnorm_heads_ref(x: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                      n_q: int, eps: float) -> torch.Tensor:
    xf = x.to(torch.float32)
    w = torch.cat([q_weight.float().expand(n_q, -1),
                   k_weight.float().expand(x.shape[1] - n_q, -1)])
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w
    return x.copy_(y.to(x.dtype))

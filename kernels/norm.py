"""RMSNorm with the residual add fused: one read of x and the residual, one write of each."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, H, eps, stride_x, stride_r, stride_y,
                    HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, BLOCK)
    mask = c < H
    h = tl.load(x_ptr + row * stride_x + c, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        h += tl.load(res_ptr + row * stride_r + c, mask=mask, other=0.0).to(tl.float32)
        tl.store(res_ptr + row * stride_r + c, h.to(res_ptr.dtype.element_ty), mask=mask)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    w = tl.load(w_ptr + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, (h * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """y = rmsnorm(x + residual) * weight over the last dim. With ``residual`` [T, H] the sum
    x + residual is also written back into ``residual`` (the residual stream moves on)."""
    h = x.shape[-1]
    x2 = x.reshape(-1, h)
    y = torch.empty_like(x2) if out is None else out.view(-1, h)
    r = residual.view(-1, h) if residual is not None else x2
    block = triton.next_power_of_2(h)
    _rmsnorm_kernel[(x2.shape[0],)](x2, r, weight, y, h, eps, x2.stride(0), r.stride(0),
                                   y.stride(0), HAS_RES=residual is not None, BLOCK=block,
                                   num_warps=8 if block >= 4096 else 4)
    return y.view(x.shape) if out is None else out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    h = x.to(torch.float32)
    if residual is not None:
        h = h + residual.to(torch.float32)
        residual.copy_(h)
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)
    y = y.to(x.dtype)
    return y if out is None else out.copy_(y)

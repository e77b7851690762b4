"""Gated linear units of the FFN: SwiGLU (silu(gate) * up) and GeGLU (gelu_tanh(gate) * up)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl


@triton.jit
def glu_act(g, u, GELU: tl.constexpr):
    """act(g) * u in float32: SiLU, or GELU in ggml's tanh form (tanh(z) = 2 sigmoid(2z) - 1)."""
    if GELU:
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g * tl.sigmoid(2.0 * z)
    else:
        a = g * tl.sigmoid(g)
    return a * u


@triton.jit
def _glu_kernel(g_ptr, u_ptr, y_ptr, n, F, stride_g, stride_u, stride_y,
                GELU: tl.constexpr, BLOCK: tl.constexpr,
                PDL: tl.constexpr):
    pdl.start(PDL)
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = c < F
    g = tl.load(g_ptr + row * stride_g + c, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + c, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + c, glu_act(g, u, GELU).to(y_ptr.dtype.element_ty),
             mask=mask)


def glu(gate: torch.Tensor, up: torch.Tensor, act: str = "silu",
        out: torch.Tensor | None = None, use_pdl: bool = True) -> torch.Tensor:
    """act(gate) * up for gate, up [T, F] (rows may be views of a fused [T, 2F] tensor).
    ``use_pdl``: launch with PDL where the GPU has it (carve_kernels/pdl.py)."""
    f = gate.shape[-1]
    g2, u2 = gate.reshape(-1, f), up.reshape(-1, f)
    y = torch.empty(g2.shape, dtype=gate.dtype, device=gate.device) if out is None \
        else out.view(-1, f)
    block = min(4096, triton.next_power_of_2(f))
    grid = (g2.shape[0], triton.cdiv(f, block))
    _glu_kernel[grid](g2, u2, y, g2.shape[0], f, g2.stride(0), u2.stride(0), y.stride(0),
                      GELU=act == "gelu", BLOCK=block, num_warps=4,
                      **pdl.opts(y, use_pdl))
    return y.view(gate.shape) if out is None else out


def glu_ref(gate: torch.Tensor, up: torch.Tensor, act: str = "silu",
            out: torch.Tensor | None = None) -> torch.Tensor:
    """In float32, or float64 for float64 inputs: torch's tanh GELU in float32 cancels in
    1 + tanh(z) far down the negative tail (8 % off at gate -4.8, where the kernel's sigmoid
    form is right), so references for the tail take float64."""
    wide = torch.promote_types(gate.dtype, torch.float32)
    g = gate.to(wide)
    a = torch.nn.functional.gelu(g, approximate="tanh") if act == "gelu" \
        else torch.nn.functional.silu(g)
    y = (a * up.to(wide)).to(gate.dtype)
    return y if out is None else out.copy_(y)

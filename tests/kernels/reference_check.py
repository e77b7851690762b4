"""The one error check of the kernel tests: a kernel's output against its ``*_ref`` twin.

    nerr(y, ref, scale=None) -> float   # ||y - ref|| / ||scale|| (scale defaults to ref)
    gemv_scale(w, ggml_type, x, bias)   # |x| @ |W|^T (+ |bias|): the magnitudes a GEMV sums
    glu_scale(gate, up, act, sg, su)    # the same carried through the GLU epilogue
    generator(seed)                     # the inputs' generator, from the `seed` fixture
    poison(shape, dtype)                # NaN outputs: an element the kernel skips fails

A kernel that sums products and its reference add the same float32 terms in different orders:
their difference is bounded by the terms' magnitudes, not by the result, which can cancel to
~1e-3 of them in an output of a few rows (measured 1.1e-5 against the result itself in CI). So
every output that is such a sum is measured against ``gemv_scale``; elementwise outputs
(norms, rotations, dequantized weights) and attention's weighted averages against the result.
"""

from __future__ import annotations

import torch

from carve_kernels import glu, quant_matmul

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def generator(seed: int) -> torch.Generator:
    """Fresh inputs each run, replayable: the seed comes from the `seed` fixture
    (tests/conftest.py), which prints it when the test fails."""
    return torch.Generator(device=DEVICE).manual_seed(seed)


def poison(shape, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def q8_bufs(k: int):
    """Poisoned (q words, d, s) for the int8 copy (carve_kernels/q8x.py) of a row of k values."""
    q = torch.full((k // 4,), -1, dtype=torch.int32, device=DEVICE)
    ds = torch.full((2, k // 32), float("nan"), device=DEVICE)
    return q, ds[0], ds[1]


def nerr(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """||y - ref|| over ||scale|| (default ||ref||), in float64. A scale under 1e-20 counts as
    1e-20: an output that underflows in float64 (gelu of a gate near -10 is exactly 0 there,
    ~1e-33 in a kernel's float32) has no error budget worth measuring against."""
    assert torch.isfinite(y).all(), "kernel left non-finite values (unwritten or NaN)"
    ref = ref.double()
    den = (ref if scale is None else scale.double()).norm()
    return float((y.double() - ref).norm() / den.clamp_min(1e-20))


def gemv_scale(
    w: torch.Tensor, ggml_type: int, x: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """[m, rows]: the sum of the magnitudes of the products each output of x @ W^T (+ bias) adds
    up. ``w`` is the GGUF bytes, ``x`` what the reference multiplies (for an int8 x, the row
    q8x.copy_ref says it stands for)."""
    wf = quant_matmul.dequantize_ref(w, ggml_type, torch.float32).double()  # [rows, cols]
    mag = x.double().reshape(-1, wf.shape[1]).abs() @ wf.abs().T
    return mag if bias is None else mag + bias.double().abs()


def glu_scale(
    gate: torch.Tensor, up: torch.Tensor, act: str, gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
) -> torch.Tensor:
    """The bound on act(gate) * up that errors bounded by ``gate_scale`` and ``up_scale`` in its
    inputs carry to first order: |d out/d gate| * gate_scale + |d out/d up| * up_scale, the
    derivatives taken through glu.glu_ref at the reference gate and up."""
    g = gate.detach().double().requires_grad_()
    u = up.detach().double().requires_grad_()
    dg, du = torch.autograd.grad(glu.glu_ref(g, u, act).sum(), (g, u))
    return dg.abs() * gate_scale.double() + du.abs() * up_scale.double()

"""Comparing the Triton runner with the CPU engine (tests/engine/test_gpu_*.py)."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest absolute difference over the reference's largest magnitude."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def decode_errors(g, c, toks: list[int]) -> tuple[list[float], torch.Tensor]:
    """Decode ``toks`` after what both sessions hold: the relative error of each step, and the
    runner's last logits row."""
    errs = []
    for tok in toks:
        dg = g.forward([tok], g.kv.n_past, "last")
        dc = c.forward([tok], c.kv.n_past, "last")
        g.kv.n_past += 1
        c.kv.n_past += 1
        errs.append(rel(dg[-1], dc[-1]))
    return errs, dg[-1].clone()

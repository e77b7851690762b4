"""Each op of engine/runtime/models/ops.py against a slow, obvious float64 reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from engine.runtime.kv_cache import _mask
from engine.runtime.models import ops
from engine.runtime.models.layers import inv_freq, rope_angles
from engine.runtime.models.ops import (
    QWeight,
    add_rmsnorm,
    attention,
    embed,
    glu,
    linear,
    rmsnorm,
    rope,
)
from spec import quant_types as qt

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def _rng(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_rmsnorm_matches_definition() -> None:
    g = _rng(0)
    x = torch.randn(5, 64, generator=g) * 3
    w = torch.randn(64, generator=g)
    ref = x.double() / torch.sqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    torch.testing.assert_close(rmsnorm(x, w, 1e-6).double(), ref, rtol=1e-5, atol=1e-5)
    y, s = add_rmsnorm(x, 2 * x, w, 1e-6)
    torch.testing.assert_close(s, 3 * x)
    torch.testing.assert_close(y, rmsnorm(3 * x, w, 1e-6))


def _rope_ref(x: torch.Tensor, pos: list[int], base: float, style: str) -> torch.Tensor:
    """Rotate pair by pair with python floats: the definition, not a vectorised rewrite."""
    _t, h, d = x.shape
    out = x.double().clone()
    for ti, p in enumerate(pos):
        for hi in range(h):
            for i in range(d // 2):
                theta = p * base ** (-2 * i / d)
                a, b = (2 * i, 2 * i + 1) if style == "normal" else (i, i + d // 2)
                xa, xb = float(x[ti, hi, a]), float(x[ti, hi, b])
                out[ti, hi, a] = xa * math.cos(theta) - xb * math.sin(theta)
                out[ti, hi, b] = xb * math.cos(theta) + xa * math.sin(theta)
    return out


@pytest.mark.parametrize("style", ["normal", "neox"])
def test_rope_both_styles(style: str) -> None:
    x = torch.randn(3, 2, 16, generator=_rng(1))
    pos = [0, 7, 1000]
    cos, sin = rope_angles(torch.tensor(pos), inv_freq(16, 10000.0, 1.0, None))
    got = rope(x, cos, sin, style)
    torch.testing.assert_close(got.double(), _rope_ref(x, pos, 10000.0, style), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, x)  # position 7 and 1000 rotate


def test_rope_normal_is_neox_on_interleaved_rows() -> None:
    """llama.cpp's converter permutes q/k rows so that "normal" on the file's layout equals
    "neox" on the original: rotating adjacent pairs == rotating halves after de-interleaving."""
    x = torch.randn(4, 3, 8, generator=_rng(2))
    cos, sin = rope_angles(torch.arange(4) * 5, inv_freq(8, 500.0, 1.0, None))
    perm = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])  # interleaved -> halves
    torch.testing.assert_close(rope(x, cos, sin, "normal")[..., perm], rope(x[..., perm], cos, sin, "neox"))


def test_linear_rope_scale_divides_frequencies() -> None:
    torch.testing.assert_close(inv_freq(8, 1e4, 4.0, None) * 4, inv_freq(8, 1e4, 1.0, None))


def _attention_ref(q, k, v, q_pos, k_pos, scale, window):
    t, h, _d = q.shape
    kvh = k.shape[1]
    out = torch.zeros(t, h, v.shape[-1], dtype=torch.float64)
    for ti in range(t):
        for hi in range(h):
            kh = hi // (h // kvh)  # GQA: consecutive query heads share a KV head
            scores, vals = [], []
            for si in range(k.shape[0]):
                dist = q_pos[ti] - k_pos[si]
                if dist < 0 or (window and dist >= window):
                    continue
                scores.append(float(q[ti, hi].double() @ k[si, kh].double()) * scale)
                vals.append(v[si, kh].double())
            p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
            out[ti, hi] = sum(pi * vi for pi, vi in zip(p, vals))
    return out.reshape(t, -1)


@pytest.mark.parametrize("window", [0, 3])
def test_attention_gqa_causal_and_window(window: int) -> None:
    g = _rng(3)
    t, s, h, kvh, d = 4, 9, 6, 2, 8
    q = torch.randn(t, h, d, generator=g)
    k, v = torch.randn(s, kvh, d, generator=g), torch.randn(s, kvh, d, generator=g)
    q_pos, k_pos = torch.arange(5, 9), torch.arange(0, 9)
    got = attention(q, k, v, _mask(q_pos, k_pos, window), 0.3)
    ref = _attention_ref(q, k, v, q_pos.tolist(), k_pos.tolist(), 0.3, window)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_glu_activations() -> None:
    g, u = torch.randn(3, 10, generator=_rng(4)), torch.randn(3, 10, generator=_rng(5))
    gd = g.double()
    silu = gd / (1 + torch.exp(-gd)) * u.double()
    gelu = 0.5 * gd * (1 + torch.tanh(math.sqrt(2 / math.pi) * (gd + 0.044715 * gd**3))) * u.double()
    torch.testing.assert_close(glu(g, u, "silu").double(), silu, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(glu(g, u, "gelu").double(), gelu, rtol=1e-5, atol=1e-6)


def _q8_0_matrix(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Random well-formed Q8_0 blocks: f16 scale then 32 int8."""
    rng = np.random.default_rng(seed)
    nb = rows * cols // 32
    blocks = np.zeros((nb, 34), dtype=np.uint8)
    blocks[:, :2] = (rng.random(nb, dtype=np.float32) * 0.01 + 1e-3).astype(np.float16).view(np.uint8).reshape(nb, 2)
    blocks[:, 2:] = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    return torch.from_numpy(blocks.reshape(-1))


@pytest.mark.parametrize("scratch_rows", [None, 3, 64])
def test_linear_uncached_matches_gguf_dequantize(scratch_rows: int | None) -> None:
    rows, cols = 40, 64
    raw = _q8_0_matrix(rows, cols, 6)
    scratch = None if scratch_rows is None else torch.empty(scratch_rows * cols)
    w = QWeight("m", raw, qt.Q8_0, rows, cols, None, scratch)
    x = torch.randn(5, cols, generator=_rng(7))
    ref_w = torch.from_numpy(gguf_dequantize(raw.numpy(), qt.Q8_0).reshape(rows, cols))
    torch.testing.assert_close(linear(x, w), x @ ref_w.T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("block_rows", [None, 7])  # 7: five blocks of rows and a short one
def test_linear_cached_bf16_multiplies_in_float32(
    t: int, block_rows: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows, cols = 40, 64
    raw = _q8_0_matrix(rows, cols, 8)
    ref_w = torch.from_numpy(gguf_dequantize(raw.numpy(), qt.Q8_0).reshape(rows, cols))
    w = QWeight("m", raw, qt.Q8_0, rows, cols, ref_w.to(torch.bfloat16))
    if block_rows is not None:
        monkeypatch.setattr(ops, "CPU_BLOCK", block_rows * cols)
    x = torch.randn(t, cols, generator=_rng(9))
    y = linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (t, rows)
    # only the cache's copy is bf16: the input and the sums stay float32 on the CPU
    want = x.double() @ ref_w.to(torch.bfloat16).double().T
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)


def test_embed_dequantizes_only_the_rows_asked() -> None:
    rows, cols = 50, 64
    raw = _q8_0_matrix(rows, cols, 10)
    ref_w = torch.from_numpy(gguf_dequantize(raw.numpy(), qt.Q8_0).reshape(rows, cols))
    ids = torch.tensor([3, 3, 49, 0])
    torch.testing.assert_close(embed(ids, QWeight("e", raw, qt.Q8_0, rows, cols)), ref_w[ids])

"""The CPU's native expert kernel (engine/hardware/native_experts.c): a row's routed experts
from the file's blocks, against gguf's own dequantizer in float64."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from carve_kernels.random_blocks import random_weight
from engine.hardware import native
from engine.runtime.models import cpu_native
from spec import quant_types as qt

LIB = cpu_native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the native kernel")

N_EXPERT, N_EMBD, N_FF = 6, 512, 256


def _experts(t: int, rows: int, cols: int, g: torch.Generator, scale: float = 0.02):
    w = random_weight(t, N_EXPERT * rows, cols, generator=g, scale=scale)
    ref = dequantize(w.numpy(), GGMLQuantizationType(t)).reshape(N_EXPERT, rows, cols)
    return w, torch.from_numpy(np.ascontiguousarray(ref)).double()


def _q8(v: torch.Tensor, group: int) -> torch.Tensor:
    """v rounded as the kernel quantizes it: int8 per ``group`` values, scale max |v| / 127."""
    g = v.view(-1, group)
    d = g.abs().amax(1, keepdim=True) / 127
    return (torch.round(g / d) * d).view(-1)


def _reference(mats, x, ids, w, act, limit=0.0, biases=None, group=0):
    """In float64 from gguf's dequantized values: SiLU / GELU GLUs, or gpt-oss's (the gate
    clamped above, up both ways, gate * sigmoid(1.702 gate) * (up + 1)) with its biases.
    ``group``: x and the GLU's output rounded to int8 per that many values first, the
    kernel's scheme (llama.cpp's q8_K / q8_0), so that only the sums' order differs."""
    gr, ur, dr = mats
    y = torch.zeros(dr.shape[1], dtype=torch.float64)
    x = _q8(x.double(), group) if group else x
    for j, e in enumerate(ids.tolist()):
        a, u = gr[e] @ x.double(), ur[e] @ x.double()
        if biases is not None:
            a, u = a + biases[0][e].double(), u + biases[1][e].double()
        if limit:
            a, u = a.clamp(max=limit), u.clamp(-limit, limit) + 1
            h = a * torch.sigmoid(1.702 * a) * u
        elif act == "silu":
            h = torch.nn.functional.silu(a) * u
        else:
            h = torch.nn.functional.gelu(a, approximate="tanh") * u
        out = dr[e] @ (_q8(h, group) if group else h)
        y += float(w[j]) * (out if biases is None else out + biases[2][e].double())
    return y


@pytest.mark.parametrize("types", [(qt.Q4_K, qt.Q4_K, qt.Q6_K), (qt.Q4_K, qt.Q4_K, qt.Q4_K),
                                   (qt.Q5_K, qt.Q8_0, qt.Q5_K), (qt.Q6_K, qt.Q6_K, qt.Q8_0),
                                   (qt.Q2_K, qt.Q2_K, qt.Q3_K), (qt.Q3_K, qt.Q3_K, qt.Q4_K),
                                   (qt.IQ4_XS, qt.IQ4_XS, qt.Q6_K), (qt.IQ4_NL, qt.Q4_K, qt.IQ4_XS),
                                   (qt.IQ2_XXS, qt.IQ2_XXS, qt.IQ3_XXS),
                                   (qt.IQ3_XXS, qt.IQ3_XXS, qt.Q4_K),
                                   (qt.IQ2_XS, qt.IQ2_XS, qt.IQ3_S), (qt.IQ2_S, qt.IQ2_S, qt.Q3_K),
                                   (qt.IQ3_S, qt.IQ3_S, qt.IQ4_XS),
                                   (qt.IQ1_S, qt.IQ1_S, qt.IQ1_M), (qt.IQ1_M, qt.IQ1_M, qt.IQ2_XXS),
                                   (qt.Q4_0, qt.Q5_1, qt.Q6_K)])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_matches_gguf_dequantize(types, act):
    g = torch.Generator().manual_seed(sum(types) + len(act))
    made = [_experts(types[0], N_FF, N_EMBD, g), _experts(types[1], N_FF, N_EMBD, g),
            _experts(types[2], N_EMBD, N_FF, g)]
    ne = cpu_native.NativeExperts(LIB, [m[0] for m in made], types, N_EMBD, N_FF, N_EXPERT, 4,
                                  act)
    refs = [m[1] for m in made]
    for ids in ([3], [5, 0, 2], [1, 4, 0, 5]):
        x = torch.randn(N_EMBD, generator=g)
        idt = torch.tensor(ids, dtype=torch.int32)
        w = torch.rand(len(ids), generator=g)
        y = torch.full((N_EMBD,), float("nan"))
        ne.run(x, idt, w, y, threads=2)
        ref = _reference(refs, x, idt, w, act)
        # x and the GLU's output are quantized to int8 per 256 values, as llama.cpp's CPU does
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < 5e-2, (types, act, ids, err)
        # and against that scheme in float64: every block's bits read right
        scheme = _reference(refs, x, idt, w, act, group=native.group(types))
        assert float((y.double() - scheme).norm() / scheme.norm()) < 1e-5, (types, act, ids)
    # no experts: a zero sum
    y = torch.full((N_EMBD,), float("nan"))
    ne.run(x, torch.empty(0, dtype=torch.int32), torch.empty(0), y)
    assert bool((y == 0).all())


def test_refuses_bad_input():
    g = torch.Generator().manual_seed(0)
    mats = [random_weight(qt.Q4_K, N_EXPERT * N_FF, N_EMBD, generator=g),
            random_weight(qt.Q4_K, N_EXPERT * N_FF, N_EMBD, generator=g),
            random_weight(qt.Q4_K, N_EXPERT * N_EMBD, N_FF, generator=g)]
    ne = cpu_native.NativeExperts(LIB, mats, (qt.Q4_K,) * 3, N_EMBD, N_FF, N_EXPERT, 2, "silu")
    x, y = torch.randn(N_EMBD), torch.empty(N_EMBD)
    with pytest.raises(ValueError, match="beyond the layer's 6"):
        ne.run(x, torch.tensor([6], dtype=torch.int32), torch.ones(1), y)
    with pytest.raises(ValueError, match="at most k"):
        ne.run(x, torch.tensor([0, 1, 2], dtype=torch.int32), torch.ones(3), y)
    with pytest.raises(ValueError, match="not multiplied"):
        cpu_native.NativeExperts(LIB, mats, (34,) * 3, N_EMBD, N_FF, N_EXPERT, 2, "silu")
    assert not cpu_native.supported((qt.Q4_K,) * 3, "silu", 2880, N_FF)  # not whole 256s
    # Q8_0 and MXFP4 alone: x per 32; beside a K-quant per 256, whatever the block
    assert cpu_native.supported((qt.Q8_0,) * 3, "silu", 288, 2880)
    assert cpu_native.supported((qt.MXFP4,) * 3, "silu", 2880, 2880)
    assert not cpu_native.supported((qt.Q8_0, qt.Q8_0, qt.Q4_K), "silu", 288, N_FF)
    assert not cpu_native.supported((qt.MXFP4,) * 3, "silu", 2880, 2900)
    assert not cpu_native.supported((qt.MXFP4,) * 3, "relu", 2880, 2880)
    with pytest.raises(ValueError, match="biases are float32"):
        cpu_native.NativeExperts(LIB, mats, (qt.Q4_K,) * 3, N_EMBD, N_FF, N_EXPERT, 2, "silu",
                                 7.0, [torch.zeros(N_EXPERT, N_FF)] * 3)


@pytest.mark.parametrize("types", [(qt.MXFP4,) * 3, (qt.Q8_0,) * 3, (qt.Q8_0, qt.MXFP4, qt.Q8_0),
                                   (qt.IQ4_NL, qt.IQ4_NL, qt.Q8_0), (qt.Q4_0, qt.Q4_1, qt.Q5_0),
                                   (qt.Q5_1, qt.Q5_0, qt.Q4_0)])
@pytest.mark.parametrize("gpt_oss", [True, False])
def test_blocks_of_32_at_widths_of_32(types, gpt_oss):
    """gpt-oss's shape of experts (widths of 32s, not 256s: 2880 in the released models):
    MXFP4 / Q8_0 with x quantized per 32, gpt-oss's biases and clamped SwiGLU (a limit the
    products cross both ways), against gguf's dequantizer."""
    n_embd, n_ff = 320, 224
    g = torch.Generator().manual_seed(len(types) + gpt_oss)
    made = [_experts(types[0], n_ff, n_embd, g, 0.3), _experts(types[1], n_ff, n_embd, g, 0.3),
            _experts(types[2], n_embd, n_ff, g, 0.3)]
    limit = 1.5 if gpt_oss else 0.0
    biases = ([torch.randn(N_EXPERT, n, generator=g) * 0.5 for n in (n_ff, n_ff, n_embd)]
              if gpt_oss else None)
    ne = cpu_native.NativeExperts(LIB, [m[0] for m in made], types, n_embd, n_ff, N_EXPERT, 4,
                                  "silu", limit, biases)
    clamped = 0
    for ids in ([2], [5, 0, 3, 1]):
        x = torch.randn(n_embd, generator=g)
        idt = torch.tensor(ids, dtype=torch.int32)
        w = torch.rand(len(ids), generator=g)
        y = torch.full((n_embd,), float("nan"))
        ne.run(x, idt, w, y, threads=2)
        ref = _reference([m[1] for m in made], x, idt, w, "silu", limit, biases)
        err = float((y.double() - ref).norm() / ref.norm())
        assert err < 5e-2, (types, gpt_oss, ids, err)
        scheme = _reference([m[1] for m in made], x, idt, w, "silu", limit, biases, group=32)
        assert float((y.double() - scheme).norm() / scheme.norm()) < 1e-5, (types, ids)
        gate = made[0][1][ids[0]] @ x.double()
        clamped += int((gate.abs() > limit).sum())
    assert clamped > 0 or not gpt_oss  # the clamp took part


def test_build_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_native.build(tmp_path)


def test_prebuild_loads_the_library_once_in_the_background():
    """The window builds the kernel while it opens: afterwards `available` answers from the
    loaded library without building again, and the thread's library is the one it returns."""
    t = native.prebuild()
    t.join(timeout=120)
    assert not t.is_alive()
    hits = native._load_once.cache_info().hits
    assert native.available() and native.library() is LIB
    assert native._load_once.cache_info().hits > hits and native._load_once.cache_info().misses == 1

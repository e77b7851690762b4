"""The CPU's native expert kernel (engine/hardware/native_experts.c): a row's routed experts
from the file's blocks, against gguf's own dequantizer in float64."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from carve_kernels.random_blocks import random_weight
from engine.runtime.models import cpu_native
from spec import quant_types as qt

LIB = cpu_native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the native kernel")

N_EXPERT, N_EMBD, N_FF = 6, 512, 256


def _experts(t: int, rows: int, cols: int, g: torch.Generator):
    w = random_weight(t, N_EXPERT * rows, cols, generator=g)
    ref = dequantize(w.numpy(), GGMLQuantizationType(t)).reshape(N_EXPERT, rows, cols)
    return w, torch.from_numpy(np.ascontiguousarray(ref)).double()


def _reference(mats, x, ids, w, act):
    gr, ur, dr = mats
    y = torch.zeros(N_EMBD, dtype=torch.float64)
    for j, e in enumerate(ids.tolist()):
        a, u = gr[e] @ x.double(), ur[e] @ x.double()
        g = torch.nn.functional.silu(a) if act == "silu" else torch.nn.functional.gelu(
            a, approximate="tanh")
        y += float(w[j]) * (dr[e] @ (g * u))
    return y


@pytest.mark.parametrize("types", [(qt.Q4_K, qt.Q4_K, qt.Q6_K), (qt.Q4_K, qt.Q4_K, qt.Q4_K),
                                   (qt.Q5_K, qt.Q8_0, qt.Q5_K), (qt.Q6_K, qt.Q6_K, qt.Q8_0)])
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
        cpu_native.NativeExperts(LIB, mats, (qt.Q4_0,) * 3, N_EMBD, N_FF, N_EXPERT, 2, "silu")
    assert not cpu_native.supported((qt.Q4_K,) * 3, "silu", N_EMBD, N_FF, clamped=True)
    assert not cpu_native.supported((qt.Q4_K,) * 3, "silu", 2880, N_FF)  # not whole 256s
    # (Q8_0 too: x is quantized per 256, whatever the block)
    assert not cpu_native.supported((qt.Q8_0,) * 3, "silu", 288, N_FF)


def test_build_failure_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="no C compiler"):
        cpu_native.build(tmp_path)

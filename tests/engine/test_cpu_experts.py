"""Host experts in the CPU's layouts (engine/runtime/models/cpu_experts.py): the 4-bit values
and (scale, zero) pairs of Q4_0 / Q4_1 / Q4_K are the file's weights exactly (against
gguf.quants.dequantize), each expert's product in the int4 and bf16 layouts is x @ W.T within
bf16 rounding, the spans are the priced bytes, and a load from the file fills them and names a
damaged block."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from carve_kernels.random_blocks import random_weight
from engine.planning.host import cpu_bytes, cpu_layout
from engine.runtime.models import cpu_experts, ops
from engine.runtime.models.cpu_experts import PackedExperts, int4_parts, load_packed
from spec import quant_types as qt
from spec.errors import CarveError

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _experts(t: int, n: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([random_weight(t, rows, cols, generator=g).reshape(-1) for _ in range(n)])


def _reference(raw: torch.Tensor, t: int, n: int, rows: int, cols: int) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw.numpy(), GGMLQuantizationType(t))).float().view(
        n, rows, cols)


@pytest.mark.parametrize("t", [qt.Q4_0, qt.Q4_1, qt.Q4_K])
def test_int4_parts_are_the_files_weights(t: int) -> None:
    rows, cols = 48, 512
    raw = _experts(t, 1, rows, cols)
    q, scale, zero = int4_parts(raw, t, rows, cols)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    assert scale.shape == zero.shape == (rows, cols // 32)
    w = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    ref = _reference(raw, t, 1, rows, cols)[0]
    torch.testing.assert_close(w, ref, rtol=1e-6, atol=1e-7)


@pytest.fixture(params=[torch.bfloat16, torch.float16], ids=["bf16", "f16"])
def half(request, monkeypatch) -> torch.dtype:
    """The "half" layout's type, each of the two (the machine's own choice is timed)."""
    monkeypatch.setattr(cpu_experts, "_HALF", [request.param])
    return request.param


@pytest.mark.parametrize("t,layout", [(qt.Q4_0, "int4"), (qt.Q4_1, "int4"), (qt.Q4_K, "int4"),
                                      (qt.Q5_K, "half"), (qt.Q6_K, "half"), (qt.Q8_0, "half")])
def test_each_experts_product_in_its_cpu_layout(t: int, layout: str, half) -> None:
    n, rows, cols = 3, 64, 512
    raw = _experts(t, n, rows, cols, seed=t)
    assert cpu_layout(t, rows, cols) == layout
    nb = cpu_bytes("blk.0.ffn_up_exps.weight", t, (cols, rows, n), raw.numel())
    assert nb == n * rows * cols * (5 / 8 if layout == "int4" else 2)
    span = torch.full((nb,), 0xFF, dtype=torch.uint8)  # poisoned: every byte is written
    m = PackedExperts("blk.0.ffn_up_exps.weight", layout, n, rows, cols, span)
    if layout == "half":
        assert m.dense.dtype == half
    m.fill(raw[: raw.numel() // n], t, 0)  # one expert at a time, as a load's runs come
    m.fill(raw[raw.numel() // n:], t, 1)
    ref = _reference(raw, t, n, rows, cols)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1))
    for e in range(n):
        y, want = m.product(e, x), x @ ref[e].T
        assert y.dtype == torch.float32 and y.shape == (5, rows)
        # bf16 x, weights (bf16 layout) or scale/zero (int4), and result: ~3e-3 measured
        assert ((y - want).norm() / want.norm()).item() < 1e-2
    # the file layout's product (the CPU engine's, dequantized per expert) agrees with it
    q = ops.QExperts("w", raw, t, n, rows, cols)
    assert ((q.product(2, x) - m.product(2, x)).norm() / want.norm()).item() < 1e-2
    # a row far beyond f16's range, and one of zeros, come out right in either type
    big = torch.cat((x[:1] * 1e7, torch.zeros(1, cols)))
    y = m.product(1, big)
    assert torch.isfinite(y).all() and not y[1].any()
    ref = big[:1].double() @ ref[1].double().T
    assert ((y[:1].double() - ref).norm() / ref.norm()).item() < 1e-2


def test_an_f16_product_that_overflows_is_redone_in_float32(monkeypatch) -> None:
    monkeypatch.setattr(cpu_experts, "_HALF", [torch.float16])
    n, rows, cols = 1, 16, 256
    span = torch.empty(n * rows * cols * 2, dtype=torch.uint8)
    m = PackedExperts("blk.0.ffn_down_exps.weight", "half", n, rows, cols, span)
    m.dense[0] = 60000.0  # every weight near f16's largest: the scaled sums overflow anyway
    x = torch.ones(1, cols)
    assert torch.equal(m.product(0, x), torch.full((1, rows), 60000.0 * cols))


def test_half_dtype_is_timed_once_per_process(monkeypatch) -> None:
    monkeypatch.setattr(cpu_experts, "_HALF", [])
    first = cpu_experts.half_dtype()
    assert first in (torch.float16, torch.bfloat16)
    assert cpu_experts._HALF == [first] and cpu_experts.half_dtype() is first


def test_types_without_a_cpu_layout_keep_the_files_bytes() -> None:
    for t in (qt.Q2_K, qt.Q3_K, qt.IQ2_XXS, qt.IQ4_XS, qt.MXFP4):
        assert cpu_layout(t, 256, 256) == "file"
        assert cpu_bytes("blk.0.ffn_up_exps.weight", t, (256, 256, 4), 12345) == 12345
    # torch's int4 packer takes multiples of 16 rows; biases stay as they are
    assert cpu_layout(qt.Q4_K, 40, 256) == "file"
    assert cpu_bytes("blk.0.ffn_up_exps.bias", qt.F32, (256, 4), 4096) == 4096


class _File:
    """A model whose one expert tensor's bytes are ``raw`` (read_into as GGUFModel does)."""

    def __init__(self, name: str, t: int, shape: tuple[int, int, int], raw: torch.Tensor):
        self.raw = raw
        self.info = type("Info", (), {"name": name, "ggml_type": t, "shape": shape,
                                      "nbytes": raw.numel()})()

    def tensor(self, name: str):
        return self.info

    def read_into(self, info, start: int, out: memoryview) -> None:
        np.frombuffer(out, dtype=np.uint8)[:] = self.raw[start:start + out.nbytes].numpy()


def test_a_load_fills_the_layout_in_runs_and_checks_each_run() -> None:
    n, rows, cols, t = 11, 32, 256, qt.Q4_K  # 11 experts: runs of 8 and 3
    raw = _experts(t, n, rows, cols)
    name = "blk.3.ffn_gate_exps.weight"
    model = _File(name, t, (cols, rows, n), raw)
    span = torch.empty(cpu_bytes(name, t, (cols, rows, n), raw.numel()), dtype=torch.uint8)
    seen: list[int] = []
    assert load_packed(model, name, span, check=lambda part: seen.append(part.numel())) == \
        raw.numel()
    one = raw.numel() // n
    assert seen == [8 * one, 3 * one]
    m = PackedExperts(name, "int4", n, rows, cols, span)
    ref = _reference(raw, t, n, rows, cols)
    x = torch.randn(1, cols)
    assert ((m.product(10, x) - x @ ref[10].T).norm() / (x @ ref[10].T).norm()).item() < 1e-2

    def damaged(part: torch.Tensor) -> None:
        raise CarveError(f"{name}: damaged")

    with pytest.raises(CarveError, match="damaged"):
        load_packed(model, name, span, check=damaged)
    with pytest.raises(CarveError, match="load cancelled"):
        load_packed(model, name, span, cancelled=lambda: True)


def test_q4_1_is_packed_though_its_layout_is_the_files_size() -> None:
    """Q4_1's file bytes (20 per 32 values) equal its int4 layout's (16 + a 4-byte pair): what
    a span holds follows the plan's host_compute and the type, never the span's size."""
    from engine.runtime.gpu.host_arena import load_cpu_layouts

    n, rows, cols, t = 4, 32, 256, qt.Q4_1
    raw = _experts(t, n, rows, cols, seed=3)
    name = "blk.0.ffn_up_exps.weight"
    model = _File(name, t, (cols, rows, n), raw)
    assert cpu_bytes(name, t, (cols, rows, n), raw.numel()) == raw.numel()
    span = torch.zeros(raw.numel(), dtype=torch.uint8)
    assert load_cpu_layouts(model, [name], {name: span}, "gpu") == ([name], 0)
    assert load_cpu_layouts(model, [name], {name: span}, "both") == ([name], 0)
    assert not span.any()  # left for the plain loader
    assert load_cpu_layouts(model, [name], {name: span}, "cpu") == ([], raw.numel())
    assert not torch.equal(span, raw)  # packed, not the file's bytes
    m = PackedExperts(name, "int4", n, rows, cols, span)
    ref = _reference(raw, t, n, rows, cols)
    x = torch.randn(2, cols)
    assert ((m.product(3, x) - x @ ref[3].T).norm() / (x @ ref[3].T).norm()).item() < 1e-2


def test_weights_beyond_f16_are_a_load_error_naming_the_tensor(monkeypatch) -> None:
    monkeypatch.setattr(cpu_experts, "_HALF", [torch.float16])
    n, rows, cols, t = 2, 16, 256, qt.Q8_0
    raw = _experts(t, n, rows, cols, seed=5)
    one = raw.numel() // n
    raw[one:one + 2] = torch.tensor([1000.0], dtype=torch.float16).view(torch.uint8)
    raw[one + 2] = 127  # expert 1's first weight: 1000 * 127, beyond 65504
    span = torch.empty(n * rows * cols * 2, dtype=torch.uint8)
    m = PackedExperts("blk.2.ffn_down_exps.weight", "half", n, rows, cols, span)
    with pytest.raises(CarveError, match=r"^tensor blk.2.ffn_down_exps.weight: expert 1 has "
                       r"weights beyond f16's range \(65504\).*--host-compute gpu"):
        m.fill(raw, t, 0)
    monkeypatch.setattr(cpu_experts, "_HALF", [torch.bfloat16])  # bf16 holds them
    m = PackedExperts("blk.2.ffn_down_exps.weight", "half", n, rows, cols, span)
    m.fill(raw, t, 0)
    assert float(m.dense[1, 0, 0]) == 126976.0  # 127000 rounded to bf16

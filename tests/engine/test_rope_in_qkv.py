"""Decode's RoPE and KV-cache store in the epilogue of the q/k/v T GEMV (carve_kernels/gemv_t3.py
gemv_t3 ``rope=``, the default where its row tiles hold whole heads) against separate
launches, through a whole GPU stage whose every layer takes the path: decode logits (so greedy
ids) do not change by a bit. The kernel's own test (tests/kernels/test_gemv_t.py) covers rings,
tiles of two heads and splits. qwen2 (q/k/v biases, f16 cache), qwen3 (per-head q/k norms
inside the rotation, q8_0 cache), llama-3.1 (adjacent pairs, the frequencies of its RoPE
factors). Tiny synthetic files; under TRITON_INTERPRET=1 without a
GPU."""

from __future__ import annotations

import pytest
import torch

from carve_kernels import gemv_t3
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import KvType, Plan
from engine.runtime.gpu.session import GpuSession
from engine.synth.gen import write_model
from engine.synth.shapes import Shape

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
SHAPES = {  # rows of 256 (K-quant blocks); heads of 32 (qwen2, gemma3) or 64 (qwen3)
    "qwen2": Shape("qwen2", 2, 256, 8, 2, 512, 320, n_ctx=512),
    "qwen3": Shape("qwen3", 2, 256, 4, 2, 512, 320, head_dim=64, n_ctx=512),
    # llama-3.1's RoPE factors: a frequency per pair from buf.rope_freqs, adjacent pairs
    "llama3.1": Shape("llama", 2, 256, 8, 2, 512, 320, n_ctx=512,
                      llama3_rope=(8.0, 1.0, 4.0, 64)),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _decode(plan: Plan, fused: bool) -> list[torch.Tensor]:
    # decode logits of 4 steps after a 2-token prefill; every layer ``fused`` or none
    g = GpuSession.load(plan, devices=[DEV], remember=False)
    try:
        layers = g.pipe.stages[0].layers
        assert [la.attn.rope_in_qkv for la in layers] == [fused] * len(layers)
        g.forward([5, 77], 0, "last")  # prefill: the plain launches either way
        g.kv.n_past = 2
        logits = []
        for tok in (7, 150, 42, 299):
            logits.append(g.forward([tok], g.kv.n_past, "last")[-1].clone())
            g.kv.n_past += 1
        return logits
    finally:
        g.close()


def _plan(tmp_path, arch: str, kv: KvType) -> Plan:
    (path,) = write_model(tmp_path / f"{arch}.gguf", SHAPES[arch], "q4_k_m")
    # the dequant cache holds every matrix, so q, k and v go to the T layout
    return Plan(model=str(path), devices=(CPU,), split=(0, 2), ctx=64, kv_type=kv,
                prefill_chunk=8, cache_reserve=0)


@pytest.mark.parametrize("arch,kv", [("qwen2", KvType.F16), ("qwen3", KvType.Q8_0),
                                     ("llama3.1", KvType.F16)])
def test_rope_in_the_qkv_launch_changes_no_bit(arch, kv, tmp_path, monkeypatch) -> None:
    plan = _plan(tmp_path, arch, kv)
    a = _decode(plan, True)
    monkeypatch.setattr(gemv_t3, "rope_fits", lambda *args: False)  # separate launches
    b = _decode(plan, False)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not torch.equal(a[0], a[-1])  # the steps saw different tokens

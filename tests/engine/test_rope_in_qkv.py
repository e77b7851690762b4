"""Decode's RoPE and KV-cache store in the epilogue of the q/k/v T GEMV (the ``rope_in_qkv``
trial, carve_kernels/gemv_t.py gemv_t3 ``rope=``) against the default launches, through a whole
GPU stage: every layer takes the fused path, and its decode logits (so its greedy ids) do not
change by a bit. qwen2 (q/k/v biases, f16 cache), qwen3 (per-head q/k norms inside the
rotation, q8_0 cache). Tiny synthetic files; under TRITON_INTERPRET=1 without a GPU. The
kernel's own test (tests/kernels/test_gemv_t.py) covers rings, tiles of two heads and splits."""

from __future__ import annotations

import pytest
import torch

from engine.hardware.devices import DeviceSpec
from engine.planning.plan import KvType, Plan
from engine.runtime.gpu.session import GpuSession
from engine.runtime.options import RunnerOptions
from engine.synth.gen import write_model
from engine.synth.shapes import Shape

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
SHAPES = {  # rows of 256 (K-quant blocks); heads of 32 (qwen2, gemma3) or 64 (qwen3)
    "qwen2": Shape("qwen2", 2, 256, 8, 2, 512, 320, n_ctx=512),
    "qwen3": Shape("qwen3", 2, 256, 4, 2, 512, 320, head_dim=64, n_ctx=512),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch,kv", [("qwen2", KvType.F16), ("qwen3", KvType.Q8_0)])
def test_rope_in_the_qkv_launch_changes_no_bit(arch, kv, tmp_path) -> None:
    (path,) = write_model(tmp_path / f"{arch}.gguf", SHAPES[arch], "q4_k_m")
    # the dequant cache holds every matrix, so q, k and v go to the T layout
    plan = Plan(model=str(path), devices=(CPU,), split=(0, 2), ctx=64, kv_type=kv,
                prefill_chunk=8, cache_reserve=0)
    got = []
    for trial in (frozenset(), frozenset({"rope_in_qkv"})):
        g = GpuSession.load(plan, devices=[DEV], remember=False,
                            options=RunnerOptions(trials=trial))
        try:
            fused = [la.attn.rope_in_qkv for la in g.pipe.stages[0].layers]
            assert fused == [bool(trial)] * 2
            g.forward([5, 77], 0, "last")  # prefill: the plain launches either way
            g.kv.n_past = 2
            logits = []
            for tok in (7, 150, 42, 299):  # decode: the fused path
                logits.append(g.forward([tok], g.kv.n_past, "last")[-1].clone())
                g.kv.n_past += 1
            got.append(logits)
        finally:
            g.close()
    assert all(torch.equal(x, y) for x, y in zip(*got))
    assert not torch.equal(got[0][0], got[0][-1])  # the steps saw different tokens

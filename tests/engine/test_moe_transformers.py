"""The CPU engine's mixture-of-experts families against transformers: tiny random
Qwen3MoeForCausalLM, GptOssForCausalLM, Glm4MoeForCausalLM, MixtralForCausalLM,
MiniMaxM2ForCausalLM, Dots1ForCausalLM and Ernie4_5_MoeForCausalLM built from a
config, written to GGUF (float32, and Q8_0 with gpt-oss's experts in MXFP4), logits at every position and 32 greedy
tokens compared; the expert op touches only the routed experts; the engine process loads a tiny
MoE file and streams a reply."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from engine.hardware.devices import DeviceSpec
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session

sys.path.insert(0, str(Path(__file__).parent))
from hf_compare import errors, f32_kv, session  # noqa: E402
from moe_files import write_pair  # noqa: E402

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=16 * GIB, free=16 * GIB)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=32)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [("qwen3moe", "f32"), ("qwen3moe", "q8_0"), ("gpt-oss", "f32"), ("gpt-oss", "mxfp4"),
         ("glm4moe", "f32"), ("glm4moe", "q8_0"), ("mixtral", "f32"), ("mixtral", "q8_0"),
         ("minimax-m2", "f32"), ("minimax-m2", "q8_0"), ("dots1", "f32"), ("dots1", "q8_0"),
         ("ernie4_5-moe", "f32"), ("ernie4_5-moe", "q8_0")]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict = {}

    def get(arch: str, quant: str):
        if (arch, quant) not in cache:
            path = tmp_path_factory.mktemp("moe") / f"{arch}-{quant}.gguf"
            cache[arch, quant] = write_pair(arch, quant, path)
        return cache[arch, quant]

    return get


def _session(path: Path, cached: bool) -> Session:
    return session(path, cached, ctx=256, chunk=32)


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return errors(ours, ref)[1]


@pytest.mark.parametrize("arch,quant", CASES)
def test_logits_and_greedy_match_transformers(pairs, arch: str, quant: str) -> None:
    hf, path = pairs(arch, quant)
    ids = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    # chunk 32 over 90 tokens: three prefill chunks; gpt-oss's window of 16 wraps in each
    sess = _session(path, cached=False)
    run = sess.hp.n_layer_run  # glm4moe's NextN layer blk.3 is declared, neither loaded nor run
    assert not [n for st in sess.loaded for n in st.tensors if n.startswith(f"blk.{run}.")]
    got = sess.logits(ids.tolist())
    sess.close()
    rel = _rel(got, ref)
    assert rel < 2e-3, f"{arch} {quant}: logits differ by {rel:.2e} of their range"  # f16 KV
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    # float32 KV cache, no dequant cache: only the model's maths remains; greedy ids are equal
    exact = f32_kv(_session(path, cached=False))
    rel = _rel(exact.logits(ids.tolist()), ref)
    assert rel < 1e-4, f"{arch} {quant} f32 KV: logits differ by {rel:.2e} of their range"
    prompt = ids[:12].tolist()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out: list[int] = []
    exact.generate(prompt, GREEDY, set(), out.append)
    exact.close()
    assert out == want, f"{arch} {quant}: greedy continuation differs"


@pytest.mark.parametrize("arch,quant", [("qwen3moe", "q8_0"), ("gpt-oss", "mxfp4")])
def test_with_the_dequant_cache(pairs, arch: str, quant: str) -> None:
    # the product path: bf16 cache copies of the dense matrices; the experts (priced without a
    # copy) dequantize one routed expert's slice at a time into the priced scratch
    from engine.runtime.models.ops import QExperts, QWeight

    hf, path = pairs(arch, quant)
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    sess = _session(path, cached=True)
    ws = [w for st in sess.loaded for w in st.tensors.values()]
    assert any(isinstance(w, QWeight) and w.cached is not None for w in ws)
    experts = [w for w in ws if isinstance(w, QExperts)]
    assert experts and all(w.scratch is not None for w in experts)
    assert all(w.scratch.numel() >= w.rows * w.cols for w in experts)
    rel = _rel(sess.logits(ids.tolist()), ref)
    sess.close()
    assert rel < 3e-2, f"{arch} bf16 cache: logits differ by {rel:.2e} of their range"


def test_experts_op_reads_only_the_routed_experts() -> None:
    from engine.runtime.models.ops import QExperts, experts, glu
    from spec.quant_types import F32

    g = torch.Generator().manual_seed(3)
    n_exp, n_ff, n_embd, t, k = 6, 16, 32, 10, 2
    w = [torch.randn(n_exp, r, c, generator=g) for r, c in ((n_ff, n_embd),) * 2 + ((n_embd, n_ff),)]
    x = torch.randn(t, n_embd, generator=g)
    ids = torch.randint(0, 3, (t, k), generator=g)  # experts 0..2 only
    ids[:, 1] = (ids[:, 0] + 1) % 3
    wt = torch.rand(t, k, generator=g)
    want = torch.zeros(t, n_embd)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            want[i] += wt[i, j] * (w[2][e] @ glu(w[0][e] @ x[i], w[1][e] @ x[i], "silu"))
    mats = []
    for a in w:
        a = a.clone()
        a[3:] = float("nan")  # experts never routed to: reading them would poison the result
        mats.append(QExperts("blk.0.x", a.reshape(-1).view(torch.uint8), F32, n_exp, a.shape[1],
                             a.shape[2]))
    got = experts(x, ids, wt, *mats, "silu")
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # float32 sums in another order


def test_engine_process_streams_a_moe_reply(pairs) -> None:
    from app.cli_chat import build_plan
    from engine.process import protocol as p
    from engine.process.client import EngineProcess

    _, path = pairs("qwen3moe", "q8_0")
    plan = build_plan(Path(path), "cpu", 256, "f16")
    with EngineProcess() as engine:
        engine.wait_for(p.Ready, timeout=120)
        engine.send(p.Load(plan.to_json()))
        engine.wait_for(p.Loaded, timeout=120)
        engine.send(p.Generate([{"role": "user", "content": "hello"}], "moe", {"temperature": 0.0}, 8))
        tokens = []
        while not isinstance(ev := engine.wait_for(p.Token, p.Done, timeout=120), p.Done):
            tokens.append(ev)
        assert ev.request == "moe" and ev.reason in ("stop", "length")
        assert 1 <= ev.completion_tokens <= 8 and ev.prompt_tokens > 2
        engine.send(p.Unload())
        engine.wait_for(p.Unloaded, timeout=60)
    assert engine.proc.returncode == 0

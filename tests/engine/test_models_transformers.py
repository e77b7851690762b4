"""Logits and greedy continuations against transformers loading the same GGUF in float32.

Tiny synthetic models of every architecture (fast, random weights: they prove the maths of each
family, llama's adjacent-pair RoPE included), then the demo model (module-scoped: loading it in
transformers takes ~30-60 s on two cores). Gemma 3 270M: test_gemma_transformers.py, a module of
its own so that the two real models load on two test workers at once.
"""

from __future__ import annotations

import pytest
import torch
from hf_compare import check_real, errors, hf_model, random_ids, real_models, session

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_tiny_models_match_transformers(synth_model, arch: str) -> None:
    path = synth_model(arch, "q4_k_m")
    hf = hf_model(path)
    if arch == "gemma3":
        # gemma3-tiny has head_dim 128, and a GGUF carries no query_pre_attn_scalar: llama.cpp
        # (and we) scale by head_dim**-0.5, transformers falls back to its config default 256.
        # Real Gemma 3 files have head_dim 256, where both agree (test_gemma_transformers.py).
        for layer in hf.model.layers:
            layer.self_attn.scaling = HParams.from_model(GGUFModel.open(path)).attn_scale
    ids = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    # chunk 32 over 90 tokens: three chunks; gemma3-tiny's window is 64, so its sliding
    # layers run as rings across chunk boundaries
    sess = session(path, cached=False, chunk=32)
    got = sess.logits(ids.tolist())
    _, rel = errors(got, ref)
    assert rel < 2e-3, f"{arch}: logits differ by {rel:.2e} of their range"  # f16 KV cache
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95
    sess.close()
    cached = session(path, cached=True, chunk=32)
    _, rel = errors(cached.logits(ids.tolist()), ref)
    assert rel < 3e-2, f"{arch} bf16 cache: logits differ by {rel:.2e} of their range"
    cached.close()


@pytest.fixture(scope="module")
def demo(demo_model_path):
    yield from real_models(demo_model_path, "demo")


@pytest.mark.slow  # ~110 s on two cores: transformers' GGUF load dominates
@pytest.mark.demo
def test_demo_model_matches_transformers(demo) -> None:
    hf, exact, product, prompts = demo
    ids = random_ids(48)
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    check_real(hf, exact, product, prompts, ids, ref, product.logits(ids.tolist()),
               "qwen2.5-coder-0.5b")

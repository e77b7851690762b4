"""What the transformers comparisons share (test_models_transformers.py, the tiny synthetic
models and the demo model; test_gemma_transformers.py, Gemma 3 270M): transformers loading a GGUF
in float32, our CPU engine's sessions on the exact path (float32 copies of every matrix, a
float32 KV cache) and on the product path, and the checks of logits and greedy continuations."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from engine.text.tokenizer import Tokenizer

GIB = 1 << 30
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=32)  # plain argmax
CPU = DeviceSpec(index=-1, name="cpu", total=16 * GIB, free=16 * GIB)


def random_ids(n: int) -> torch.Tensor:
    return torch.randint(100, 20000, (n,), generator=torch.Generator().manual_seed(0))


def hf_model(path):
    if importlib.util.find_spec("accelerate") is None:
        pytest.fail("transformers needs the 'accelerate' package to load a GGUF: pip install accelerate")
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return m.eval()


def session(path, cached: bool, ctx: int = 512, chunk: int = 64) -> Session:
    n = HParams.from_model(GGUFModel.open(path)).n_layer_run
    # no dequant cache -> every matrix is dequantized to float32 per use: the exact path
    plan = Plan(model=str(path), devices=(CPU,), split=(0, n), ctx=ctx, prefill_chunk=chunk,
                cache_reserve=0 if cached else 16 * GIB, logits_rows=chunk)
    return Session.load(plan)


def errors(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs error, max abs error / max |ref|) over all positions."""
    d = (ours - ref).abs().max().item()
    return d, d / ref.abs().max().item()


PROMPTS = {
    "demo": ["def fibonacci(n):\n", "The capital of France is", "Once upon a time, there was"],
    "gemma": ["The capital of France is", "def fibonacci(n):\n", "Once upon a time, there was"],
}


def f32_kv(sess: Session) -> Session:
    """Test-only: a float32 KV cache in place of the priced f16 one (every run layer, its
    cells as priced)."""
    from engine.runtime.kv_cache import KVCache

    hp, ctx = sess.hp, sess.plan.ctx
    spans = {}
    keys, values = hp.kv_rows()
    for i in range(hp.n_layer_run):
        cells = hp.kv_cells(i, ctx)
        spans[f"kv.{i}.k"] = torch.zeros(cells, *keys)
        if values is not None:  # else the values are the keys' leading dims (MLA)
            spans[f"kv.{i}.v"] = torch.zeros(cells, *values)
    sess.kv = KVCache.from_spans(spans, hp, range(hp.n_layer_run), ctx)
    return sess


def exact_session(sess: Session) -> Session:
    """Test-only: give the session float32 copies of every matrix and a float32 KV cache, so
    what remains is the model maths itself (the product rounds the cache to bf16 and the KV to
    f16; those are measured separately: check_real)."""
    from carve_kernels.dequant import dequantize
    from engine.runtime.models.ops import QWeight

    for st in sess.loaded:
        for w in st.tensors.values():
            if isinstance(w, QWeight):
                w.cached = dequantize(w.raw, w.ggml_type, w.gguf_shape)
    return f32_kv(sess)


def real_models(model_path, key):
    """A module fixture's body: (transformers' model, the exact session, the product session,
    the prompts' ids), the sessions closed after."""
    hf = hf_model(model_path)
    exact = exact_session(session(model_path, cached=False, ctx=1024, chunk=256))
    product = session(model_path, cached=True, ctx=1024, chunk=256)
    tok = Tokenizer.from_model(exact.model)
    yield hf, exact, product, [tok.encode(t) for t in PROMPTS[key]]
    exact.close()
    product.close()


def report(name: str, got: torch.Tensor, ref: torch.Tensor) -> float:
    n = ref.shape[0]
    for pos in (0, 1, n // 2, n - 1):
        d, rel = errors(got[pos], ref[pos])
        print(f"{name} position {pos}: max abs {d:.2e}, relative {rel:.2e}")
    d, rel = errors(got, ref)
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    print(f"{name} all {n} positions: max abs {d:.2e}, relative {rel:.2e}, argmax agree {agree:.3f}")
    return rel


def check_real(hf, exact, product, prompts, ids: torch.Tensor, ref: torch.Tensor,
               product_logits: torch.Tensor, name: str) -> None:
    """Logits of ``ids`` on the exact path and the product path (``product_logits``) against
    transformers' (``ref``), then greedy continuations of ``prompts``."""
    assert report(f"{name} f32", exact.logits(ids.tolist()), ref) < 1e-5
    # the product path: bf16 dequant cache, f16 KV cache, float32 products. Measured 0.9e-2
    # (qwen) and 1.6e-2 (gemma: logits up to ~125, 600 positions) of the logit range, on AVX-512
    # and AVX2-only instruction sets alike; bf16 keeps 8 mantissa bits.
    assert report(f"{name} bf16-cache+f16-KV", product_logits, ref) < 4e-2
    eos = hf.generation_config.eos_token_id
    stop = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    for p in prompts:
        with torch.inference_mode():
            want = hf.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False)[0, len(p):]
        want = [t for t in want.tolist() if t not in stop]
        out: list[int] = []
        exact.generate(p, GREEDY, stop, out.append)
        assert out == want, f"{name}: greedy continuation of {p} differs"
        prod: list[int] = []
        product.generate(p, GREEDY, stop, prod.append)
        same = next((i for i, (a, b) in enumerate(zip(prod, want)) if a != b), len(want))
        print(f"{name} bf16-cache+f16-KV greedy: first {same} of {len(want)} tokens identical")



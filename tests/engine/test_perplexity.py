"""Perplexity as llama-perplexity computes it: windows, BOS, second-half scoring, the ± figure."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine.runtime.perplexity import perplexity
from spec.errors import CarveError

pytestmark = pytest.mark.usefixtures("one_torch_thread")



class FakeSession:
    """Records the windows it is asked for; logits are a fixed function of the position."""

    def __init__(self, vocab: int, ctx: int, logits=None) -> None:
        self.plan = SimpleNamespace(ctx=ctx)
        self.vocab = vocab
        self.windows: list[list[int]] = []
        self.fn = logits or (lambda ids: torch.zeros(len(ids), vocab))

    def logits(self, ids: list[int]) -> torch.Tensor:
        self.windows.append(list(ids))
        return self.fn(ids)


def test_uniform_model_has_perplexity_vocab_and_windows_like_llama_cpp() -> None:
    s = FakeSession(vocab=200, ctx=8)
    tokens = list(range(100, 127))  # 27 tokens -> 3 windows of 8, tail of 3 dropped
    r = perplexity(s, tokens, 8, bos_id=1)
    assert r.value == pytest.approx(200.0) and r.stderr == pytest.approx(0.0, abs=1e-4)
    assert r.chunks == 3 and r.scored == 3 * (8 - 1 - 4)
    assert s.windows == [[1] + tokens[i * 8 + 1 : (i + 1) * 8] for i in range(3)]
    no_bos = FakeSession(vocab=200, ctx=8)
    perplexity(no_bos, tokens, 8, bos_id=None)
    assert no_bos.windows[1] == tokens[8:16]


def test_only_the_second_half_is_scored() -> None:
    vocab, n_ctx = 10, 8
    tokens = [3] * 32

    def logits(ids: list[int]) -> torch.Tensor:
        out = torch.zeros(len(ids), vocab)
        out[: n_ctx // 2, 3] = -100.0  # first-half predictions are terrible: must not count
        out[n_ctx // 2 :, 3] = 100.0  # second half predicts the next token perfectly
        return out

    r = perplexity(FakeSession(vocab, n_ctx, logits), tokens, n_ctx, bos_id=None)
    assert r.value == pytest.approx(1.0)


def test_running_estimate_and_stderr() -> None:
    vocab, n_ctx = 4, 4
    g = torch.Generator().manual_seed(0)
    table = torch.randn(64, n_ctx, vocab, generator=g)
    it = iter(range(64))
    s = FakeSession(vocab, n_ctx, lambda ids: table[next(it)])
    tokens = torch.randint(0, vocab, (40,), generator=g).tolist()
    r = perplexity(s, tokens, n_ctx, bos_id=None)
    nll = []
    for i in range(10):  # positions 2..2 of each window of 4 predict token 3
        lp = F.log_softmax(table[i][2].double(), -1)
        nll.append(-lp[tokens[i * 4 + 3]].item())
    mean = sum(nll) / len(nll)
    var = sum(x * x for x in nll) / len(nll) - mean**2
    assert r.value == pytest.approx(math.exp(mean))
    assert r.stderr == pytest.approx(math.exp(mean) * math.sqrt(var / (len(nll) - 1)))
    assert r.running[-1] == pytest.approx(r.value) and len(r.running) == 10


def test_bad_contexts_are_carve_errors() -> None:
    s = FakeSession(10, 8)
    with pytest.raises(CarveError, match="at least 16"):
        perplexity(s, list(range(15)), 8, None)
    with pytest.raises(CarveError, match="larger than the loaded context"):
        perplexity(s, list(range(64)), 16, None)
    with pytest.raises(CarveError, match="even"):
        perplexity(s, list(range(64)), 7, None)


def test_tiny_model_perplexity_matches_transformers_logits(synth_model) -> None:
    """Same windows scored from transformers' logits give the same figure."""
    from transformers import AutoModelForCausalLM

    from engine.hardware.devices import DeviceSpec
    from engine.planning.plan import Plan
    from engine.runtime.session import Session

    path = synth_model("llama", "q8_0")
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    cpu = DeviceSpec(index=-1, name="cpu", total=1 << 33, free=1 << 33)
    sess = Session.load(Plan(model=str(path), devices=(cpu,), split=(0, 4), ctx=64,
                             prefill_chunk=64, cache_reserve=1 << 33, logits_rows=64))
    tokens = torch.randint(3, 500, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    ours = perplexity(sess, tokens, 64, bos_id=1)

    def hf_logits(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return hf(torch.tensor([ids])).logits[0]

    ref = perplexity(FakeSession(512, 64, hf_logits), tokens, 64, bos_id=1)
    assert ours.value == pytest.approx(ref.value, rel=1e-4)  # f16 KV cache rounding
    assert ours.chunks == 3 and ours.scored == 3 * 31

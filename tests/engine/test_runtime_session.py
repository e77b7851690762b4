"""Session behaviour on tiny synthetic models: decode agrees with prefill, prefix reuse, stop
reasons, bad input, NaN localisation, q8_0 KV."""

from __future__ import annotations

import pytest
import torch

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from spec.errors import CarveError

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=20)

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def _session(path, **kw) -> Session:
    n = HParams.from_model(GGUFModel.open(path)).n_layer
    base = {"model": str(path), "devices": (CPU,), "split": (0, n), "ctx": 160,
            "prefill_chunk": 16, "cache_reserve": 0}
    base.update(kw)
    return Session.load(Plan(**base))


@pytest.fixture(scope="module")
def gemma(synth_model):
    s = _session(synth_model("gemma3"))  # window 64 < ctx 160: sliding layers are rings
    yield s
    s.close()


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_decode_agrees_with_prefill_across_the_window(gemma) -> None:
    prompt = _prompt(55)
    out: list[int] = []
    stats = gemma.generate(prompt, GREEDY, set(), out.append)
    assert stats.completion_tokens == 20 and stats.reason == "length"
    assert stats.prompt_tokens == 55 and stats.prefill_s > 0 and stats.decode_s > 0
    # positions 55..74 cross the 64-token window: decode reads the ring, prefill the chunks
    full = gemma.logits(prompt + out)
    assert full[54:-1].argmax(-1).tolist() == out


def test_prefix_reuse_gives_the_same_reply(gemma) -> None:
    a, b = _prompt(20, 1), _prompt(10, 2)
    gemma.generate(a, GREEDY, set(), lambda t: True)
    reused: list[int] = []
    gemma.generate(a + b, GREEDY, set(), reused.append)  # keeps a's 20 cached positions
    gemma.reset()
    fresh: list[int] = []
    gemma.generate(a + b, GREEDY, set(), fresh.append)
    assert reused == fresh


def test_stop_cancel_and_length(gemma) -> None:
    prompt = _prompt(8, 3)
    out: list[int] = []
    gemma.generate(prompt, GREEDY, set(), out.append)
    s = gemma.generate(prompt, GREEDY, {out[3]}, lambda t: True)
    assert s.reason == "stop" and s.completion_tokens == out.index(out[3])
    seen: list[int] = []
    s = gemma.generate(prompt, GREEDY, set(), lambda t: seen.append(t) or len(seen) < 5)
    assert s.reason == "cancelled" and s.completion_tokens == 5 == len(seen)


def test_context_end_stops_with_length(gemma) -> None:
    params = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=100)
    s = gemma.generate(_prompt(150, 4), params, set(), lambda t: True)
    assert s.reason == "length" and s.completion_tokens == 11  # 150 + 10 fill ctx 160, +1 sampled


def test_bad_prompts_are_carve_errors(gemma) -> None:
    with pytest.raises(CarveError, match="context is 160"):
        gemma.generate(_prompt(161), GREEDY, set(), lambda t: True)
    with pytest.raises(CarveError, match="empty"):
        gemma.generate([], GREEDY, set(), lambda t: True)
    with pytest.raises(CarveError, match="context is 160"):
        gemma.logits(_prompt(200))


def test_nan_names_the_first_bad_layer(synth_model) -> None:
    s = _session(synth_model("llama"))
    w = s.loaded[0].tensors["blk.2.ffn_norm.weight"]
    w[0] = float("nan")
    with pytest.raises(CarveError, match="first in layer 2"):
        s.logits(_prompt(5))
    s.close()


def test_q8_0_kv_close_to_f16(synth_model) -> None:
    path = synth_model("qwen3")
    ids = _prompt(40, 5)
    f16 = _session(path).logits(ids)
    q8 = _session(path, kv_type="q8_0").logits(ids)
    rel = ((q8 - f16).abs().max() / f16.abs().max()).item()
    assert 0 < rel < 2e-2  # q8_0 keeps ~8 bits per value: close, not equal


def test_gate_up_fused_view_equals_two_products(synth_model) -> None:
    s = _session(synth_model("qwen2"))
    st = s.stages[0]
    x = torch.randn(3, s.hp.n_embd, generator=torch.Generator().manual_seed(6))
    fused = st.ffn(1, x)
    assert st._fused[1] is not None  # packed arena: gate and up cached back to back
    assert st._fused[1].cached.data_ptr() == s.loaded[0].spans["dq.blk.1.ffn_gate.weight"].data_ptr()
    st._fused[1] = None  # force the two separate products
    torch.testing.assert_close(st.ffn(1, x), fused)
    s.close()

"""A reply with the GPU sampler (engine/runtime/gpu/decode.py): the same ids as the host sampler
draws from the same logits and seed, no host round trip per token but the read of its id, a
stop within one token, and a cache that holds exactly the tokens a later turn reuses.

Runs on the CPU under TRITON_INTERPRET=1 (tiny shapes), on the GPU where there is one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_compare import rel

from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.gpu import decode
from engine.runtime.gpu.session import GpuSession
from engine.runtime.sampling import SamplingParams
from engine.synth.gen import write_model
from engine.synth.shapes import Shape

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
TINY = Shape("qwen2", 2, 128, 2, 1, 256, 320, n_ctx=512)
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02,
                         repeat_penalty=1.1, repeat_last_n=64, seed=1234, max_tokens=6)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    path = str(write_model(tmp_path_factory.mktemp("dec") / "tiny.gguf", TINY, "q4_k_m")[0])
    plan = Plan(model=path, devices=(CPU,), split=(0, 2), ctx=64, prefill_chunk=16,
                cache_reserve=0, logits_rows=4)
    s = GpuSession.load(plan, devices=[DEV], remember=False)
    yield s
    s.close()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reply(s, prompt, params, stop=frozenset(), until=None):
    out: list[int] = []

    def on_token(t: int) -> bool:
        out.append(t)
        return until is None or len(out) < until

    stats = s.generate(prompt, params, set(stop), on_token)
    return out, stats


@pytest.mark.parametrize("params", [SAMPLED, dataclasses.replace(SAMPLED, temperature=0.0)],
                         ids=["sampled", "greedy"])
def test_device_sampler_gives_the_host_samplers_ids(session, params, monkeypatch) -> None:
    prompt = _prompt(20, 1)  # two prefill chunks
    session.reset()
    on_device, stats = _reply(session, prompt, params)
    assert stats.completion_tokens == len(on_device) == params.max_tokens
    monkeypatch.setattr(decode, "served", lambda *a: False)  # the host sampler, same logits
    session.reset()
    on_host, _ = _reply(session, prompt, params)
    assert on_device == on_host


def test_the_decode_loop_reads_one_id_per_token_and_nothing_else(session, monkeypatch) -> None:
    calls = {"read": 0, "forward": 0, "sync": 0}
    real_read, real_sync = decode.IdRing.read, session.pipe.sync

    def read(self, draw):
        calls["read"] += 1
        return real_read(self, draw)

    def forward(*a, **k):  # the host sampler's path: logits copied back every token
        calls["forward"] += 1
        raise AssertionError("the device path read logits back")

    def sync():
        calls["sync"] += 1
        real_sync()

    monkeypatch.setattr(decode.IdRing, "read", read)
    monkeypatch.setattr(session, "forward", forward)
    monkeypatch.setattr(session.pipe, "sync", sync)
    session.reset()
    out, stats = _reply(session, _prompt(10, 2), dataclasses.replace(SAMPLED, max_tokens=8))
    assert len(out) == 8 and stats.reason == "length"
    assert calls == {"read": 8, "forward": 0, "sync": 1}  # one wait per id, one at the end


def test_cancel_stops_within_one_token_and_the_cache_stays_true(session) -> None:
    greedy = dataclasses.replace(SAMPLED, temperature=0.0, max_tokens=10)
    prompt = _prompt(12, 3)
    session.reset()
    first, stats = _reply(session, prompt, greedy, until=3)
    assert len(first) == 3 and stats.reason == "cancelled"
    assert session.tokens == prompt + first and session.kv.n_past == len(session.tokens)
    # the next turn reuses that cache: its logits as a fresh cache's, to the rounding by which
    # decode's three rows of keys and values differ from one prefill chunk's (a greedy reply
    # from each parted at a near-tie of the synthetic file's logits: no id check)
    rest = _prompt(5, 4)
    held = session.forward(rest, session.kv.n_past, "last")[-1].float().clone()
    session.reset()
    fresh = session.logits(prompt + first + rest)[-1].float()
    err = rel(held, fresh)
    print(f"reused cache against a fresh one: {err:.2e}")
    assert err < 2e-2


def test_a_stop_token_ends_the_reply_without_being_passed_on(session) -> None:
    greedy = dataclasses.replace(SAMPLED, temperature=0.0, max_tokens=10)
    prompt = _prompt(12, 5)
    session.reset()
    ids, _ = _reply(session, prompt, greedy)
    session.reset()
    out, stats = _reply(session, prompt, greedy, stop={ids[2]})
    assert stats.reason == "stop" and out == ids[:ids.index(ids[2])]


def test_the_context_end_ends_the_reply(session) -> None:
    session.reset()
    out, stats = _reply(session, _prompt(60, 6), dataclasses.replace(SAMPLED, max_tokens=50))
    assert stats.reason == "length" and len(out) == 64 - 60 + 1  # the last id needs no cell
    assert session.kv.n_past <= 64

"""carve_kernels/sample.py, the GPU sampler, against its host twin (``sample_ref``, the chain the
CPU engine samples with): the same ids from the same logits, settings, history and seed, draw after
draw, with the output and the scratch poisoned before each run."""

from __future__ import annotations

import random

import pytest
import torch
from reference_check import DEVICE, generator

from carve_kernels import sample
from engine.process.sampling_params import SamplingParams
from spec.launch import SAMPLE_KEYS, SAMPLE_LAST_N, SAMPLE_STATE, SAMPLE_TOP_K


def _buffers(g: torch.Generator):
    state = torch.randint(-9, 9, (SAMPLE_STATE,), dtype=torch.int32, generator=g, device=DEVICE)
    keys = torch.randint(-2**62, 2**62, (SAMPLE_KEYS,), dtype=torch.int64,
                         generator=g, device=DEVICE)
    return state, keys


def _draws(logits, params, seed, history, n, g):
    """n ids from the kernel and from the reference, each fed back into the history."""
    state, keys = _buffers(g)
    sample.write_settings(state, params, seed, history)
    got, want, hist = [], [], list(history)
    for d in range(n):
        out = torch.full((1,), -7, dtype=torch.int64, device=DEVICE)
        keys.random_(generator=g)  # stale scratch
        sample.sample(logits.clone(), state, keys, out)
        got.append(int(out))
        want.append(sample.sample_ref(logits, params, seed, hist, d))
        hist.append(want[-1])
        assert int(sample.sampled(state)[d]) == got[-1]  # the ring the host reads back
    assert int(state[sample.DRAWS]) == n
    return got, want


SETTINGS = [
    {"temperature": 0.0},
    {"temperature": 0.0, "repeat_penalty": 1.5, "repeat_last_n": 8},
    {"temperature": 0.7},  # the defaults: top-k 40, top-p 0.95, min-p 0.05, penalty 1.1 / 64
    {"temperature": 1.3, "top_k": 64, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0},
    {"temperature": 0.4, "top_k": 5, "top_p": 0.5, "min_p": 0.3},
    {"temperature": 1.0, "top_k": 1},
    {"temperature": 2.0, "top_k": 30, "repeat_penalty": 0.8, "repeat_last_n": 256},
]


@pytest.mark.parametrize("n_vocab", [320, 3000])
@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in
                                                                       s.items()))
def test_gpu_sampler_draws_the_ids_of_the_host_chain(n_vocab, settings, seed) -> None:
    g = generator(seed)
    rng = random.Random(seed)
    scale = rng.choice([0.5, 2.0, 6.0])
    logits = (torch.randn(n_vocab, generator=g, device=DEVICE) * scale).float()
    logits[rng.randrange(n_vocab)] = logits.max()  # two equal maxima: the lower id wins
    params = SamplingParams(**settings)
    history = [rng.randrange(n_vocab) for _ in range(rng.randrange(0, 80))]
    history += history[:5]  # repeated ids: the penalty applies once
    got, want = _draws(logits, params, rng.getrandbits(64), history, 6, g)
    assert got == want


@pytest.mark.parametrize("layout", ["rising", "equal", "one slice", "bands", "spread"])
def test_the_best_are_found_however_they_lie(layout, seed) -> None:
    """The best SAMPLE_TOP_K ids crowded into few first-pass parts (logits rising with the id;
    all equal, so the lowest ids win; one part far above the rest), or every part keeping more
    than the pick ranks at once (bands: part j's ids above part j-1's), or spread over 64 parts
    (the pick's one-shot ranking alone): the same ids as the host chain."""
    g = generator(seed)
    rng = random.Random(seed)
    n_vocab = {"bands": 131072, "spread": 65536}.get(layout, 3000)
    parts, per = sample.partition(n_vocab)
    logits = torch.randn(n_vocab, generator=g, device=DEVICE)
    if layout == "rising":
        logits = torch.linspace(-4.0, 4.0, n_vocab, device=DEVICE)
    elif layout == "equal":
        logits = torch.zeros(n_vocab, device=DEVICE)
    elif layout == "one slice":
        logits[1000:2000] += 30.0
    elif layout == "bands":  # part j's first eight ids (a run of GROUP) in [10 + j, 10.5 + j]
        run = torch.arange(parts, device=DEVICE) * sample.GROUP
        ids = run[:, None] + torch.arange(8, device=DEVICE)[None, :]
        logits[ids] = 10.0 + torch.arange(parts, device=DEVICE)[:, None] + torch.rand(
            parts, 8, generator=g, device=DEVICE) * 0.5
    params = SamplingParams(temperature=50.0, top_k=SAMPLE_TOP_K, top_p=1.0, min_p=0.0,
                            repeat_penalty=1.0)
    if layout == "spread":
        params = SamplingParams(temperature=1.0, top_k=40, top_p=1.0, min_p=0.0)
    assert parts * per >= n_vocab
    got, want = _draws(logits.float(), params, rng.getrandbits(64), [], 3, g)
    assert got == want


def test_greedy_is_the_lowest_id_of_equal_maxima(seed) -> None:
    g = generator(seed)
    logits = torch.randn(2000, generator=g, device=DEVICE)
    logits[[1500, 700, 1900]] = logits.max() + 1
    state, keys = _buffers(g)
    state.zero_()  # what a stage holds before any reply: greedy, no penalty
    out = torch.full((1,), -7, dtype=torch.int64, device=DEVICE)
    sample.sample(logits, state, keys, out)
    assert int(out) == 700


def test_same_seed_same_ids_other_seed_other_ids(seed) -> None:
    g = generator(seed)
    logits = torch.randn(3000, generator=g, device=DEVICE) * 0.3  # near flat: 64 live choices
    params = SamplingParams(temperature=1.5, top_k=64, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
    a, _ = _draws(logits, params, 11, [], 8, g)
    b, _ = _draws(logits, params, 11, [], 8, g)
    c, _ = _draws(logits, params, 12, [], 8, g)
    assert a == b and a != c


def test_logits_that_are_not_finite_read_back_as_minus_one(seed) -> None:
    g = generator(seed)
    state, keys = _buffers(g)
    sample.write_settings(state, SamplingParams(), 5, [1, 2, 3])
    out = torch.full((1,), -7, dtype=torch.int64, device=DEVICE)
    sample.sample(torch.full((500,), float("nan"), device=DEVICE), state, keys, out)
    assert int(sample.sampled(state)[0]) == -1
    assert int(out) == 0  # the next step still embeds a valid id


def test_what_the_gpu_sampler_serves() -> None:
    def s(**kw) -> bool:
        return sample.served(SamplingParams(**kw))

    assert s(top_k=40, repeat_last_n=64, temperature=0.7)
    assert s(top_k=0, temperature=0.0)  # greedy: any top-k
    assert s(top_k=40, repeat_last_n=10_000, repeat_penalty=1.0)  # no penalty: no window
    assert not s(top_k=0, temperature=0.7)  # the whole vocabulary
    assert not s(top_k=SAMPLE_TOP_K + 1, temperature=0.7)
    assert not s(top_k=40, repeat_last_n=SAMPLE_LAST_N + 1, repeat_penalty=1.1)
    assert not s(temperature=0.0, repeat_last_n=SAMPLE_LAST_N + 1, repeat_penalty=1.1)


def test_uniform_is_the_same_24_bits_as_the_kernel_hash() -> None:
    us = [sample.uniform(2**40 + 3, d) for d in range(2000)]
    assert all(0.0 <= u < 1.0 for u in us)
    assert all(u * 2**24 == int(u * 2**24) for u in us)  # exact in float32
    assert 0.45 < sum(us) / len(us) < 0.55

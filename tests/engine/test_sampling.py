"""engine.runtime.sampling: llama.cpp's default chain (penalty, top-k, top-p, min-p, temperature, draw)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from engine.runtime.sampling import Sampler, SamplingParams, apply_repeat_penalty
from spec.errors import CarveError

# four tokens with probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1
PROBS = [0.5, 0.3, 0.15, 0.05]
LOGITS = torch.tensor([math.log(p) for p in PROBS]) + 3.0  # an offset changes nothing


def _params(seed: int | None = 0, **kw) -> SamplingParams:
    """Settings that change nothing but ``kw``; a test that draws passes its `seed` fixture."""
    base = {
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "min_p": 0.0,
        "repeat_penalty": 1.0,
        "seed": seed,
    }
    return SamplingParams(**{**base, **kw})


def _support(params: SamplingParams, logits: torch.Tensor, n: int = 1500) -> Counter:
    s = Sampler(params)
    return Counter(s(logits, []) for _ in range(n))


def test_greedy_is_argmax(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    s = Sampler(_params(temperature=0.0))
    for _ in range(20):
        logits = torch.randn(1000, generator=g)
        assert s(logits, []) == int(torch.argmax(logits))


def test_greedy_takes_argmax_after_the_penalty() -> None:
    # llama.cpp applies penalties before its temp <= 0 argmax
    logits = torch.tensor([1.0, 1.5, 0.2])
    assert Sampler(_params(temperature=0.0, repeat_penalty=1.0))(logits, [1]) == 1
    assert Sampler(_params(temperature=0.0, repeat_penalty=2.0))(logits, [1]) == 0


def test_same_seed_same_tokens_different_seed_different_tokens(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    steps = [torch.randn(500, generator=g) for _ in range(40)]
    runs = []
    for sampler_seed in (seed, seed, seed + 1):
        s = Sampler(_params(sampler_seed, temperature=1.5))
        runs.append([s(x, []) for x in steps])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]  # 40 draws from near-flat 500-way distributions


def test_no_seed_draws_a_fresh_one() -> None:
    a, b = Sampler(_params(seed=None)), Sampler(_params(seed=None))
    assert a.seed != b.seed


def test_top_k_restricts_support_to_the_k_best(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(50, generator=g) * 0.3
    best = set(torch.topk(logits, 5).indices.tolist())
    assert set(_support(_params(seed, top_k=5), logits)) == best


def test_top_p_keeps_the_shortest_prefix_reaching_p(seed: int) -> None:
    assert set(_support(_params(seed, top_p=0.75), LOGITS)) == {0, 1}  # 0.5 < 0.75 <= 0.8
    assert set(_support(_params(seed, top_p=0.85), LOGITS)) == {0, 1, 2}
    assert set(_support(_params(seed, top_p=0.4), LOGITS, 200)) == {0}  # at least one is kept


def test_min_p_keeps_tokens_within_a_factor_of_the_best(seed: int) -> None:
    assert set(_support(_params(seed, min_p=0.2), LOGITS)) == {0, 1, 2}  # keep p >= 0.1
    assert set(_support(_params(seed, min_p=0.5), LOGITS)) == {0, 1}  # keep p >= 0.25


def test_top_p_looks_at_the_distribution_before_temperature(seed: int) -> None:
    # at temperature 0.5 token 0 alone holds 0.68 > 0.55; at temperature 1 it holds 0.5, so
    # llama.cpp's order (top-p, then temperature) keeps token 1 too
    counts = _support(_params(seed, top_p=0.55, temperature=0.5), LOGITS)
    assert set(counts) == {0, 1}


def test_draws_follow_the_tempered_softmax_of_the_survivors(seed: int) -> None:
    n = 6000
    counts = _support(_params(seed, top_k=3, temperature=0.7), LOGITS, n)
    kept = torch.tensor(PROBS[:3]).log() / 0.7
    want = torch.softmax(kept, 0)
    for i in range(3):
        # 4.5 sigma of a binomial proportion: fails by chance about once in 150,000 runs
        sigma = math.sqrt(want[i] * (1 - want[i]) / n)
        assert abs(counts[i] / n - float(want[i])) < 4.5 * sigma, (i, counts)


def test_repeat_penalty_math_matches_llama_cpp() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 3.0, 0.0])
    out = apply_repeat_penalty(logits, [0, 1, 1, 4], penalty=2.0, last_n=64)
    # > 0 divided, <= 0 multiplied, once per distinct token however often it occurred
    assert out.tolist() == [1.0, -2.0, 0.5, 3.0, 0.0]
    assert logits.tolist() == [2.0, -1.0, 0.5, 3.0, 0.0]  # the input is left alone
    assert apply_repeat_penalty(logits, [0, 1, 3], 2.0, last_n=1).tolist() == [
        2.0,
        -1.0,
        0.5,
        1.5,
        0.0,
    ]
    assert torch.equal(apply_repeat_penalty(logits, [0, 1], 2.0, last_n=0), logits)
    assert torch.equal(apply_repeat_penalty(logits, [0, 1], 1.0, last_n=64), logits)
    # ids outside the vocabulary (a stale history) are ignored, not an IndexError
    assert apply_repeat_penalty(logits, [7, 0], 2.0, 64).tolist()[0] == 1.0


def test_penalty_steers_sampling_away_from_history() -> None:
    logits = torch.tensor([5.0, 4.9, -3.0])
    s = Sampler(_params(temperature=0.0, repeat_penalty=1.5))
    assert s(logits, [0]) == 1
    assert s(logits, [0] + [2] * 64) == 0  # token 0 fell out of the last 64


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.0),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("repeat_last_n", -1),
        ("seed", 1.5),
        ("seed", -1),
        ("max_tokens", 0),
        ("max_tokens", None),
    ],
)
def test_out_of_range_settings_name_setting_value_and_range(name: str, value: object) -> None:
    with pytest.raises(CarveError) as err:
        SamplingParams(**{name: value})
    msg = str(err.value)
    assert name in msg and repr(value) in msg and "use " in msg


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        temperature=0,
        top_k=0,
        top_p=1,
        min_p=0,
        repeat_penalty=0.01,
        repeat_last_n=0,
        seed=0,
        max_tokens=1,
    )
    assert p.top_p == 1 and p.temperature == 0


def test_from_dict() -> None:
    p = SamplingParams.from_dict({"temperature": 0.2, "seed": 7, "max_tokens": 9})
    assert (p.temperature, p.seed, p.max_tokens, p.top_k) == (0.2, 7, 9, 40)
    assert SamplingParams.from_dict(None) == SamplingParams()
    assert SamplingParams.from_dict(p.to_dict()) == p
    with pytest.raises(CarveError, match="unknown sampling setting tempreature"):
        SamplingParams.from_dict({"tempreature": 0.2})
    with pytest.raises(CarveError, match="top_p=2"):
        SamplingParams.from_dict({"top_p": 2})
    with pytest.raises(CarveError, match="object"):
        SamplingParams.from_dict([0.2])  # type: ignore[arg-type]

"""Choosing the next token: llama.cpp's default sampler chain, in torch.

Order as llama.cpp's `common_sampler` default chain: repetition penalty, top-k, top-p, min-p,
temperature, then a draw from the softmax. top-p and min-p look at the distribution *before*
temperature (as there). temperature == 0 is greedy: the argmax of the penalized logits, which is
what llama.cpp's chain yields with temp <= 0.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, fields
from typing import Any

import torch

from engine.errors import CarveError


def _bad(name: str, value: Any, accepted: str) -> CarveError:
    return CarveError(f"sampling setting {name}={value!r} is out of range: use {accepted}")


def _number(name: str, value: Any, accepted: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(name, value, accepted)
    if not math.isfinite(value):
        raise _bad(name, value, accepted)
    return float(value)


def _integer(name: str, value: Any, accepted: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(name, value, accepted)
    return value


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.7  # 0 -> greedy
    top_k: int = 40  # 0 -> off
    top_p: float = 0.95  # 1 -> off
    min_p: float = 0.05  # 0 -> off
    repeat_penalty: float = 1.1  # 1 -> off
    repeat_last_n: int = 64  # tokens of history the penalty looks at; 0 -> off
    seed: int | None = None  # None -> a fresh random seed
    max_tokens: int = 512

    def __post_init__(self) -> None:
        t = _number("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if t < 0:
            raise _bad("temperature", self.temperature, "a number >= 0 (0 = greedy)")
        if _integer("top_k", self.top_k, "an integer >= 0 (0 = off)") < 0:
            raise _bad("top_k", self.top_k, "an integer >= 0 (0 = off)")
        p = _number("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        if not 0 < p <= 1:
            raise _bad("top_p", self.top_p, "a number in (0, 1] (1 = off)")
        m = _number("min_p", self.min_p, "a number in [0, 1) (0 = off)")
        if not 0 <= m < 1:
            raise _bad("min_p", self.min_p, "a number in [0, 1) (0 = off)")
        r = _number("repeat_penalty", self.repeat_penalty, "a number > 0 (1 = off)")
        if r <= 0:
            raise _bad("repeat_penalty", self.repeat_penalty, "a number > 0 (1 = off)")
        if _integer("repeat_last_n", self.repeat_last_n, "an integer >= 0 (0 = off)") < 0:
            raise _bad("repeat_last_n", self.repeat_last_n, "an integer >= 0 (0 = off)")
        seed_range = "an integer in [0, 2**64) or null (random)"
        if self.seed is not None and not 0 <= _integer("seed", self.seed, seed_range) < 2**64:
            raise _bad("seed", self.seed, seed_range)
        if _integer("max_tokens", self.max_tokens, "an integer >= 1") < 1:
            raise _bad("max_tokens", self.max_tokens, "an integer >= 1")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """From a protocol `generate.sampling` object; missing keys keep their defaults."""
        if d is None:
            return cls()
        if not isinstance(d, dict):
            raise CarveError(f"sampling must be an object of settings, got {type(d).__name__}")
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise CarveError(
                f"unknown sampling setting {', '.join(map(str, unknown))}: "
                f"known settings are {', '.join(names)}"
            )
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def apply_repeat_penalty(
    logits: torch.Tensor, history: list[int], penalty: float, last_n: int
) -> torch.Tensor:
    """llama.cpp's repetition penalty: each distinct token of the last ``last_n`` of
    ``history`` has its logit divided by ``penalty`` when > 0, multiplied when <= 0
    (once, however often it occurred). Returns a new tensor."""
    if penalty == 1.0 or last_n == 0 or not history:
        return logits
    ids = torch.tensor(sorted(set(history[-last_n:])), dtype=torch.long, device=logits.device)
    ids = ids[(ids >= 0) & (ids < logits.shape[-1])]
    out = logits.clone()
    sel = out[ids]
    out[ids] = torch.where(sel > 0, sel / penalty, sel * penalty)
    return out


def _top_p_keep(sorted_logits: torch.Tensor, p: float) -> int:
    """How many of the (descending) candidates top-p keeps: the shortest prefix whose
    probability mass reaches p, at least one (llama.cpp `llama_sampler_top_p_apply`)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    cum = torch.cumsum(probs, dim=-1)
    return min(int((cum < p).sum().item()) + 1, sorted_logits.numel())


class Sampler:
    """Stateful only through its random generator: the same seed and the same logits give
    the same tokens."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else random.getrandbits(63)
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def candidates(
        self, logits: torch.Tensor, history: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, logits after the chain, temperature applied) of the tokens still
        eligible, best first. For greedy, just the argmax."""
        p = self.params
        x = apply_repeat_penalty(
            logits.reshape(-1).float(), history, p.repeat_penalty, p.repeat_last_n
        )
        if p.temperature == 0:
            i = torch.argmax(x)
            return i.view(1), x[i].view(1)
        if 0 < p.top_k < x.numel():
            vals, ids = torch.topk(x, p.top_k)  # sorted descending
        else:
            vals, ids = torch.sort(x, descending=True)
        if p.top_p < 1.0:
            n = _top_p_keep(vals, p.top_p)
            vals, ids = vals[:n], ids[:n]
        if p.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p)
            n = int((vals >= vals[0] + math.log(p.min_p)).sum().item())
            vals, ids = vals[: max(n, 1)], ids[: max(n, 1)]
        return ids, vals / p.temperature

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """Next token id from ``logits`` [vocab] given the ids so far (prompt + generated)."""
        ids, vals = self.candidates(logits, history)
        if ids.numel() == 1:
            return int(ids[0])
        probs = torch.softmax(vals, dim=-1)
        k = torch.multinomial(probs, 1, generator=self._generator(probs.device))
        return int(ids[k])

"""Sampling settings as the protocol, the CLI and the window carry them: pure Python, no torch.

Validated once here; ``engine/runtime/sampling.py`` (torch) draws tokens with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from spec.errors import CarveError


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

"""The generation loop: prefill the prompt in chunks, then decode one token at a time."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from spec.errors import CarveError


@dataclass(slots=True)
class GenerationStats:
    prompt_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    reason: str  # "stop" | "length" | "cancelled"

    @property
    def prefill_tps(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        # the first completion token comes from the prefill's logits
        n = max(0, self.completion_tokens - 1)
        return n / self.decode_s if self.decode_s > 0 else 0.0


def generate(
    session: Any,
    prompt_ids: list[int],
    params: Any,
    stop_ids: set[int],
    on_token: Callable[[int], bool],
) -> GenerationStats:
    """Prefill ``prompt_ids`` then sample up to params.max_tokens tokens on the host. A stop
    token ends the reply without being passed to ``on_token``; ``on_token`` returning False
    cancels."""
    from engine.runtime.sampling import Sampler

    sampler = Sampler(params)
    t0 = time.perf_counter()
    keep = start(session, prompt_ids)
    logits = session.prefill(prompt_ids[keep:], all_rows=False)[-1]
    history = list(prompt_ids)
    t1 = time.perf_counter()
    prefill_s = t1 - t0
    ctx = session.plan.ctx

    n_out, reason = 0, "length"
    while n_out < params.max_tokens:
        tok = int(sampler(logits, history))
        if tok in stop_ids:
            reason = "stop"
            break
        n_out += 1
        history.append(tok)
        if on_token(tok) is False:
            reason = "cancelled"
            break
        if n_out >= params.max_tokens or session.kv.n_past >= ctx:
            reason = "length"
            break
        logits = session.forward([tok], session.kv.n_past, "last")[-1]
        session.kv.n_past += 1
        session.tokens.append(tok)
        session.check_finite(logits)
    return GenerationStats(
        prompt_tokens=len(prompt_ids),
        completion_tokens=n_out,
        prefill_s=prefill_s,
        decode_s=time.perf_counter() - t1,
        reason=reason,
    )


def start(session: Any, prompt_ids: list[int]) -> int:
    """Check the prompt against the context and keep the cached prefix it shares with the
    previous call (multi-turn chat re-sends the whole conversation); at least the last prompt
    token is recomputed for its logits. Returns how many prompt tokens stay cached."""
    if not prompt_ids:
        raise CarveError("the prompt is empty; send at least one token")
    ctx = session.plan.ctx
    if len(prompt_ids) > ctx:
        raise CarveError(
            f"the prompt is {len(prompt_ids)} tokens but the context is {ctx}; raise --ctx or "
            f"shorten the conversation"
        )
    keep = min(_common_prefix(session.tokens, prompt_ids), len(prompt_ids) - 1)
    if not session.rewind(keep):
        session.reset()
        keep = 0
    return keep


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

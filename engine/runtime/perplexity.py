"""Perplexity the way llama.cpp's `llama-perplexity` computes it (tools/perplexity, the default
non-overlapping mode), so the figures compare with llama.cpp's:

- the text is tokenized with BOS when the model's vocabulary adds one;
- it is cut into ``n_chunk = len(tokens) // n_ctx`` windows of exactly ``n_ctx`` tokens (the
  tail is dropped), each evaluated from an empty cache;
- when the model adds BOS, each window's first token is replaced by BOS for the evaluation;
- only the second half of each window is scored: logits at positions n_ctx/2 .. n_ctx-2
  predict tokens n_ctx/2+1 .. n_ctx-1, so every scored token has at least n_ctx/2 of context;
- PPL = exp(mean NLL); the ± is ppl * sqrt(var(NLL) / (count - 1)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import CarveError


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    value: float  # final estimate
    stderr: float  # ± as llama.cpp prints it
    chunks: int
    scored: int  # tokens scored
    running: tuple[float, ...]  # the estimate after each chunk, as llama.cpp prints them


def perplexity(
    session: Any,
    tokens: list[int],
    n_ctx: int,
    bos_id: int | None,
    on_chunk: Callable[[int, int, float], None] | None = None,
) -> PerplexityResult:
    """Perplexity of ``tokens`` (already tokenized, with BOS if the model adds it) in windows of
    ``n_ctx``. ``bos_id``: the BOS id when the model adds BOS, else None. ``on_chunk(i, n,
    running_ppl)`` after each window."""
    if n_ctx < 4 or n_ctx % 2:
        raise CarveError(f"--ctx: perplexity needs an even context of at least 4 tokens, got {n_ctx}")
    if n_ctx > session.plan.ctx:
        raise CarveError(
            f"--ctx: {n_ctx} is larger than the loaded context {session.plan.ctx}; load with "
            f"--ctx {n_ctx} or more"
        )
    if len(tokens) < 2 * n_ctx:
        raise CarveError(
            f"the text is {len(tokens)} tokens; perplexity at --ctx {n_ctx} needs at least "
            f"{2 * n_ctx} (use a longer text or a smaller --ctx)"
        )
    n_chunk = len(tokens) // n_ctx
    first = n_ctx // 2
    nll = nll2 = 0.0
    count = 0
    running = []
    for i in range(n_chunk):
        window = list(tokens[i * n_ctx : (i + 1) * n_ctx])
        if bos_id is not None:
            window[0] = bos_id
        logits = session.logits(window)  # [n_ctx, n_vocab] float32
        lp = torch.log_softmax(logits[first : n_ctx - 1].double(), dim=-1)
        target = torch.tensor(tokens[i * n_ctx + first + 1 : (i + 1) * n_ctx])
        v = -lp.gather(1, target.unsqueeze(1)).squeeze(1)
        nll += float(v.sum())
        nll2 += float((v * v).sum())
        count += v.numel()
        running.append(math.exp(nll / count))
        if on_chunk is not None:
            on_chunk(i + 1, n_chunk, running[-1])
    mean = nll / count
    ppl = math.exp(mean)
    var = nll2 / count - mean * mean
    err = ppl * math.sqrt(var / (count - 1)) if var > 0 and count > 1 else 0.0
    return PerplexityResult(ppl, err, n_chunk, count, tuple(running))

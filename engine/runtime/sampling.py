"""Choosing the next token: llama.cpp's default sampler chain, in torch.

Order as llama.cpp's `common_sampler` default chain: repetition penalty, top-k, top-p, min-p,
temperature, then a draw from the softmax. top-p and min-p look at the distribution *before*
temperature (as there). temperature == 0 is greedy: the argmax of the penalized logits, which is
what llama.cpp's chain yields with temp <= 0.
"""

from __future__ import annotations

import math
import random

import torch

from engine.process.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplingParams", "apply_repeat_penalty"]


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

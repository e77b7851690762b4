"""Choosing the next token on the host: llama.cpp's default sampler chain, in torch.

Order as llama.cpp's `common_sampler` default chain: repetition penalty, top-k, top-p, min-p,
temperature, then one draw. top-p and min-p look at the distribution *before* temperature (as
there). temperature == 0 is greedy: the argmax of the penalized logits, which is what
llama.cpp's chain yields with temp <= 0. The chain and its draw are carve_kernels/sample.py's
reference twin, so the host and the GPU sampler pick the same ids from the same logits and seed.
"""

from __future__ import annotations

import random

import torch

from carve_kernels.sample import apply_repeat_penalty, sample_ref
from engine.process.sampling_params import SamplingParams

__all__ = ["Sampler", "SamplingParams", "apply_repeat_penalty", "new_seed"]


def new_seed() -> int:
    """A fresh seed for a request that names none."""
    return random.getrandbits(63)


class Sampler:
    """Stateful only through its draw counter: the same seed and the same logits give the same
    tokens."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else new_seed()
        self.draws = 0

    def __call__(self, logits: torch.Tensor, history: list[int]) -> int:
        """Next token id from ``logits`` [vocab] given the ids so far (prompt + generated)."""
        tok = sample_ref(logits, self.params, self.seed, history, self.draws)
        self.draws += 1
        return tok

"""A reply on the GPU runner with the sampler on the device: the host never waits for a step
before launching the next.

The prompt's last row is sampled on the device, then each decode step (one CUDA-graph replay
per stage) embeds the id the step before it drew, draws the next one into the same place and
appends it to a ring of ids. The host keeps ``DEPTH`` steps queued ahead of the id it reads
back: a device-to-host copy of the ring and an event per step, read when that event is done.
So the GPU runs step after step while the host hands the previous token to ``on_token``; a
stop token, a cancel or max_tokens ends the reply at the token read, and the steps already
queued only write cache rows past the reply's end.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from carve_kernels import sample
from engine.runtime.generate import GenerationStats, start
from engine.runtime.gpu.pipeline import on
from engine.runtime.sampling import new_seed
from spec.launch import SAMPLE_RING

DEPTH = 2  # decode steps queued ahead of the id the host reads


class IdRing:
    """The ring of sampled ids, read back on the host one draw at a time."""

    def __init__(self, stage: Any, host: torch.Tensor) -> None:
        # no view into the stage's arena is kept here: closing the session frees it all
        self.stage, self.host, self.on_cuda = stage, host, stage.on_cuda
        self.events = [torch.cuda.Event() for _ in range(SAMPLE_RING)] if self.on_cuda else []

    def enqueue(self, draw: int) -> None:
        """Copy the ring to the host after the work queued so far (the step of ``draw``)."""
        if self.on_cuda:
            with on(self.stage.device):
                self.host.copy_(sample.sampled(self.stage.samp_state), non_blocking=True)
                self.events[draw % SAMPLE_RING].record()

    def read(self, draw: int) -> int:
        """The id of ``draw``, once its copy has landed (the only wait of the decode loop)."""
        if self.on_cuda:
            self.events[draw % SAMPLE_RING].synchronize()
            return int(self.host[draw % SAMPLE_RING])
        # on the CPU (interpreter) the device ring is host memory already
        return int(sample.sampled(self.stage.samp_state)[draw % SAMPLE_RING])


def served(session: Any, params: Any) -> bool:
    """Whether this reply's settings run on the GPU sampler (else the host sampler)."""
    last = session.pipe.stages[-1]
    return last.samp_state is not None and sample.served(params)


def generate_on_device(session: Any, ring: IdRing, prompt_ids: list[int], params: Any,
                       stop_ids: set[int], on_token: Callable[[int], bool]) -> GenerationStats:
    """``session.generate`` with the GPU sampler: same arguments, same stats, same tokens as
    the host sampler draws from the same logits and seed."""
    pipe, plan = session.pipe, session.plan
    last = pipe.stages[-1]
    seed = params.seed if params.seed is not None else new_seed()
    t0 = time.perf_counter()
    keep = start(session, prompt_ids)
    tail = prompt_ids[keep:]
    session._check_context(session.kv.n_past + len(tail))
    for c in range(0, len(tail), plan.prefill_chunk):
        part = tail[c:c + plan.prefill_chunk]
        pipe.run_chunk(part, session.kv.n_past, head=False)
        session.kv.n_past += len(part)
        session.tokens.extend(part)
    with on(last.device):
        last.head(len(part) - 1, 1)
    sample.write_settings(last.samp_state, params, seed, prompt_ids)
    pos0 = session.kv.n_past
    pipe.sample_prefilled(pos0)
    ring.enqueue(0)
    # draw d (d >= 1) is made by the step that runs draw d-1's id at position pos0 + d - 1
    last_draw = min(params.max_tokens - 1, plan.ctx - pos0)
    queued, next_draw = deque([0]), 1
    emitted: list[int] = []
    reason, t1 = "length", None
    try:
        while queued:
            while next_draw <= last_draw and len(queued) <= DEPTH:
                pipe.step()
                ring.enqueue(next_draw)
                queued.append(next_draw)
                next_draw += 1
            draw = queued.popleft()
            tok = ring.read(draw)
            if t1 is None:
                t1 = time.perf_counter()
            if tok < 0:
                reason = "non-finite"
                break
            if tok in stop_ids:
                reason = "stop"
                break
            emitted.append(tok)
            if on_token(tok) is False:
                reason = "cancelled"
                break
            if len(emitted) >= params.max_tokens:
                break
    finally:
        pipe.sync()  # the steps still queued finish before the cache is touched again
        last.samp_state[:16].zero_()  # greedy, no penalty: what the other paths expect
        # the ids whose keys and values a step wrote: those the steps that ran consumed
        cached = emitted[:next_draw - 1]
        session.tokens.extend(cached)
        session.kv.n_past += len(cached)
    if reason == "non-finite":
        session.name_non_finite()
    t1 = t1 if t1 is not None else time.perf_counter()
    return GenerationStats(prompt_tokens=len(prompt_ids), completion_tokens=len(emitted),
                           prefill_s=t1 - t0, decode_s=time.perf_counter() - t1, reason=reason)

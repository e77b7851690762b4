"""Stages of a Layout on their GPUs, run as one pipeline: the hidden state of token t moves
from device to device; the last stage's greedy id goes back to the first.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.runtime.gpu_load import load_tensors
from engine.runtime.gpu_stage import GpuStage, allocate


class GpuPipeline:
    def __init__(self, model: Any, hp: Any, layout: Any, on_progress=None, cancelled=None) -> None:
        plan = layout.plan
        self.model, self.hp, self.layout = model, hp, layout
        self.stages: list[GpuStage] = []
        self.arenas: list[list[torch.Tensor]] = []
        self.report: list[dict] = []
        for dl in layout.devices:
            dev = torch.device("cuda", dl.device.index)
            torch.cuda.synchronize(dev)
            before = torch.cuda.memory_reserved(dev)
            arenas, spans = allocate(dl, dev)
            names = [s.name for a in dl.arenas for s in a.spans
                     if s.purpose in ("weights", "globals")]
            nbytes, sec = load_tensors(model, names, spans, dev, on_progress, cancelled)
            for name, t in spans.items():
                if name.startswith("kv."):
                    t.zero_()
            stage = GpuStage(hp, model, dl, spans, dev, plan.ctx, plan.prefill_chunk)
            t0 = time.perf_counter()
            with torch.cuda.device(dev):  # Triton launches on the current device
                cached = stage.fill_dequant_cache()
            torch.cuda.synchronize(dev)
            self.stages.append(stage)
            self.arenas.append(arenas)
            self.report.append({
                "index": dl.device.index, "layers": list(dl.layers), "priced": dl.allocated,
                "reserved": torch.cuda.memory_reserved(dev) - before,
                "load_bytes": nbytes, "load_s": sec, "dequant_cached": cached,
                "dequant_s": time.perf_counter() - t0})

    def _send(self, i: int, n: int) -> None:
        a, b = self.stages[i - 1], self.stages[i]
        b.buf["hidden"][:n].copy_(a.buf["hidden"][:n], non_blocking=True)
        b.buf["positions"][:n].copy_(a.buf["positions"][:n], non_blocking=True)

    def prefill(self, ids: list[int], pos0: int = 0) -> int:
        """Run ids at positions pos0.. in chunks; returns the greedy next id."""
        chunk = self.layout.plan.prefill_chunk
        first, last = self.stages[0], self.stages[-1]
        for c0 in range(0, len(ids), chunk):
            part = ids[c0:c0 + chunk]
            n = len(part)
            first.buf["tokens"][:n].copy_(torch.tensor(part, dtype=torch.int64))
            p = pos0 + c0
            first.buf["positions"][:n].copy_(torch.arange(p, p + n, dtype=torch.int64))
            for i, st in enumerate(self.stages):
                if i:
                    self._send(i, n)
                with torch.cuda.device(st.device):
                    st.forward(n, p)
        nxt = int(torch.argmax(last.buf["logits"][0]))
        end = pos0 + len(ids)
        for st in self.stages:
            st.buf["positions"][:1].fill_(end)
        first.buf["tokens"][:1].fill_(nxt)
        return nxt

    def capture(self) -> None:
        for st in self.stages:
            with torch.cuda.device(st.device):
                st.capture()
        # the eager warm-up advanced positions and wrote one KV row: callers prefill or
        # set_position next

    def set_position(self, pos: int, token: int = 0) -> None:
        for st in self.stages:
            st.buf["positions"][:1].fill_(pos)
        self.stages[0].buf["tokens"][:1].fill_(token)

    def step(self) -> None:
        """One decode token through every stage (no host sync)."""
        for i, st in enumerate(self.stages):
            if i:
                b = st.buf["hidden"]
                b[:1].copy_(self.stages[i - 1].buf["hidden"][:1], non_blocking=True)
            with torch.cuda.device(st.device):
                st.replay()
        if len(self.stages) > 1:
            self.stages[0].buf["tokens"][:1].copy_(self.stages[-1].next_id, non_blocking=True)

    def greedy(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self.step()
            out.append(int(self.stages[-1].next_id))
        return out

    def sync(self) -> None:
        for st in self.stages:
            torch.cuda.synchronize(st.device)

"""A loaded model the engine process drives: load a Plan, compute logits, generate, close.

Stages (one per device) run their layers in order; hidden states move device to device between
them. All memory is the Layout's arenas (engine/runtime/loader.py); torch's own temporaries
are the activations `engine/planning/buffers.py` prices.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from engine.runtime import timeline
from engine.runtime.chunked import ChunkedSession
from engine.runtime.generate import GenerationStats
from engine.runtime.kv_cache import KVCache
from engine.runtime.loader import LoadedStage, Progress, RecordingAllocator, load_layout
from engine.runtime.models import build_stage
from engine.runtime.models.layers import Stage
from engine.runtime.models.ops import TORCH_OPS
from engine.runtime.options import RunnerOptions
from spec.runners import TORCH

__all__ = ["GenerationStats", "Session"]


class Session(ChunkedSession):
    def __init__(
        self,
        plan: Any,
        model: Any,
        hp: Any,
        layout: Any,
        allocator: RecordingAllocator,
        loaded: list[LoadedStage],
        ops: SimpleNamespace = TORCH_OPS,
    ) -> None:
        self.plan, self.model, self.hp, self.layout = plan, model, hp, layout
        self.allocator = allocator
        self.loaded = loaded
        self.stages: list[Stage] = [
            build_stage(hp, st.tensors, st.layers, st.first, st.last, ops, st.device, plan.ctx)
            for st in loaded
        ]
        kv_spans = {k: v for st in loaded for k, v in st.spans.items() if k.startswith("kv.")}
        self.kv = KVCache.from_spans(kv_spans, hp, range(hp.n_layer_run), plan.ctx)
        self.tokens: list[int] = []  # the tokens whose keys/values are in the cache, in order

    @classmethod
    def load(
        cls,
        plan: Any,
        on_progress: Progress | None = None,
        cancelled: Callable[[], bool] | None = None,
        ops: SimpleNamespace = TORCH_OPS,
        options: RunnerOptions = RunnerOptions(),
    ) -> Session:
        """Price ``plan``, allocate exactly that Layout, and load the weights into it. ``ops``:
        the op table the models run on. A CUDA plan of an architecture the Triton runner
        runs loads as a `GpuSession` instead (same interface), unless ``options`` asks for the
        torch runner; one stderr line says which."""
        from engine.gguf.hparams import HParams
        from engine.gguf.reader import GGUFModel
        from engine.planning.price import price
        from engine.runtime.gpu.session import GpuSession, refuse, why_not

        model = GGUFModel.open(plan.model)
        hp = HParams.from_model(model)
        why = why_not(plan, hp, options)
        timeline.mark("model opened")
        devices = ", ".join(d.label for d in plan.devices)
        if why is None:
            print(f"carve-engine: runner triton on {devices}", file=sys.stderr, flush=True)
            return GpuSession.load(plan, on_progress, cancelled, model=model,  # type: ignore[return-value]
                                   options=options)
        print(f"carve-engine: runner torch on {devices} ({why})", file=sys.stderr, flush=True)
        layout = price(plan, model, TORCH)
        refuse(layout)  # host experts on this runner too: price() says "does not run here"
        allocator = RecordingAllocator()
        loaded = load_layout(layout, model, allocator, on_progress, cancelled)
        return cls(plan, model, hp, layout, allocator, loaded, ops)

    # --- queries ------------------------------------------------------------------------------
    def memory_report(self) -> list[dict]:
        """Per device: what was priced and what this session allocated (NVML where a GPU is)."""
        out = []
        for dl, st in zip(self.layout.devices, self.loaded):
            dev = str(st.device)
            allocated = sum(a.nbytes for a in self.allocator.records if a.device == dev)
            nvml = None
            if st.device.type == "cuda":
                allocated = torch.cuda.memory_reserved(st.device)
            out.append(
                {
                    "index": dl.device.index,
                    "name": dl.device.name,
                    "priced": dl.allocated,
                    "allocated": allocated,
                    "nvml_used": nvml,
                }
            )
        return out

    # --- compute ------------------------------------------------------------------------------
    def forward(
        self, ids: list[int], pos0: int, rows: str = "last", check: bool = False
    ) -> torch.Tensor | None:
        """Run ids (one chunk) at positions pos0.. through every stage; float32 logits of
        ``rows`` "all", the "last" row only, or "none" (a prefill chunk before the last)."""
        first = self.stages[0]
        x = first.embed(torch.tensor(ids, dtype=torch.long, device=first.device))
        for st in self.stages:
            x = st.forward(x.to(st.device), pos0, self.kv, check)
        last = self.stages[-1]
        if rows == "none":
            return None
        if rows == "last":
            return last.head(x[-1:])
        step = max(1, self.plan.logits_rows)
        return torch.cat([last.head(x[r : r + step]) for r in range(0, x.shape[0], step)])

    def close(self) -> None:
        """Free every allocation of this session."""
        self.stages.clear()
        for st in self.loaded:
            st.spans.clear()
            st.tensors.clear()
        self.kv.layers.clear()
        self.allocator.free_all()

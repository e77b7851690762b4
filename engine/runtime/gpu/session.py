"""A loaded model on the Triton GPU runner, with the interface the engine process drives on
`engine.runtime.session.Session` (generate, perplexity, chat): prefill in chunks of the priced
size, decode as one CUDA-graph replay per stage with the token and position written into the
stages' device buffers, every byte on the devices an arena of the Layout.

Decode allocates nothing: the logits row the sampler reads is copied into one pinned host
buffer made at load. Prefill returns float32 logits on the host (perplexity scores there).
The same code runs on the CPU under TRITON_INTERPRET=1, which is how CI tests it.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from typing import Any

import torch

from engine.planning.rules import Verdict
from engine.process.protocol import WARM_UP
from engine.runtime import timeline
from engine.runtime.chunked import ChunkedSession
from engine.runtime.generate import GenerationStats
from engine.runtime.gpu import decode
from engine.runtime.gpu.pipeline import GpuPipeline, on, sync
from engine.runtime.gpu.precompile import fresh
from engine.runtime.models.layers import NonFinite
from engine.runtime.options import RunnerOptions
from spec.errors import CarveError
from spec.launch import SAMPLE_RING
from spec.runners import TRITON

log = logging.getLogger("carve.engine")


def why_not(plan: Any, hp: Any, options: RunnerOptions = RunnerOptions()) -> str | None:
    """None when the GPU runner runs this plan, else why the torch engine does: the options,
    then the rule a plan can tell (engine.planning.capability.gpu_why_not, which pricing
    shares), then whether this process sees CUDA."""
    from engine.planning.capability import gpu_why_not

    if options.runner == "torch":
        return "CARVE_RUNNER=torch"
    why = gpu_why_not(plan, hp)
    if why is not None:
        return why
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    return None


def refuse(layout: Any) -> None:
    """CarveError, before anything is allocated, naming the first device the plan does not fit
    or does not run on and why."""
    if layout.fits:
        return
    host = getattr(layout, "host", None)
    bad = next((d for d in layout.devices if not d.verdict.runs), None)
    if bad is None and host is not None:
        raise CarveError(f"the plan does not fit ({host.advice})")
    assert bad is not None
    if bad.verdict == Verdict.DOES_NOT_RUN:
        raise CarveError(f"{bad.device.label}: the plan does not run here ({bad.advice})")
    why = bad.advice or f"{-bad.headroom / 2**20:.0f} MiB over"
    raise CarveError(f"{bad.device.label}: the plan does not fit ({why})")


def _check_layer(layer: int, hidden: torch.Tensor) -> None:
    if not bool(torch.isfinite(hidden).all()):
        raise NonFinite(layer)


class GpuKV:
    """The part of the KV cache the session API exposes: how many positions are cached, and
    whether an earlier prefix is still intact (sliding-window layers are rings)."""

    def __init__(self, hp: Any, ctx: int) -> None:
        self.n_past = 0
        self.ctx = ctx
        self.ring_cells = min((hp.kv_cells(i, ctx) for i in range(hp.n_layer)
                               if hp.kv_cells(i, ctx) < ctx), default=None)

    def reset(self) -> None:
        self.n_past = 0

    def can_rewind_to(self, n: int) -> bool:
        return n <= self.n_past and (self.ring_cells is None or self.n_past <= self.ring_cells)


class GpuSession(ChunkedSession):
    runner = "triton"

    def __init__(self, plan: Any, model: Any, hp: Any, layout: Any, pipe: GpuPipeline) -> None:
        self.plan, self.model, self.hp, self.layout = plan, model, hp, layout
        self.pipe = pipe
        self.kv = GpuKV(hp, plan.ctx)
        self.compiled: dict = {}  # what the load's precompile did (gpu/precompile.py)
        self.tokens: list[int] = []  # the tokens whose keys/values are in the cache, in order
        last = pipe.stages[-1]
        # the host sampler's row: filled by a device-to-host copy, never reallocated
        self._host = torch.empty((1, hp.n_vocab), dtype=torch.float32, pin_memory=last.on_cuda)
        # the GPU sampler's ids, read back one draw at a time (engine/runtime/gpu/decode.py)
        self._ids = decode.IdRing(last, torch.empty(SAMPLE_RING, dtype=torch.int32,
                                                    pin_memory=last.on_cuda))

    @classmethod
    def load(cls, plan: Any, on_progress: Callable | None = None,
             cancelled: Callable[[], bool] | None = None, remember: bool = True,
             model: Any = None, devices: list[torch.device] | None = None,
             options: RunnerOptions = RunnerOptions()) -> GpuSession:
        """Price ``plan``, check it still fits, allocate its Layout and load the weights; then
        warm up (cuBLAS workspace, kernels, CUDA graphs) and measure what the runtime costs
        outside the arenas. Any failure frees everything before it raises. ``devices``: run
        the stages there instead of on the plan's devices (tests: a GPU split on the CPU).
        ``options``: the kernels the stages use (int8 x, T layout, PDL)."""
        from engine.gguf.hparams import HParams
        from engine.gguf.reader import GGUFModel
        from engine.planning.price import price

        model = GGUFModel.open(plan.model) if model is None else model
        hp = HParams.from_model(model)
        layout = price(plan, model, TRITON)
        refuse(layout)
        timeline.mark("priced")
        pipe = GpuPipeline(model, hp, layout, on_progress, cancelled, devices, options,
                           defer_fill=True)
        err: BaseException | None = None
        try:
            sess = cls(plan, model, hp, layout, pipe)
            sess._warm_up(on_progress, cancelled)
            pipe.finish_report(remember)
            timeline.mark("memory measured")
            return sess
        except BaseException as exc:  # noqa: BLE001 - re-raised once the memory is freed
            if not isinstance(exc, CarveError):
                log.error("warm-up failed:\n%s", traceback.format_exc())
            exc.__traceback__ = None  # its frames hold views into the arenas
            exc.__context__ = exc.__cause__ = None
            err = exc
        pipe.free()
        raise err

    def _warm_up(self, on_progress: Callable | None = None,
                 cancelled: Callable[[], bool] | None = None) -> None:
        """Everything a reply would otherwise compile or capture on its first use, done at load
        and reported as the load stage "warm-up": prefill chunks of a whole and of an odd
        length at the start and further in (Triton specializes on sizes divisible by 16), a
        chunk of a few rows (the GEMV path), the head and the GPU sampler on a prefilled row,
        then the decode graphs. On a GPU the overhead measured after it is then the whole of
        it; under the interpreter only the graphs' eager step runs."""
        pipe = self.pipe
        steps = self._warm_up_steps() if pipe.stages[0].on_cuda else []
        total = len(steps) + 1
        compiler = pipe.compiler
        # a cold kernel cache: compile on every core first. In a process that has compiled
        # none of our kernels yet (none can launch in a dry pass), the fills' and the
        # warm-up's dry passes are one round; else the fills come first, each with a round
        one_round = compiler is not None and compiler.active and bool(steps) and fresh()

        def precompile(work: list[Callable[[], None]]) -> None:
            if on_progress is not None:
                on_progress(WARM_UP, 0, total, 0.0)
            with pipe.dry_pass():
                compiler.round(work, pipe.clear_buffers, pipe.sync)
            timeline.mark(compiler.summary())

        # the decode step's fused GEMVs are the slowest to compile (up to ~7 s each, most of
        # it Triton's coalescing pass): recorded early, they start first; the fills' scan
        # comes first of all, a small kernel to compile on the spot
        if one_round:
            precompile([*pipe.fill_steps(), pipe.decode_eager, *steps])
        pipe.fill(on_progress, cancelled, precompiled=one_round)
        if compiler is not None:
            if steps and compiler.active and not one_round:
                precompile([pipe.decode_eager, *steps])
            compiler.close()
            self.compiled = compiler.report
        for i, step in enumerate(steps):
            if cancelled is not None and cancelled():
                raise CarveError("load cancelled")
            if on_progress is not None:
                on_progress(WARM_UP, i, total, 0.0)
            step()
        timeline.mark("warm-up chunks")
        if on_progress is not None:
            on_progress(WARM_UP, total - 1, total, 0.0)
        self.pipe.capture()  # on the CPU no graphs: replay runs eagerly
        self.pipe.first_replays()
        self.pipe.sync()
        timeline.mark("graphs captured")
        self.reset()
        if on_progress is not None:
            on_progress(WARM_UP, total, total, 0.0)

    def _warm_up_steps(self) -> list[Callable[[], None]]:
        """A whole chunk, then odd lengths from about the chunk down to a few rows (each new
        GEMM height may load another cuBLAS kernel; the last ones take the GEMV path; with the
        prefill graphs each is padded to a graph's length, whose graph it captures), once at a
        later position, and the sampler."""
        chunk, ctx = self.plan.prefill_chunk, self.plan.ctx
        n = min(chunk, ctx)
        pipe = self.pipe
        steps = [lambda: pipe.run_chunk([0] * n, 0)]
        rows = n - 1
        while rows >= 3:
            steps.append(lambda r=rows | 1: pipe.run_chunk([0] * min(r, n), 0))
            rows //= 2
        # a later reply starts past its cached prefix: a position that is not a multiple of 16
        odd = max(1, min(n - 1, 51)) | 1
        if odd + n <= ctx:
            steps.append(lambda: pipe.run_chunk([0] * n, odd))
            steps.append(lambda: pipe.run_chunk([0] * odd, odd))
        steps.append(lambda: pipe.sample_prefilled(1))
        return steps

    # --- queries ------------------------------------------------------------------------------
    def memory_report(self) -> list[dict]:
        """Per device: priced, allocated (reserved by the arenas), NVML used before and after,
        the measured runtime overhead; plus load figures."""
        return [dict(r, runner=self.runner, overhead_priced=dl.terms.get("overhead", 0))
                for r, dl in zip(self.pipe.report, self.layout.devices, strict=True)]

    # --- compute ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: Any, stop_ids: set[int],
                 on_token: Callable[[int], bool]) -> GenerationStats:
        """As ChunkedSession.generate; settings the GPU sampler serves (greedy, or top-k from 1
        to spec.launch.SAMPLE_TOP_K with a penalty window up to SAMPLE_LAST_N) draw on the
        device with no host round trip per token, others on the host."""
        before = self._host_stats()
        if decode.served(self, params):
            stats = decode.generate_on_device(self, self._ids, list(prompt_ids), params,
                                              set(stop_ids), on_token)
        else:
            stats = super().generate(prompt_ids, params, stop_ids, on_token)
        self._log_host(before, stats)
        return stats

    def _host_stats(self) -> tuple[float, ...]:
        """(bytes moved between the GPUs and host memory, cache hits, misses, seconds of CPU
        compute of host experts) so far."""
        st = self.pipe.stages
        return (sum(s.host_moved() for s in st), sum(s.cache_hits()[0] for s in st),
                sum(s.cache_hits()[1] for s in st), sum(s.host_cpu_s() for s in st))

    def _log_host(self, before: tuple[float, ...], stats: GenerationStats) -> None:
        # experts in host memory: what the reply moved over PCIe, the cache's hit rate and the
        # CPU's time computing host experts
        if not any(s.host_layers for s in self.pipe.stages):
            return
        moved, hits, misses, cpu_s = (
            a - b for a, b in zip(self._host_stats(), before, strict=True))
        tokens = max(1, stats.prompt_tokens + stats.completion_tokens)
        rate = f"{hits / (hits + misses):.1%}" if hits + misses else "n/a"
        log.info("experts in host memory: %.1f kB moved per token, expert-cache hit rate %s, "
                 "%.2f ms of CPU compute per token", moved / tokens / 1e3, rate,
                 cpu_s / tokens * 1e3)

    def forward(self, ids: list[int], pos0: int, rows: str = "last",
                check: bool = False) -> torch.Tensor | None:
        """ids (one chunk) at positions pos0..; float32 host logits of ``rows`` "all", the
        "last" row, or "none". One token with rows "last" is a decode step (graph replay)."""
        if len(ids) == 1 and rows == "last" and not check:
            self.pipe.set_position(pos0, ids[0])
            self.pipe.step()
            self._host.copy_(self.pipe.stages[-1].buf["logits"][:1])
            return self._host
        if len(ids) > self.plan.prefill_chunk:
            raise ValueError(f"forward takes one chunk of at most {self.plan.prefill_chunk}")
        self.pipe.run_chunk(ids, pos0, head=False, check=_check_layer if check else None)
        if rows == "none":
            return None
        last = self.pipe.stages[-1]
        n = len(ids)
        if rows == "last":
            with on(last.device):
                return last.head(n - 1, 1).to("cpu", copy=True)
        step = last.buf["logits"].shape[0]
        out = torch.empty((n, self.hp.n_vocab), dtype=torch.float32)
        for r0 in range(0, n, step):
            k = min(step, n - r0)
            with on(last.device):
                out[r0:r0 + k].copy_(last.head(r0, k))
        sync(last.device)
        return out

    def close(self) -> None:
        """Free every allocation of this session on every device."""
        self.pipe.free()
        self.tokens.clear()

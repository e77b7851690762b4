"""Stages of a Layout on their devices, run as one pipeline: the hidden state of token t moves
from device to device; the last stage's greedy id goes back to the first.

Devices are CUDA GPUs, or the CPU under TRITON_INTERPRET=1 (CI runs the whole runner there:
no CUDA graphs, no pinned ring, no streams). Loading allocates nothing before every CUDA
device passed the fit check, and a load that fails or is cancelled midway drops every arena it
made on every device before it raises, so the GPUs are left as they were.
"""

from __future__ import annotations

import contextlib
import logging
import time
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from engine.process.protocol import COMPILE, DEQUANT_CACHE
from engine.runtime import timeline
from engine.runtime.gpu import host_arena as gpu_host
from engine.runtime.gpu import memory as gpu_memory
from engine.runtime.gpu import precompile
from engine.runtime.gpu.layers import dry_pass_layers
from engine.runtime.gpu.load import load_tensors
from engine.runtime.gpu.stage import DTYPES, GpuStage, allocate
from engine.runtime.gpu.stage_graph import graph_rows
from engine.runtime.options import RunnerOptions
from spec.errors import CarveError

log = logging.getLogger("carve.engine")

# the pipelines of this process not yet freed: the last one to go also frees cuBLAS's workspaces
_LIVE: weakref.WeakSet = weakref.WeakSet()


def torch_device(spec: Any) -> torch.device:
    return torch.device("cpu") if spec.index < 0 else torch.device("cuda", spec.index)


def on(dev: torch.device) -> contextlib.AbstractContextManager:
    """Triton launches on the current CUDA device; the CPU has none."""
    return torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def free_cublas_workspaces() -> None:
    """Hand back the workspaces cuBLAS keeps per (handle, stream) (32 MiB each on sm_90):
    each stage's prefill stream makes one, and they outlive the stream's pipeline, so a
    reload in the same process would hold one more each time. Only with no pipeline left:
    a captured graph's GEMMs keep their workspace's address. The caller has synchronized the
    devices it used."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


class _OnDevice:
    """A DeviceLayout as `allocate` should see it: the arenas on the device, not the host's."""

    def __init__(self, dl: Any) -> None:
        self.arenas = dl.device_arenas


class GpuPipeline:
    def __init__(self, model: Any, hp: Any, layout: Any, on_progress=None, cancelled=None,
                 devices: list[torch.device] | None = None,
                 options: RunnerOptions = RunnerOptions(), defer_fill: bool = False) -> None:
        """Allocate, load and build every stage, then fill the dequant caches (``defer_fill``:
        the caller calls `fill` instead, after its own precompile round; it then owns
        ``compiler`` and closes it)."""
        self.model, self.hp, self.layout, self.options = model, hp, layout, options
        self.head_row = 0  # the logits row of the last prefill's head (prefill)
        self.devices = devices or [torch_device(dl.device) for dl in layout.devices]
        self.stages: list[GpuStage] = []
        self.arenas: list[list[torch.Tensor]] = []
        self.spans: list[dict[str, torch.Tensor]] = []
        self.host_arenas: list[tuple[torch.Tensor, bool]] = []  # (allocation, pinned)
        self.report: list[dict] = []
        self.meter = gpu_memory.Meter([d.index for d in self.devices if d.type == "cuda"])
        cuda = [d.index for d in self.devices if d.type == "cuda"]
        _LIVE.add(self)
        # a cold kernel cache: the load's kernels compile on every core (gpu/precompile.py),
        # in rounds (the dequant-cache fills, the session's warm-up)
        self.compiler = precompile.Compiler(
            on_compiled=None if on_progress is None else
            lambda done, n: on_progress(COMPILE, done, n, 0.0),
            cancelled=cancelled) if cuda else None
        if cuda:
            timeline.set_probe(lambda i=cuda[0]: gpu_memory.nvml_use(i)[0])
            timeline.mark("NVML")
        err: BaseException | None = None
        try:
            gpu_memory.check_free(layout, self.devices, self.meter)
            gpu_host.check_host(layout)
            timeline.mark("CUDA context, fit check")
            for dl, dev in zip(layout.devices, self.devices, strict=True):
                self._load_stage(dl, dev, on_progress, cancelled)
            if not defer_fill:
                self.fill(on_progress, cancelled)
                if self.compiler is not None:
                    self.compiler.close()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after the memory is gone
            if not isinstance(exc, CarveError):
                log.error("load failed:\n%s", traceback.format_exc())
            # the traceback's frames hold views into the arenas: drop it with them
            exc.__traceback__ = None
            exc.__context__ = exc.__cause__ = None
            err = exc
        if err is not None:
            self.free()
            raise err

    def _load_stage(self, dl: Any, dev: torch.device, on_progress, cancelled) -> None:
        sync(dev)
        before = torch.cuda.memory_reserved(dev) if dev.type == "cuda" else 0
        arenas: list[torch.Tensor] = []
        spans: dict[str, torch.Tensor] = {}
        self.arenas.append(arenas)  # owned by self before the first byte: free() finds them
        self.spans.append(spans)
        host = len(self.host_arenas)
        try:
            allocate(_OnDevice(dl), dev, arenas, spans)
            gpu_host.allocate_host(dl, dev.type == "cuda", self.host_arenas, spans, DTYPES)
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise CarveError(
                f"{dev} ({dl.device.label}): could not allocate arena {len(arenas) + 1} of "
                f"{len(dl.arenas)} ({first[:160]}); another process may have taken memory: lower "
                f"--ctx, raise --cache-reserve or move layers to another device") from None
        reserved = torch.cuda.memory_reserved(dev) - before if dev.type == "cuda" else sum(
            a.numel() for a in arenas)
        timeline.mark(f"{dev}: arenas allocated")
        names = [s.name for a in dl.arenas for s in a.spans if s.purpose in ("weights", "globals")]
        nbytes, sec = load_tensors(self.model, names, spans, dev, on_progress, cancelled)
        on_host = [s.name for a in dl.arenas for s in a.spans if s.purpose == "host_experts"]
        if on_host:  # straight from the file into the host arena: no copy to make
            t0 = time.perf_counter()
            # the CPU layouts (host_compute "cpu") are made from the file's bytes as they come
            plain, nb = gpu_host.load_cpu_layouts(self.model, on_host, spans,
                                                  self.layout.plan.host_compute, cancelled)
            nbytes, sec = nbytes + nb, sec + time.perf_counter() - t0
            hb, hs = load_tensors(self.model, plain, spans, "cpu", on_progress, cancelled)
            nbytes, sec = nbytes + hb, sec + hs
            if dev.type == "cuda":  # the stage's scan on the device reads only its own memory
                gpu_host.check_scales(self.model, plain, spans)
            # host_compute "both": the CPU's layouts beside the file's bytes, made from them
            # (none where the plan counted on the CPU's native kernel reading the file's bytes)
            gpu_host.fill_cpu_copies(self.model, on_host, spans, cancelled)
        timeline.mark(f"{dev}: weights")
        for name, t in spans.items():
            if name.startswith("kv."):
                t.zero_()
        plan = self.layout.plan
        stage = GpuStage(self.hp, self.model, dl, spans, dev, plan.ctx, plan.prefill_chunk,
                         self.options, plan.host_compute,
                         all(p for _, p in self.host_arenas[host:]))
        self.stages.append(stage)
        timeline.mark(f"{dev}: stage built")
        self.report.append({
            "index": dl.device.index, "name": dl.device.name, "layers": list(dl.layers),
            "priced": dl.allocated, "allocated": reserved, "reserved": reserved,
            "load_bytes": nbytes, "load_s": sec, "host_priced": dl.host,
            "host_allocated": sum(b.numel() for b, _ in self.host_arenas[host:]),
            "host_pinned": sum(b.numel() for b, p in self.host_arenas[host:] if p)})

    @contextlib.contextmanager
    def dry_pass(self) -> Iterator[None]:
        """A precompile's dry pass: forward runs only the layers whose launches no earlier
        layer of the stage made (`layers.dry_pass_layers`); the variants are the same."""
        for st in self.stages:
            st.dry_runs = dry_pass_layers(st.layers)
        try:
            yield
        finally:
            for st in self.stages:
                st.dry_runs = None

    def fill_steps(self) -> list[Callable[[], None]]:
        """Each stage's dequant-cache fill as a dry pass runs it (`GpuStage.fill_dequant_cache`
        with ``dry``: the same launches, no byte into a weight span)."""

        def dry(st: GpuStage) -> None:
            with on(st.device):
                st.fill_dequant_cache(dry=True)

        return [lambda st=st: dry(st) for st in self.stages]

    def fill(self, on_progress=None, cancelled=None, precompiled: bool = False) -> None:
        """Fill every stage's dequant cache (the scan for non-finite scales first), each
        after a precompile round of its own unless ``precompiled`` (the caller's round had
        the fills' dry passes)."""
        for i, (stage, step) in enumerate(zip(self.stages, self.fill_steps(), strict=True)):
            dev = stage.device
            if cancelled is not None and cancelled():
                raise CarveError("load cancelled")
            if not precompiled and self.compiler is not None and self.compiler.active:
                with self.dry_pass():
                    self.compiler.round([step], sync=lambda d=dev: sync(d))
                timeline.mark(f"{dev}: {self.compiler.summary()}")
            t0 = time.perf_counter()
            if on_progress is not None:
                on_progress(DEQUANT_CACHE, 0, 1, 0.0)
            with on(dev):
                cached = stage.fill_dequant_cache()
            sync(dev)
            timeline.mark(f"{dev}: dequant cache")
            if on_progress is not None:
                on_progress(DEQUANT_CACHE, 1, 1, 0.0)
            self.report[i].update(dequant_cached=cached, dequant_s=time.perf_counter() - t0)

    def free(self) -> None:
        """Drop every arena on every device (and every view into them), then hand the cached
        blocks back to the driver."""
        if self.compiler is not None:
            self.compiler.close()
        for st in self.stages:
            st.release()
        self.stages.clear()
        for spans in self.spans:
            spans.clear()
        for arenas in self.arenas:
            arenas.clear()
        self.spans.clear()
        self.arenas.clear()
        _LIVE.discard(self)
        if torch.cuda.is_initialized():
            try:
                for d in {d for d in self.devices if d.type == "cuda"}:
                    torch.cuda.synchronize(d)
                if not _LIVE:
                    free_cublas_workspaces()
                torch.cuda.empty_cache()
            except RuntimeError as exc:  # a sticky CUDA fault: the caller's error says more
                log.error("freeing the arenas: %s", str(exc).splitlines()[0] if str(exc) else exc)
        for buf, pinned in self.host_arenas:  # after the sync: no copy reads them any more
            if pinned:
                gpu_host.unpin(buf)
        self.host_arenas.clear()

    def finish_report(self, remember: bool = True) -> list[dict]:
        """NVML after the load and the measured runtime overhead, per device (call it after
        the warm-up that creates cuBLAS workspaces and CUDA graphs)."""
        gpu_memory.finish(self.report, self.layout, self.devices, self.meter, remember)
        return self.report

    def _send(self, i: int, n: int) -> None:
        a, b = self.stages[i - 1], self.stages[i]
        b.buf["hidden"][:n].copy_(a.buf["hidden"][:n], non_blocking=True)
        b.buf["positions"][:n].copy_(a.buf["positions"][:n], non_blocking=True)

    def chunk_rows(self, n: int, check: Callable | None = None) -> int:
        """The rows a prefill chunk of n runs as: with every stage on prefill graphs (and no
        NaN hunt), n padded to the next graph's length (stage_graph.graph_rows); else n."""
        if n < 1 or check is not None or not all(st.graphs_chunks() for st in self.stages):
            return n
        return graph_rows(n, self.stages[0].buf["positions"].shape[0])

    def run_chunk(self, ids: list[int], pos0: int, head: bool = True,
                  check: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """One prefill chunk (len(ids) <= the priced chunk) at positions pos0.. through every
        stage; the last stage heads the last rows unless ``head`` is False. Padded to
        ``chunk_rows``: the padding rows repeat the last token at the last position, which the
        KV store recognizes and skips (carve_kernels/kv_cache.py), so nothing of them stays."""
        first = self.stages[0]
        n = len(ids)
        rows = self.chunk_rows(n, check)
        first.buf["tokens"][:rows].copy_(torch.tensor(ids + ids[-1:] * (rows - n),
                                                      dtype=torch.int64))
        first.buf["positions"][:rows].copy_(
            torch.arange(pos0, pos0 + rows, dtype=torch.int64).clamp_(max=pos0 + n - 1))
        for i, st in enumerate(self.stages):
            if i:
                self._send(i, rows)
            with on(st.device):
                st.forward_chunk(rows, pos0, head=head, check=check, real=n)

    def prefill(self, ids: list[int], pos0: int = 0) -> int:
        """Run ids at positions pos0.. in chunks; returns the greedy next id."""
        chunk = self.layout.plan.prefill_chunk
        for c0 in range(0, len(ids), chunk):
            self.run_chunk(ids[c0:c0 + chunk], pos0 + c0)
        last = self.stages[-1]
        n_last = len(ids) - (len(ids) - 1) // chunk * chunk
        row = self.head_row = min(n_last, last.buf["logits"].shape[0]) - 1
        nxt = int(torch.argmax(last.buf["logits"][row]))
        self.set_position(pos0 + len(ids), nxt)
        return nxt

    def capture(self) -> None:
        for st in self.stages:
            with on(st.device):
                st.capture()
        # the eager warm-up advanced positions and wrote one KV row: callers prefill or
        # set_position next

    def first_replays(self) -> None:
        """Replay once every CUDA graph the load captured and has not replayed (each stage's
        prefill graphs, then a decode step): a graph's first launch uploads it to the GPU,
        several ms that the first reply would otherwise pay. Their results are the warm-up's,
        thrown away as it is (callers prefill or set_position next)."""
        if not all(st.on_cuda for st in self.stages):
            return
        for st in self.stages:
            with on(st.device):
                st.replay_prefill_graphs()
        self.step()

    def clear_buffers(self) -> None:
        """Zero every stage's working buffers (GpuStage.clear_buffers)."""
        for st in self.stages:
            with on(st.device):
                st.clear_buffers()

    def decode_eager(self) -> None:
        """One eager decode step through every stage (no graphs, no hand-over between them:
        precompile's dry pass only needs each stage's launches)."""
        for st in self.stages:
            with on(st.device):
                st.decode_eager()

    def set_position(self, pos: int, token: int = 0) -> None:
        """The next decode step runs ``token`` at ``pos`` (device writes, no allocation)."""
        for st in self.stages:
            st.buf["positions"][:1].fill_(pos)
        self.stages[0].buf["tokens"][:1].fill_(token)

    def step(self) -> None:
        """One decode token through every stage (no host sync)."""
        for i, st in enumerate(self.stages):
            if i:
                b = st.buf["hidden"]
                b[:1].copy_(self.stages[i - 1].buf["hidden"][:1], non_blocking=True)
            with on(st.device):
                st.replay()
        if len(self.stages) > 1:
            self.stages[0].buf["tokens"][:1].copy_(self.stages[-1].next_id, non_blocking=True)

    def sample_prefilled(self, pos: int) -> None:
        """Draw the next id from the last prefilled row's logits (buf.logits[0], where the head
        left them) with the GPU sampler and make it the next decode step's input at ``pos``
        (device work only, no host sync)."""
        last = self.stages[-1]
        with on(last.device):
            last.sample_next()
        if len(self.stages) > 1:
            self.stages[0].buf["tokens"][:1].copy_(last.next_id, non_blocking=True)
        for st in self.stages:
            st.buf["positions"][:1].fill_(pos)

    def greedy(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            self.step()
            out.append(int(self.stages[-1].next_id))
        return out

    def sync(self) -> None:
        for st in self.stages:
            sync(st.device)

"""Experts in host memory on a GPU stage (DESIGN.md "Experts in host memory").

A stage's host arenas (the Layout's purposes `engine.planning.host.HOST_PURPOSES`) are one
pageable allocation each, pinned in place with cudaHostRegister, so that the pinned bytes are
exactly the priced ones (torch's pinned allocator would round each up to a power of two:
gpu/host_arena.py). A layer whose experts live there runs its router and top-k on the GPU,
then `HostExperts.run`.

The expert ids come down first. Where the stage has expert-cache slots (the Layout's span
`expert_cache`, shared out evenly among its host layers, `SlotCache`) and the layer's share can
hold every expert the rows chose, the missing ones are copied from host memory into slots
(least recently used out), the ids are rewritten as slots, and the GPU runs its usual expert
kernels on the slots. Else, where the plan runs host experts on the GPU (the span
`expert_stream`, room for one layer's expert tensors, `Stream`), the experts the rows chose
are copied into it at their own places, neighbours in one copy (a long prompt's chunk, which
chooses them all, the whole layer in one copy per tensor; gpt-oss's expert biases beside
them), and the kernels run there; a chunk that ran there leaves the layer's slots
holding what its last rows chose, copied from the span on the device (`SlotCache.seed`: the
prompt's routing prefetches for the reply). Otherwise (the plan's host_compute "cpu", and decode
rows under "both" where the arenas could not be pinned) the normed rows and weights go down to
pinned buffers too, the CPU engine's `ops.experts` runs the routed experts on them from the
CPU's own layouts (engine/runtime/models/cpu_experts.py; the file's blocks, dequantized per
routed expert into a priced scratch, for types without one), and the weighted sum goes back up
and onto proj. Under "both" on pinned arenas a decode row is read in place and split: the CPU
computes its share of the routed experts (`HostExperts.serve`, the share from
gpu/host_share.py) while the GPU gathers the rest, inside the step's graph.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from engine.hardware import native
from engine.planning.host import CPU_PREFIX, HOST_PURPOSES
from engine.runtime.gpu.host_slots import SlotCache, Stream
from engine.runtime.models import cpu_experts, cpu_native, ops
from spec.errors import CarveError

log = logging.getLogger("carve.engine")
# above this many rows a host layer copies all its experts to the GPU (prefill), at most this
# many only the chosen ones (decode's GEMV path: gpu/layers.py GEMV_ROWS)
STREAM_ROWS = 8


def host_layers(dl: Any) -> set[int]:
    """The layers of a DeviceLayout whose experts live in its host arenas."""
    return {int(s.name.removeprefix(CPU_PREFIX).split(".")[1]) for a in dl.arenas
            if a.purpose == HOST_PURPOSES[0] for s in a.spans}


def host_experts(hp: Any, model: Any, spans: dict[str, torch.Tensor],
                 layers: list[int], host_compute: str = "gpu", mapped: bool = False
                 ) -> dict[int, HostExperts]:
    """The stage's host layers, each with its share of the expert cache (the span
    "expert_cache" [slots, slot bytes], split evenly in layer order, at most n_expert slots a
    layer; none for experts with biases, whose slots would need their bias rows too: those
    run from the staging span). ``mapped`` (pinned host arenas, a CUDA stage): with
    host_compute "gpu", a layer without slots has decode's kernels read its routed experts in
    host memory where they lie (`HostExperts.in_place`)."""
    out = {i: HostExperts(hp, model, spans, i, host_compute) for i in layers}
    if layers:
        spans["hbuf.flags"].zero_()  # no ticket raised, none answered
    stream = spans.get("expert_stream")
    if stream is not None:
        for h in out.values():
            h.stream = Stream(stream, h.mats, h.bias_bytes)
    cache = spans.get("expert_cache")
    if cache is not None and layers:
        _share_slots(hp, out, layers, cache)
    lost = [i for i, h in out.items() if host_compute == "both" and not h.cpu_ready]
    if lost:
        log.warning("host experts: the CPU cannot compute layer(s) %s (their types have no CPU "
                    "layout here and the native kernel %s): the GPU reads their routed experts "
                    "over PCIe", ",".join(map(str, lost)),
                    f"is not available ({native.why_not()})" if native.why_not()
                    else "does not multiply them")
    if mapped and host_compute in ("gpu", "both"):
        # ("both": decode's rows read in place too, split with the CPU where it has layouts:
        # `HostExperts.set_cpu_share`, chosen at load by gpu/host_share.py)
        for h in out.values():
            if h.cache is None:
                h.read_in_place()
    return out


def _share_slots(hp: Any, out: dict[int, HostExperts], layers: list[int],
                 cache: torch.Tensor) -> None:
    slots, slot_bytes = cache.shape
    flat = cache.reshape(-1)
    start = 0
    for j, i in enumerate(layers):
        n = slots // len(layers) + (j < slots % len(layers))
        h = out[i]
        if h.biases is None and n:
            h.cache = SlotCache(flat[start * slot_bytes:(start + n) * slot_bytes],
                                min(n, hp.n_expert), h.mats)
        start += n


class HostExperts:
    """One layer's routed experts in host memory and the pinned buffers its CPU compute runs
    on (views into the stage's spans). ``moved``: bytes copied between GPU and host so far."""

    def __init__(self, hp: Any, model: Any, spans: dict[str, torch.Tensor], layer: int,
                 host_compute: str = "gpu") -> None:
        p = f"blk.{layer}."
        self.hp, self.cuda, self.layer = hp, False, layer
        scratch = spans["hbuf.dequant"]
        # host_compute (Plan.host_compute): "gpu" copies the file's bytes into the staging
        # span (or slots) for every row; "cpu" multiplies them on the CPU, from its own layouts
        # (the file's bytes where a type has none); "both": decode rows on the CPU from the
        # file's bytes (the native kernel) or from its layouts (spans cpu.<name> beside them,
        # where the plan priced them), the staging span for prefill chunks
        names = [p + f"ffn_{n}_exps.weight" for n in ("gate", "up", "down")]
        self.mats: list[Any] = []  # as the GPU's kernels read them (the file's bytes)
        self.cpu_mats: list[Any] | None = None  # as the CPU multiplies them
        if host_compute != "cpu":
            for name in names:
                info = model.tensor(name)
                cols, rows, n_expert = (int(d) for d in info.shape)  # GGUF order
                self.mats.append(ops.QExperts(name, spans[name], info.ggml_type, n_expert,
                                              rows, cols, None, scratch))
        if host_compute == "cpu":
            self.cpu_mats = [cpu_experts.host_matrix(model, n, spans[n], scratch) for n in names]
        elif host_compute == "both" and all(CPU_PREFIX + n in spans for n in names):
            # (the plan makes CPU copies of a layer only when every matrix has a layout and
            # the native kernel does not read the file's bytes itself: a type without one,
            # dequantized per routed expert, would be far slower than copying the chosen
            # experts in, so the GPU takes that layer's decode rows too)
            self.cpu_mats = [cpu_experts.host_matrix(model, n, spans[CPU_PREFIX + n], scratch)
                             for n in names]
        self.biases = None
        self.bias_bytes: list[torch.Tensor] | None = None  # the raw host bytes (the Stream's)
        if p + "ffn_gate_exps.bias" in spans:
            self.bias_bytes = [spans[p + f"ffn_{n}_exps.bias"] for n in ("gate", "up", "down")]
            self.biases = tuple(
                spans[p + f"ffn_{n}_exps.bias"].view(torch.float32).view(hp.n_expert, -1)
                for n in ("gate", "up", "down"))
        # decode's split ("both"): the CPU's share multiplied from the file's bytes by the
        # native kernel (cpu_native) where it has every type, else by torch on the CPU layouts
        self.native: cpu_native.NativeExperts | None = None
        # (under "cpu" too where every matrix is held as the file has it, a type without a CPU
        # layout: decode's rows then skip the dequantizing product, tens of times slower)
        raw = self.mats if host_compute == "both" else [
            m for m in self.cpu_mats or [] if isinstance(m, ops.QExperts)]
        if len(raw) == 3 and host_compute in ("both", "cpu"):
            types = tuple(m.ggml_type for m in raw)
            lib = cpu_native.library() if cpu_native.supported(
                types, hp.act, hp.n_embd, raw[0].rows) else None
            if lib is not None:
                self.native = cpu_native.NativeExperts(
                    lib, [m.raw.view(-1) for m in raw], types, hp.n_embd, raw[0].rows,
                    hp.n_expert, hp.n_expert_used, hp.act, hp.swiglu_limit,
                    list(self.biases) if self.biases else None)
        self.x, self.ids = spans["hbuf.x"], spans["hbuf.ids"]
        self.w, self.y = spans["hbuf.w"], spans["hbuf.y"]
        # the split's ticket and answer (carve_kernels/host_split.py; the stage's one buffer,
        # zeroed by `host_experts`)
        self.flags = spans["hbuf.flags"]
        # decode's split (host_compute "both", experts read in place): the CPU computes the
        # first ``cpu_share`` of a row's routed experts from its layouts while the GPU gathers
        # and computes the rest, in the step's graph; the host answers each step (`serve`)
        self.cpu_share = 0
        self.cache: SlotCache | None = None
        self.stream: Stream | None = None
        # decode's kernels read the routed experts in pinned host memory over PCIe, inside the
        # step's graph (`read_in_place`): the matrices as [n_expert * rows, bytes per row]
        # views of the host spans, their biases, and the bytes one row's experts read
        self.in_place: list[torch.Tensor] | None = None
        self.in_place_biases: list[torch.Tensor] | None = None
        self.row_bytes = 0
        # decode's in-place reads as a gather into the staging span first (wide sequential
        # reads), then the expert kernels there; else the kernels read host memory themselves
        self.gather = False
        self.moved = 0  # bytes copied between the GPU and host memory
        self.cpu_s = 0.0  # seconds the CPU spent computing this layer's experts
        self.wait_s = 0.0  # seconds the host waited for the GPU's row (a split layer's)
        # the load's timing behind the split: seconds for the CPU's 1..k experts, the PCIe's
        # for the GPU's k..0 (`host_share.split_shares`)
        self.split_model: tuple[list[float], list[float]] | None = None

    @property
    def cpu_ready(self) -> bool:
        """Whether the CPU can compute this layer's routed experts: the native kernel reads
        the file's bytes, or the CPU has layouts of its own."""
        return self.native is not None or self.cpu_mats is not None

    @property
    def split(self) -> bool:
        """Whether decode's row is split between the CPU and the GPU (`serve` answers it)."""
        return self.in_place is not None and self.cpu_share > 0

    def set_cpu_share(self, c: int) -> None:
        """The CPU computes the first ``c`` of each decode row's routed experts (0: the GPU
        reads them all over PCIe); the bytes a replay moves follow."""
        k = self.hp.n_expert_used
        if self.in_place is None or not self.cpu_ready or not 0 <= c <= k:
            raise ValueError(f"layer's CPU share {c} of {k} experts: the CPU cannot compute "
                             "this layer's experts or it is out of range")
        self.cpu_share = c
        self.row_bytes = self.row_moved(c)

    def row_moved(self, c: int) -> int:
        """Bytes one decode row read in place moves between GPU and host with ``c`` of its
        experts on the CPU: the GPU's k - c experts over PCIe, and for a split row the normed
        row down, its ids and weights down and the f32 sum up."""
        k = self.hp.n_expert_used
        per = sum(m.raw.numel() // m.n_expert for m in self.mats) + sum(
            b.numel() // self.hp.n_expert for b in self.bias_bytes or [])
        return (k - c) * per + (self.x[:1].nbytes + self.y[:1].nbytes + 8 * c if c else 0)

    def serve(self, timeout_s: float = 60.0) -> None:
        """Answer the GPU's next ticket for this layer (`carve_kernels.host_split`): wait
        until it has published its row, compute the CPU's share of the routed experts into
        the pinned sum, then answer. Where the CPU fails, the answer still goes (the sum
        NaN), so the GPU never waits for it, and the error is raised."""
        flags = self.flags.numpy()
        deadline = None
        spins = 0
        start = time.perf_counter()
        while flags[0] == flags[1]:
            spins += 1
            if spins % 4096 == 0:
                now = time.perf_counter()
                deadline = deadline or now + timeout_s
                if now > deadline:
                    raise CarveError(f"host experts: the GPU did not publish its row within "
                                     f"{timeout_s:.0f} s (the decode step stopped)")
        t0 = time.perf_counter()
        self.wait_s += t0 - start
        try:
            self.cpu_row(self.x[0], self.ids[0, :self.cpu_share], self.w[0, :self.cpu_share],
                         self.y[0])
        except BaseException:
            self.y[:1].fill_(float("nan"))
            flags[1] = flags[0]
            raise
        flags[1] = flags[0]
        self.cpu_s += time.perf_counter() - t0
        self.check_answered()

    def check_answered(self) -> None:
        """Raise CarveError where the GPU gave up waiting for an answer (that step's sum was
        lost), the mark cleared."""
        flags = self.flags.numpy()
        if flags[2]:
            flags[2] = 0
            raise CarveError(f"host experts of layer {self.layer}: the GPU stopped waiting for "
                             "the CPU's share of a decode step; the host was too slow or busy")

    def serve_layer(self, xf: torch.Tensor) -> Any:
        """This split layer as the native kernel's `StepServer` answers it (xf: float32
        [n_embd] of room, shared by a stage's layers)."""
        return self.native.serve_layer(self.flags, self.x[0], self.ids[0], self.w[0], self.y[0],
                                       xf, self.cpu_share)

    def add_times(self, wait_s: float, cpu_s: float) -> None:
        """A `StepServer` call's seconds for this layer: waiting for its row, computing."""
        self.wait_s += wait_s
        self.cpu_s += cpu_s

    def cpu_row(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor,
                y: torch.Tensor) -> None:
        """y [n_embd] float32 = one row's experts ``ids`` (int32 [c]) weighted by ``w``
        (float32 [c]) of x [n_embd], on the CPU: the native library on the file's bytes, else
        torch on the CPU layouts."""
        if self.native is not None:
            self.native.run(x.float(), ids, w, y)
            return
        g, u, d = self.cpu_mats
        hp = self.hp
        y.copy_(ops.experts(x.float().view(1, -1), ids.long().view(1, -1), w.view(1, -1), g, u,
                            d, hp.act, hp.swiglu_limit, self.biases)[0])

    def read_in_place(self) -> None:
        """Have decode's kernels read this layer's experts where they lie: host memory the
        driver has pinned is mapped into the GPU's address space, so a kernel reads only the
        routed experts' bytes over PCIe, with no copy, no wait on the host and no break in
        the step's graph (prefill chunks still copy their chosen experts into the staging
        span: they read most experts)."""
        self.in_place = [m.raw.view(m.n_expert * m.rows, -1) for m in self.mats]
        if self.bias_bytes is not None:
            self.in_place_biases = [b.view(torch.float32) for b in self.bias_bytes]
        # CARVE_HOST_READ=direct: the expert kernels read host memory themselves
        self.gather = (self.stream is not None
                       and os.environ.get("CARVE_HOST_READ", "gather") != "direct")
        self.row_bytes = self.row_moved(0)

    def run(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
            staging: torch.Tensor, accumulate: bool,
            gpu: Callable[[list[torch.Tensor], int, torch.Tensor, list[torch.Tensor] | None],
                          None] | None = None) -> None:
        """out (+)= the routed experts of normed rows ``x`` [n, n_embd] chosen as ``ids`` /
        ``w`` [n, k] (on the stage's device). ``staging`` [n, n_embd] float32 on the device
        takes the sum on its way up (buf.moe_out's first rows: free in this layer). ``gpu(
        (gate, up, down), n, ids, biases)``: the stage's expert kernels on the cache's slots
        (``ids`` rewritten as slots) when they can hold every chosen expert, or on the staging
        span (``biases`` there too, gpt-oss; else None: the layer's own)."""
        n = x.shape[0]
        hx, hids, hw, hy = self.x[:n], self.ids[:n], self.w[:n], self.y[:n]
        streamed = self.stream is not None and gpu is not None and (
            not self.cpu_ready or n > STREAM_ROWS)  # "both": the CPU takes decode rows
        on_cpu = not streamed and (self.cache is None or gpu is None)
        hids.copy_(ids, non_blocking=True)
        if on_cpu:  # the rows come down with the ids: one wait
            hx.copy_(x, non_blocking=True)
            hw.copy_(w, non_blocking=True)
        self._wait(x)  # the ids are down
        self.moved += hids.nbytes
        if self.cache is not None and gpu is not None:
            chosen = hids.reshape(-1).tolist()
            before = self.cache.copied
            slots = self.cache.place(sorted(set(chosen)))
            if slots is not None:
                hids.copy_(torch.tensor([slots[e] for e in chosen], dtype=hids.dtype).view(n, -1))
                ids.copy_(hids, non_blocking=True)
                self.moved += hids.nbytes + self.cache.copied - before
                gpu(self.cache.views, self.cache.n, ids, None)
                return
        if streamed:
            # only the experts the rows chose cross PCIe (a short prompt's few, a long one's
            # every expert in one copy per tensor)
            chosen = sorted(set(hids.reshape(-1).tolist()))
            self.moved += self.stream.fill(None if len(chosen) == self.stream.n else chosen)
            gpu(self.stream.views, self.stream.n, ids, self.stream.biases)
            if n > STREAM_ROWS and self.cache is not None:
                # the router's choices for the prompt's last rows: the cache's slots hold them
                # for the reply's first tokens (copied from the span just filled)
                self.cache.seed(self.stream.views, hids.tolist())
            return
        if not on_cpu:  # the expert cache could not hold them
            hx.copy_(x, non_blocking=True)
            hw.copy_(w, non_blocking=True)
            self._wait(x)  # the rows are down
        t0 = time.perf_counter()
        if self.native is not None and n <= STREAM_ROWS:  # decode's rows, one call each
            for r in range(n):
                self.native.run(hx[r].float(), hids[r], hw[r], hy[r])
        else:
            g, u, d = self.cpu_mats or self.mats
            hp = self.hp
            hy.copy_(ops.experts(hx.float(), hids.long(), hw, g, u, d, hp.act, hp.swiglu_limit,
                                 self.biases))
        self.cpu_s += time.perf_counter() - t0
        staging.copy_(hy, non_blocking=True)
        if accumulate:
            out.add_(staging)
        else:
            out.copy_(staging)
        self.moved += hx.nbytes + hw.nbytes + hy.nbytes

    @staticmethod
    def _wait(x: torch.Tensor) -> None:
        if x.device.type == "cuda":
            torch.cuda.current_stream(x.device).synchronize()

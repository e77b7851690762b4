"""How a host layer's decode row is split between the CPU and the GPU (host_compute "both",
DESIGN.md "Experts in host memory"): the CPU's share of each row's routed experts, set by
``CARVE_CPU_EXPERTS`` or chosen at load from the CPU's and the PCIe's timed rates
(`split_shares`); `HostExperts.serve` (gpu/host.py) then computes it at every step.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from engine.runtime.gpu.host import HostExperts
from spec.errors import CarveError

log = logging.getLogger("carve.engine")

# the time a split decode step's hand-over adds to the CPU's side (the ticket's fence and
# PCIe write, the host's polling, its answer crossing back): a few round trips over PCIe
SPLIT_OVERHEAD_S = 40e-6
# and to the GPU's, per split layer: measured on an H100 host (16 Xeon cores, Qwen3-30B-A3B
# at 11 GiB, 2026-12-05, `carve bench --trace`) the publish took ~56 us more than the gather
# it shortened saved, and the kernel after the wait waited ~90 us for the host's answer, whose
# CPU time (~0.3 ms for one expert) was shorter than the GPU's share: the ticket reached the
# host late
SPLIT_GPU_S = 150e-6
# the gather's rate against a plain host-to-device copy's (DESIGN.md: 90.5 % measured)
GATHER_RATE = 0.9


def split_shares(hp: Any, hosts: list[HostExperts], device: torch.device) -> dict[int, int]:
    """host_compute "both": how many of a decode row's k routed experts the CPU computes on
    each host layer read in place (`HostExperts.set_cpu_share`), the rest crossing PCIe to
    the GPU at the same time. ``CARVE_CPU_EXPERTS``: that many on every layer; else (auto) on
    a GPU the share that finishes soonest, max(CPU time of c experts + the hand-over, PCIe
    time of the other k - c) + the GPU's side of the hand-over (none for c = 0), from the
    CPU's time on the layer's own layouts (timed here on random experts, per set of types)
    and a copy's rate from the layer's pinned bytes to the GPU (timed here too); under the
    interpreter all k (no PCIe to split with). Returns the shares by layer."""
    split = [h for h in hosts if h.in_place is not None and h.cpu_ready]
    if not split:  # (no "both" layer read in place: nothing to split, the variable unread)
        return {}
    k = hp.n_expert_used
    text = os.environ.get("CARVE_CPU_EXPERTS", "auto").strip().lower() or "auto"
    if text != "auto":
        try:
            c = int(text)
        except ValueError:
            c = -1
        if not 0 <= c <= k:
            raise CarveError(f"CARVE_CPU_EXPERTS={text!r}: expected auto or a count from 0 to "
                             f"{k} (the experts a token routes to)")
        shares = dict.fromkeys(split, c)
    elif device.type != "cuda":
        shares = dict.fromkeys(split, k)
    else:
        shares = {}
        rate = _copy_rate(split[0], device)
        cpu: dict[tuple, list[float]] = {}
        for h in split:
            key = (h.native is not None, *((m.layout, m.rows, m.cols) for m in h.cpu_mats or []),
                   *(m.ggml_type for m in h.mats))
            if key not in cpu:
                cpu[key] = _cpu_times(hp, h)
            per = sum(m.raw.numel() // m.n_expert for m in h.mats)
            gpu = [(k - c) * per / (GATHER_RATE * rate) for c in range(k + 1)]
            cost = [gpu[0]] + [max(cpu[key][c - 1] + SPLIT_OVERHEAD_S, gpu[c]) + SPLIT_GPU_S
                               for c in range(1, k + 1)]
            shares[h] = min(range(k + 1), key=cost.__getitem__)
            h.split_model = (cpu[key], gpu)
        log.info("host experts: a copy to the GPU at %.1f GB/s; the CPU's share of each "
                 "decode row's %d experts: %s", rate / 1e9, k,
                 ", ".join(f"{c}" for c in shares.values()))
    for h, c in shares.items():
        h.set_cpu_share(c)
    return {h.layer: c for h, c in shares.items()}


def _copy_rate(h: HostExperts, device: torch.device) -> float:
    """Bytes a second a copy of k experts of ``h``'s gate tensor reaches from its pinned
    host span to the GPU (into the staging span, which "both" prices and nothing uses while
    the load runs; the best of 4)."""
    m, dst = h.mats[0], h.stream.views[0].view(-1)
    n = min(m.raw.numel(), h.hp.n_expert_used * (m.raw.numel() // m.n_expert))
    src = m.raw.view(-1)[:n]
    best = float("inf")
    for _ in range(4):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst[:n].copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b) / 1e3)
    return n / best


def _cpu_times(hp: Any, h: HostExperts) -> list[float]:
    """Seconds the CPU takes for 1..k of ``h``'s experts on one row, as `HostExperts.serve`
    computes them: the best of 3 rounds over c = 1..k (random distinct experts each time),
    after one untimed round, so that no one-off cost (the thread pool's start, a first touch of
    the span's pages) lands on one c alone: on an H100 host, gpt-oss-20b's c = 1 was once timed
    at 13.9 ms against c = 2's 1.4 ms, and its split never ran."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(hp.n_embd, generator=gen)
    y = torch.empty(hp.n_embd)
    k = hp.n_expert_used
    best = [float("inf")] * k
    for rnd in range(4):
        for c in range(1, k + 1):
            ids = torch.randperm(hp.n_expert, generator=gen)[:c].to(torch.int32)
            w = torch.full((c,), 1.0 / c)
            t0 = time.perf_counter()
            h.cpu_row(x, ids, w, y)
            if rnd:
                best[c - 1] = min(best[c - 1], time.perf_counter() - t0)
    return best

"""The GPU runner's memory accounting: the fit check just before allocating, and what the load
really cost per device (torch's reserved bytes, NVML before and after, the runtime overhead it
implies, remembered for the next price).

A Layout was priced against the free memory of some earlier moment; another process may have
taken memory since. The check compares each device's priced total (arenas + the runtime
overhead the price used) with what is free now plus the part of that overhead this process
already holds (its CUDA context), before the first arena anywhere is allocated.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from spec.errors import CarveError

log = logging.getLogger("carve.engine")
GIB, MIB = float(1 << 30), float(1 << 20)

# the order a device's bytes are spent in, and what to change when that term no longer fits
_TERMS = (
    ("overhead", "the runtime overhead", "move the split: fewer layers on {label}"),
    ("weights", "the weights", "move the split: fewer layers on {label}"),
    ("experts", "the experts", "move the split: fewer layers on {label}"),
    ("globals", "the embeddings/output head", "move the split: fewer layers on {label}"),
    ("buffers", "the activation buffers", "lower the prefill chunk"),
    ("kv", "the KV cache", "lower --ctx or use --kv q8_0"),
    ("rounding", "the arena rounding", "use --arena packed"),
    ("dequant_cache", "the dequant cache",
     "re-plan (the cache shrinks to what is free) or raise --cache-reserve"),
)


def _size(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / MIB:.0f} MiB"


def has_context(index: int) -> bool:
    """Whether this process already holds a CUDA context on the device."""
    probe = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if probe is not None:
        return bool(probe(index))
    return torch.cuda.is_initialized()


def nvml_use(index: int) -> tuple[int | None, int | None]:
    """(device used bytes, bytes this process uses) from NVML for CUDA device ``index``;
    None where NVML has no answer (no driver library, per-process figures hidden)."""
    from engine.hardware.devices import snapshot

    for s in snapshot():
        if s.cuda_index == index:
            own = next((p.used for p in s.processes if p.pid == os.getpid()), None)
            return s.used, own
    return None, None


class Meter:
    """NVML per CUDA device before anything of the load, so that the process's own use can be
    told apart where NVML hides per-process figures (containers): the device's used bytes
    before this process had a context there."""

    def __init__(self, indices: list[int]) -> None:
        self.before: dict[int, int | None] = {}
        self.baseline: dict[int, int | None] = {}  # used before our context; None: unknown
        for i in sorted(set(indices)):
            used, _ = nvml_use(i)
            self.before[i] = used
            self.baseline[i] = used if not has_context(i) else None

    def own(self, index: int) -> int | None:
        """Bytes this process holds on the device now, per NVML."""
        used, own = nvml_use(index)
        if own is not None:
            return own
        base = self.baseline.get(index)
        return None if used is None or base is None else used - base


def check_free(layout: Any, devices: list[torch.device], meter: Meter) -> None:
    """CarveError naming the device and the term that no longer fits, before any allocation."""
    from engine.hardware.calibration import DEFAULT_PARTS

    need_by: dict[int, list[Any]] = {}
    for dl, dev in zip(layout.devices, devices, strict=True):
        if dev.type == "cuda":
            need_by.setdefault(dev.index, []).append(dl)
    for index, dls in need_by.items():
        free, _ = torch.cuda.mem_get_info(index)  # creates the context when absent
        overhead = max(dl.terms.get("overhead", 0) for dl in dls)
        own = meter.own(index)
        if own is None:  # no NVML figure: the context mem_get_info made is the part held
            own = DEFAULT_PARTS["cuda_context"]
        held = max(0, min(overhead, own - torch.cuda.memory_reserved(index)))
        avail = free + held
        need = sum(dl.allocated for dl in dls) + overhead
        if need <= avail:
            continue
        dl = dls[0]
        label = dl.device.label
        spent, term = 0, _TERMS[-1]
        terms = {k: sum(d.terms.get(k, 0) for d in dls) for k, _, _ in _TERMS}
        terms["overhead"] = overhead
        for t in _TERMS:
            spent += terms[t[0]]
            if spent > avail:
                term = t
                break
        raise CarveError(
            f"cuda:{index} ({label}): another process took memory since the check: "
            f"{_size(avail)} free now, the plan needs {_size(need)}; {term[1]} "
            f"({_size(terms[term[0]])}) no longer fits, {_size(need - avail)} short; "
            f"{term[2].format(label=label)}"
        )


def finish(report: list[dict], layout: Any, devices: list[torch.device], meter: Meter,
           remember: bool = True) -> None:
    """Add NVML after and the measured runtime overhead (NVML own use minus our arenas) to the
    per-stage report, and record the overhead for price() where it could be measured."""
    from engine.hardware import calibration
    from engine.hardware.devices import driver_version

    by_index: dict[int, list[tuple[dict, Any]]] = {}
    for r, dl, dev in zip(report, layout.devices, devices, strict=True):
        r.update(nvml_before=None, nvml_used=None, overhead_measured=None, reserved_total=None)
        if dev.type == "cuda":
            by_index.setdefault(dev.index, []).append((r, dl))
    for index, rows in by_index.items():
        torch.cuda.synchronize(index)
        used, _ = nvml_use(index)
        own = meter.own(index)
        arenas = sum(r["reserved"] for r, _ in rows)
        measured = None if own is None else own - arenas
        total = torch.cuda.memory_reserved(index)  # arenas + cuBLAS workspace, after warm-up
        for r, _ in rows:
            r.update(nvml_before=meter.before.get(index), nvml_used=used,
                     overhead_measured=measured, reserved_total=total)
        dl = rows[0][1]
        if (measured is None or measured <= 0 or not remember or dl.device.simulated
                or dl.device.is_cpu):  # a CPU-priced plan run on a GPU (tests): no GPU name
            continue
        calibration.remember(dl.device.name, driver_version(), calibration.torch_version(),
                             measured, {"torch_beyond_arenas": total - arenas})
        log.info("cuda:%d runtime overhead %.0f MiB (priced %.0f MiB), remembered for pricing",
                 index, measured / MIB, dl.terms.get("overhead", 0) / MIB)

"""Where a load's seconds go: named marks in wall-clock order, reset at each load request and sent
with the Loaded event, so `carve bench --engine` (and anyone reading the log) sees the gaps the
progress stages do not cover: imports, the CUDA context, pricing, allocation, graph capture.

A mark is [label, seconds since the load request] and, once the GPU runner set a probe, the
bytes the first GPU's device memory holds at that moment (NVML). ``CARVE_PROFILE_LOAD=FILE`` also writes a
cProfile of the load to FILE (the engine's own Python, for finding what the marks cannot).
"""

from __future__ import annotations

import time
from collections.abc import Callable

_t0 = time.perf_counter()
_marks: list[list] = []
_probe: list[Callable[[], int | None]] = []


def reset() -> None:
    global _t0
    _t0 = time.perf_counter()
    _marks.clear()
    _probe.clear()


def set_probe(probe: Callable[[], int | None]) -> None:
    """From now on each mark also records ``probe()``: the bytes the first GPU holds (NVML),
    so the marks show which step took the runtime overhead (context, cuBLAS, kernels, graphs)."""
    _probe[:] = [probe]


def mark(label: str) -> None:
    m = [label, round(time.perf_counter() - _t0, 4)]
    if _probe:
        m.append(_probe[0]())
    _marks.append(m)


def marks() -> list[list]:
    return [list(m) for m in _marks]

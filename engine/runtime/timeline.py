"""Where a load's seconds go: named marks in wall-clock order, reset at each load request and sent
with the Loaded event, so `carve bench --engine` (and anyone reading the log) sees the gaps the
progress stages do not cover: imports, the CUDA context, pricing, allocation, graph capture.

A mark is (label, seconds since the load request). ``CARVE_PROFILE_LOAD=FILE`` also writes a
cProfile of the load to FILE (the engine's own Python, for finding what the marks cannot).
"""

from __future__ import annotations

import time

_t0 = time.perf_counter()
_marks: list[tuple[str, float]] = []


def reset() -> None:
    global _t0
    _t0 = time.perf_counter()
    _marks.clear()


def mark(label: str) -> None:
    _marks.append((label, round(time.perf_counter() - _t0, 4)))


def marks() -> list[list]:
    return [[k, v] for k, v in _marks]

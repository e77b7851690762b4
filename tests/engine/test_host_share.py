"""The load's timing behind "both"'s split (engine/runtime/gpu/host_share.py): the CPU's time
for 1..k experts of a row, robust to one-off costs."""

import time
from types import SimpleNamespace

from engine.runtime.gpu import host_share


class _Host:
    """A host layer whose CPU takes 1 ms an expert, except that its first few calls pay a
    one-off 20 ms (a thread pool starting, pages touched the first time)."""

    def __init__(self, slow_calls: int) -> None:
        self.slow_calls, self.calls = slow_calls, []

    def cpu_row(self, x, ids, w, y) -> None:
        self.calls.append(ids.numel())
        time.sleep((0.020 if len(self.calls) <= self.slow_calls else 0.0) + 0.001 * ids.numel())


def test_cpu_times_are_each_counts_steady_cost():
    """One-off costs in the first calls land on no count: every c's time is its steady one,
    rising with c (once, c = 1 read 13.9 ms against c = 2's 1.4 and the split never ran)."""
    hp = SimpleNamespace(n_embd=64, n_expert=16, n_expert_used=4)
    h = _Host(slow_calls=3)
    times = host_share._cpu_times(hp, h)
    assert len(times) == 4 and set(h.calls) == {1, 2, 3, 4}
    for c, t in enumerate(times, 1):
        assert 0.001 * c <= t < 0.001 * c + 0.015, (c, times)
    assert times == sorted(times)

"""The CPU product path runs its upcasts and dequantization on one intra-op thread (a short
parallel region on busy cores waits a scheduler tick for a descheduled thread: 100x slower)
and hands every thread back to the products, whatever happens inside."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.models import ops


def test_one_thread_inside_and_every_thread_after() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with ops._one_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError), ops._one_thread():
            raise RuntimeError("a failing dequantization")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_linear_upcasts_on_one_thread(monkeypatch) -> None:
    seen = []
    real_copy = torch.Tensor.copy_

    def copy_(self, src, *a, **k):
        seen.append(torch.get_num_threads())
        return real_copy(self, src, *a, **k)

    w = ops.QWeight("w", torch.empty(0, dtype=torch.uint8), 0, 8, 16,
                    torch.randn(8, 16).bfloat16())
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(torch.Tensor, "copy_", copy_)
        y = ops.linear(torch.randn(1, 16), w)
        monkeypatch.undo()
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert y.shape == (1, 8) and y.dtype == torch.float32

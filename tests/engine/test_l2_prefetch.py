"""Decode's L2 prefetch (CARVE_L2_PREFETCH, carve_kernels/l2.py): the option's values and the
prefetch's checks. On a GPU, decode gives the same logits and greedy ids with it as without:
tests/engine/test_gpu_session.py ``test_cuda_decode_with_the_l2_prefetch_gives_the_same_logits_
and_ids`` (a dense layer's gate/up) and tests/engine/test_gpu_moe.py ``test_cuda_moe_decode_with_
the_l2_prefetch_gives_the_same_logits_and_ids`` (the next layer's attention and router under
a MoE layer's experts)."""

from __future__ import annotations

import pytest
import torch

from carve_kernels import l2
from engine.runtime.options import RunnerOptions
from spec.errors import CarveError


@pytest.mark.parametrize("value,want", [("", 0), ("0", 0), ("24", 24), ("1024", 1024)])
def test_the_option_is_mib_a_layer(value, want) -> None:
    assert RunnerOptions.from_env({"CARVE_L2_PREFETCH": value}).l2_prefetch == want


@pytest.mark.parametrize("value", ["-1", "1.5", "1025", "lots"])
def test_a_bad_option_names_the_variable(value) -> None:
    with pytest.raises(CarveError, match=f"CARVE_L2_PREFETCH={value}: use a whole number"):
        RunnerOptions.from_env({"CARVE_L2_PREFETCH": value})


def test_prefetch_checks_its_ranges_and_does_nothing_on_the_cpu() -> None:
    t = torch.zeros(4096, dtype=torch.uint8)
    l2.prefetch(t, 4, 1024, 512)  # the CPU has no L2 to fill: returns
    l2.prefetch(t, 0, 1024, 512)
    with pytest.raises(ValueError, match="multiples of 16"):
        l2.prefetch(t, 4, 1024, 500)
    with pytest.raises(ValueError, match="passes the end of a tensor of 4096 bytes"):
        l2.prefetch(t, 4, 1024, 1040)

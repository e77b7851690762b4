"""A GPU plan on a torch that cannot reach a GPU says so, not "lower --ctx" (issue: a newcomer
without a GPU was told to change memory settings)."""

from __future__ import annotations

import pytest
import torch

from engine.runtime.loader import RecordingAllocator
from spec.errors import CarveError


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine's torch reaches a GPU")
def test_allocating_on_cuda_without_cuda_names_the_cause_not_memory():
    allocator = RecordingAllocator()
    with pytest.raises(CarveError) as err:
        allocator.alloc(torch.device("cuda:0"), "weights", 1 << 20)
    text = str(err.value)
    assert text.startswith("cuda:0: ") and torch.__version__ in text
    assert "--gpus cpu" in text and "--ctx" not in text and "cache-reserve" not in text
    assert allocator.records == []  # nothing was allocated

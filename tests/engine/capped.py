"""An address-space cap for tests that feed hostile files to the reader and the loaders
(tests/engine/test_gguf_fuzz.py, test_hostile_metadata.py): an unbounded allocation is a
MemoryError in that test, naming the input, instead of growing until the OOM killer ends the
whole run (a fuzzed block_count of 1.5e9 once did, at 24 GiB)."""

from __future__ import annotations

import resource
from collections.abc import Iterator
from contextlib import contextmanager

import psutil


@contextmanager
def address_space_capped(extra: int = 3 << 30) -> Iterator[None]:
    """This process may map ``extra`` bytes more than it has mapped now, until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    cap = psutil.Process().memory_info().vms + extra
    if hard != resource.RLIM_INFINITY:
        cap = min(cap, hard)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

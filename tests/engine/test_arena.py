"""Arena modes and the caching-allocator model: DESIGN.md's measured figures and invariants."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.planning.arena import (
    ALIGN,
    CachingAllocatorModel,
    allocation_sizes,
    arrange,
    device_bytes,
    first_fit,
    reserved_bytes,
    segment_size,
)
from engine.planning.rules import parse_arena
from spec.errors import CarveError

MIB = 1 << 20


@pytest.mark.parametrize(
    ("request_bytes", "reserved"),
    [
        (123_456_789, 123_731_968),  # DESIGN.md: rounded up to a 2 MiB multiple
        (4_682_436_160, 4_682_940_416),
        (10 * MIB, 10 * MIB),  # exactly 10 MiB -> 10 MiB
        (10 * MIB - 1, 10 * MIB),  # rounded to 512 B first: that is 10 MiB
        (10 * MIB - 513, 20 * MIB),  # under 10 MiB after rounding -> a 20 MiB segment
        (MIB + 1, 20 * MIB),
        (MIB, 2 * MIB),  # <= 1 MiB -> a 2 MiB small segment
        (1, 2 * MIB),
    ],
)
def test_single_request_matches_torch_figures(request_bytes: int, reserved: int) -> None:
    m = CachingAllocatorModel()
    m.malloc(request_bytes)
    assert m.reserved == reserved


def test_small_blocks_share_2mib_segments_with_512_byte_rounding() -> None:
    m = CachingAllocatorModel()
    for _ in range(4):
        m.malloc(512 * 1024)  # four 512 KiB blocks fill exactly one 2 MiB segment
    assert m.reserved == 2 * MIB
    m.malloc(1)  # rounds to 512 B and needs a second segment
    assert m.reserved == 4 * MIB
    assert m.allocated == 4 * 512 * 1024 + 512


def test_mid_sized_blocks_share_a_20mib_segment_and_big_ones_use_its_rest() -> None:
    m = CachingAllocatorModel()
    m.malloc(3 * MIB)  # opens a 20 MiB segment, 17 MiB left as a free block
    m.malloc(5 * MIB)
    m.malloc(12 * MIB)  # >= 10 MiB, still best-fits into the 12 MiB remainder
    assert m.reserved == 20 * MIB
    m.malloc(MIB + 512)  # nothing left: a new 20 MiB segment
    assert m.reserved == 40 * MIB


def test_large_remainder_under_1mib_is_not_split() -> None:
    m = CachingAllocatorModel()
    m.malloc(19 * MIB + 512 * 1024)  # 20 MiB segment, 512 KiB remainder stays inside the block
    m.malloc(2 * MIB)
    assert m.reserved == 40 * MIB


def test_cpu_costs_exactly_the_arena_sizes() -> None:
    assert reserved_bytes([1, 513, 3 * MIB], on_gpu=False) == 1 + 513 + 3 * MIB


@pytest.mark.parametrize("text", ["bogus", "chunked:", "chunked:0", "chunked:x", "chunked:-4"])
def test_bad_arena_strings_name_the_option(text: str) -> None:
    with pytest.raises(CarveError, match="--arena"):
        parse_arena(text)


def test_arena_strings() -> None:
    assert parse_arena("packed").kind == "packed"
    assert parse_arena("Per-Tensor").kind == "per-tensor"
    assert parse_arena("chunked:1024").chunk == 1024 * MIB


requests_st = st.lists(
    st.tuples(st.integers(1, 40 * MIB), st.sampled_from(["f16", "Q4_K", "uint8"])),
    min_size=0,
    max_size=40,
)
modes_st = st.sampled_from(["packed", "per-tensor", "chunked:1", "chunked:4", "chunked:16"])


@settings(max_examples=150, deadline=None)
@given(requests_st, modes_st)
def test_arena_invariants(reqs: list[tuple[int, str]], mode_text: str) -> None:
    mode = parse_arena(mode_text)
    requests = [(f"t{i}", n, dt, (n,)) for i, (n, dt) in enumerate(reqs)]
    arenas = arrange(mode, "w", "weights", requests)
    spans = [s for a in arenas for s in a.spans]
    # every request placed exactly once, in order, unchanged
    assert [(s.name, s.nbytes) for s in spans] == [
        (r[0], r[1]) for r in requests
    ] or mode.kind == "chunked"
    assert sorted(s.name for s in spans) == sorted(r[0] for r in requests)
    for a in arenas:
        ordered = sorted(a.spans, key=lambda s: s.offset)
        for s in ordered:
            assert s.offset % ALIGN == 0
            assert 0 <= s.offset and s.offset + s.nbytes <= a.nbytes  # inside its arena
        for x, y in itertools.pairwise(ordered):
            assert x.offset + x.nbytes <= y.offset  # no overlap
    requested = sum(r[1] for r in requests)
    assert sum(a.nbytes for a in arenas) >= requested
    assert device_bytes(arenas, on_gpu=True) >= sum(a.nbytes for a in arenas)
    assert allocation_sizes(mode, [r[1] for r in requests]) == [a.nbytes for a in arenas]
    if mode.kind == "packed" and requests:
        (a,) = arenas
        padding = sum(-r[1] % ALIGN for r in requests)
        assert a.nbytes - requested == padding  # packed waste is alignment padding only
    if mode.kind == "chunked":
        for a in arenas:
            assert a.nbytes == mode.chunk or (len(a.spans) == 1 and a.spans[0].nbytes > mode.chunk)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 30 * MIB), max_size=60))
def test_allocator_reserves_at_least_the_blocks_it_hands_out(sizes: list[int]) -> None:
    m = CachingAllocatorModel()
    for n in sizes:
        m.malloc(n)
    assert m.reserved >= m.allocated >= sum(sizes)
    # never more than one fresh segment per request
    assert m.reserved <= sum(segment_size(n) for n in sizes)


def test_first_fit_reuses_earlier_chunks() -> None:
    where, sizes = first_fit([3 * MIB, 3 * MIB, MIB, 9 * MIB], 4 * MIB)
    assert sizes == [4 * MIB, 4 * MIB, 9 * MIB]
    assert where == [(0, 0), (1, 0), (0, 3 * MIB), (2, 0)]

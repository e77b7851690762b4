"""Hostile GGUF headers: mutations of real headers (the demo model's, read without its weights,
a split set's shard, the tiny model's whole file) by hypothesis, huge counts and lengths planted
in fields, and truncation at every byte of a header. Open, plan and load raise only CarveError,
in bounded time and memory."""

from __future__ import annotations

import os
import shutil
import struct
import time
from pathlib import Path

import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf.reader import GGUFModel
from spec.errors import CarveError
from tests.engine.capped import address_space_capped

FUZZ = settings(max_examples=25, deadline=None, derandomize=False,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])
HUGE = [2**32 - 1, 2**40, 2**60, 2**63 - 1, 2**64 - 1]


@pytest.fixture(autouse=True)
def _address_space_capped():
    with address_space_capped():
        yield


def header_end(path: Path) -> int:
    with GGUFModel.open(path) as m:
        return min(t.offset for t in m.tensors if t.shard == 0)


def open_only(path: Path, named: str = "") -> None:
    """Open must give a model or one CarveError line naming the file (``named``: a part of the
    name every shard shares), without a large allocation and without a runaway loop: a count
    of 2^32 and up walked entry by entry takes hours, so a minute is the bound (a normal open
    takes milliseconds; a shared 2-core CI machine once took 18 s under a 10 s bound)."""
    rss, t = psutil.Process().memory_info().rss, time.monotonic()
    try:
        GGUFModel.open(path).close()
    except CarveError as err:
        assert "\n" not in str(err) and (named or path.name) in str(err)
    assert time.monotonic() - t < 60
    assert psutil.Process().memory_info().rss - rss < 512 << 20


def mutate(raw: bytes, flips: list[tuple[int, int]], plants: list[tuple[int, int]]) -> bytes:
    b = bytearray(raw)
    for pos, val in flips:
        b[pos % len(b)] = val
    for pos, val in plants:
        at = pos % max(1, len(b) - 8)
        b[at:at + 8] = struct.pack("<Q", val)
    return bytes(b)


flips = st.lists(st.tuples(st.integers(0, 2**31), st.integers(0, 255)), max_size=8)
plants = st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from(HUGE)), max_size=3)


@pytest.fixture(scope="module")
def demo_header(demo_model_path) -> tuple[bytes, int]:
    """The demo model's header bytes (not its weights) and its file size."""
    end = header_end(Path(demo_model_path))
    with open(demo_model_path, "rb") as f:
        return f.read(end), os.path.getsize(demo_model_path)


def write_sparse(path: Path, header: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(header)
    os.truncate(path, max(size, len(header)))  # the weights' bytes as a hole: no disk, no reads


@pytest.mark.demo
@FUZZ
@given(flips=flips, plants=plants, where=st.sampled_from(["counts", "keys", "tail"]))
def test_mutated_demo_headers_open_or_say_why(demo_header, tmp_path, flips, plants, where):
    header, size = demo_header
    # aim at the fixed fields, the first metadata entries, or the tensor table at the end
    base = {"counts": 0, "keys": 24, "tail": max(0, len(header) - 64_000)}[where]
    span = {"counts": 24, "keys": 4096, "tail": 64_000}[where]
    flips = [(base + p % span, v) for p, v in flips]
    plants = [(base + p % span, v) for p, v in plants]
    path = tmp_path / "demo.gguf"
    write_sparse(path, mutate(header, flips, plants), size)
    open_only(path)


def test_huge_counts_and_lengths_do_not_allocate(synth_model, tmp_path):
    raw = Path(synth_model("llama")).read_bytes()
    path = tmp_path / "h.gguf"
    for field_at in (8, 16, 24):  # n_tensors, n_kv, the first key's length
        for value in HUGE:
            path.write_bytes(raw[:field_at] + struct.pack("<Q", value) + raw[field_at + 8:])
            with pytest.raises(CarveError):
                GGUFModel.open(path)
            open_only(path)


def test_truncated_at_every_byte_of_the_header(synth_model, tmp_path):
    src = Path(synth_model("llama"))
    raw, end = src.read_bytes(), header_end(src)
    path = tmp_path / "t.gguf"
    t = time.monotonic()
    for cut in range(0, end + 1, max(1, end // 1500)):
        path.write_bytes(raw[:cut])
        with pytest.raises(CarveError, match="t.gguf"):
            GGUFModel.open(path)
    assert time.monotonic() - t < 30


@FUZZ
@given(flips=flips, plants=plants)
def test_mutated_split_shard_opens_or_says_why(synth_model, tmp_path, flips, plants):
    first = Path(synth_model("llama", split=2))
    second = first.with_name(first.name.replace("-00001-of-", "-00002-of-"))
    folder = tmp_path / "set"
    folder.mkdir(exist_ok=True)
    shutil.copy(first, folder / first.name)
    raw = second.read_bytes()
    end = header_end(second)
    flips = [(p % end, v) for p, v in flips]
    plants = [(p % end, v) for p, v in plants]
    (folder / second.name).write_bytes(mutate(raw[:end], flips, plants) + raw[end:])
    open_only(folder / first.name, named=first.name.split("-00001-")[0])


@FUZZ
@given(flips=flips, plants=plants)
def test_mutated_tiny_model_opens_plans_and_loads_or_says_why(synth_model, tmp_path, flips,
                                                             plants):
    from app.cli_chat import build_plan
    from engine.runtime.session import Session

    src = Path(synth_model("llama"))
    raw = src.read_bytes()
    end = header_end(src)
    path = tmp_path / "fz.gguf"
    path.write_bytes(mutate(raw[:end], [(p % end, v) for p, v in flips],
                            [(p % end, v) for p, v in plants]) + raw[end:])
    t = time.monotonic()
    try:
        plan = build_plan(path, "cpu", 64, "f16")
        Session.load(plan).close()
    except CarveError as err:
        assert "\n" not in str(err)
    assert time.monotonic() - t < 30

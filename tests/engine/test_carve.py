"""The carve: a stage holds exactly the tensors of its layers plus its globals, byte for byte."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.carve import carve
from engine.planning.plan import Plan
from engine.planning.price import price

GIB = 1 << 30
CPU = DeviceSpec(-1, "cpu", 64 * GIB, 64 * GIB)


@functools.cache
def file_tensors(path: Path) -> dict[str, int]:
    """name -> bytes, from gguf's reader (every shard of a split set)."""
    out: dict[str, int] = {}
    paths = (
        sorted(path.parent.glob(path.name.replace("-00001-of-", "-*-of-")))
        if "-00001-of-" in path.name
        else [path]
    )
    for p in paths:
        out |= {t.name: int(t.n_bytes) for t in gguf.GGUFReader(p).tensors}
    return out


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("blk.") else None


def gpus(n: int) -> tuple[DeviceSpec, ...]:
    return tuple(DeviceSpec(i, "g", 80 * GIB, 80 * GIB, simulated=True) for i in range(n))


@pytest.mark.parametrize(
    ("arch", "split"), [("llama", 1), ("qwen2", 1), ("gemma3", 1), ("llama", 3)]
)
def test_every_range_prices_exactly_the_tensors_it_keeps(
    synth_model: Any, arch: str, split: int
) -> None:
    path = synth_model(arch, split=split)
    ref = file_tensors(path)
    model = GGUFModel.open(path)
    n = 1 + max(layer_of(k) for k in ref if layer_of(k) is not None)
    for lo in range(n):
        for hi in range(lo + 1, n + 1):
            first, last = lo == 0, hi == n
            kept = carve(model, lo, hi, first, last)
            names = [t.name for t in kept]
            assert len(names) == len(set(names))
            in_range = {k for k in ref if layer_of(k) is not None and lo <= layer_of(k) < hi}
            assert {k for k in names if layer_of(k) is not None} == in_range  # kept in, dropped out
            glob = {k for k in names if layer_of(k) is None}
            expected_glob = ({"token_embd.weight"} if first else set()) | (
                {
                    "output_norm.weight",
                    "output.weight" if "output.weight" in ref else "token_embd.weight",
                }
                if last
                else set()
            )
            assert glob == expected_glob
            devices = (CPU,) if first and last else gpus(1 + (not first) + (not last))
            bounds = tuple(sorted({0, lo, hi, n}))
            layout = price(Plan(str(path), devices, bounds, ctx=256), model)
            stage = next(d for d in layout.devices if d.layers == (lo, hi))
            assert stage.terms["weights"] == sum(ref[k] for k in in_range)
            assert stage.terms["globals"] == sum(ref[k] for k in glob)
            priced = {
                s.name for a in stage.arenas if a.purpose in ("weights", "globals") for s in a.spans
            }
            assert priced == set(names)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
def test_full_range_single_device_is_the_file(synth_model: Any, arch: str) -> None:
    path = synth_model(arch)
    ref = file_tensors(path)
    model = GGUFModel.open(path)
    n = 1 + max(layer_of(k) for k in ref if layer_of(k) is not None)
    d = price(Plan(str(path), (CPU,), (0, n), ctx=256), model).devices[0]
    assert d.terms["weights"] + d.terms["globals"] == sum(ref.values())


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_any_split_sums_to_the_file_plus_the_tied_copy(
    synth_model: Any, data: st.DataObject
) -> None:
    arch = data.draw(st.sampled_from(["llama", "qwen2", "gemma3"]))
    path = synth_model(arch)
    ref = file_tensors(path)
    model = GGUFModel.open(path)
    n = 1 + max(layer_of(k) for k in ref if layer_of(k) is not None)
    cuts = data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1))
    bounds = (0, *sorted(cuts), n)
    stages = len(bounds) - 1
    layout = price(Plan(str(path), gpus(stages) if stages > 1 else (CPU,), bounds, ctx=256), model)
    total = sum(d.terms["weights"] + d.terms["globals"] for d in layout.devices)
    tied_copy = ref["token_embd.weight"] if "output.weight" not in ref and stages > 1 else 0
    assert total == sum(ref.values()) + tied_copy

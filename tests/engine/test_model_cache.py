"""Pricing's memo tables (engine/planning/stage.py ModelCache) keep only the last few models:
a model opened again gets a new index token, so each load of an engine that loads over and over
would otherwise leave its priced stages behind (benchmarks/soak.py saw the engine's memory grow
by them on every load/unload cycle)."""

from __future__ import annotations

from engine.gguf.reader import GGUFModel
from engine.hardware.rigs import parse_rig
from engine.planning import price as price_mod
from engine.planning import stage
from engine.planning.defaults import default_plan
from engine.synth.gen import write_model


def test_entries_of_models_no_longer_recent_are_dropped():
    c = stage.ModelCache(size=100, models=2)
    c.put((1, "a"), "1a")
    c.put((1, "b"), "1b")
    c.put((2, "a"), "2a")
    assert c.get((1, "a")) == "1a"
    c.put((3, "a"), "3a")  # model 1 is now the least recent of three: its entries go
    assert c.get((1, "a")) is None and c.get((1, "b")) is None
    assert c.get((2, "a")) == "2a" and c.get((3, "a")) == "3a"
    assert len(c) == 2


def test_the_least_recently_used_entry_goes_past_the_size():
    c = stage.ModelCache(size=2, models=4)
    c.put((1, "a"), 1)
    c.put((1, "b"), 2)
    c.get((1, "a"))
    c.put((1, "c"), 3)
    assert c.get((1, "b")) is None and c.get((1, "a")) == 1 and c.get((1, "c")) == 3


def test_pricing_a_model_opened_again_and_again_keeps_the_tables_bounded(tmp_path):
    path = write_model(tmp_path / "m.gguf", "qwen2-tiny", "q4_k_m")[0]
    sizes = []
    for _ in range(12):
        model = GGUFModel.open(path)  # a new index each time, as each load opens its model
        price_mod.price(default_plan(model, parse_rig("cpu"), ctx=256, model_path=str(path)),
                        model)
        sizes.append((len(price_mod._STAGES), len(stage._MEMO)))
    assert sizes[-1] == sizes[-5], sizes  # flat once the last few models' entries are there
    assert len(price_mod._STAGES.tokens) <= price_mod._STAGES.models

"""PlanModel: snapping, re-pricing on every change, verdicts, one-click fixes, presets."""

from __future__ import annotations

from dataclasses import replace

import pytest

from app.models.plan_model import PlanModel, even_split, valid_split
from engine.gguf.reader import GGUFModel
from spec.errors import CarveError


@pytest.fixture
def model(synth_model, make_gpu):
    m = PlanModel()
    m.open_model(str(synth_model("llama")))
    m.set_devices([make_gpu(0, 8000), make_gpu(1, 8000)])
    m.pick_devices("spread")  # Auto keeps this small model on one GPU; these tests edit a split
    return m


def layer_bytes(path, lo, hi):
    g = GGUFModel.open(path)
    return sum(t.nbytes for t in g.tensors if t.layer is not None and lo <= t.layer < hi)


def test_even_split_and_validity():
    assert even_split(10, 3) == (0, 4, 7, 10)
    assert even_split(4, 1) == (0, 4)
    assert valid_split((0, 2, 4), 4, 2)
    assert not valid_split((0, 2, 2, 4), 4, 3)  # a stage with no layers
    assert not valid_split((0, 2, 5), 4, 2)


def test_open_prices_at_once(model):
    assert model.n_layer == 4
    assert valid_split(model.split, 4, 2)
    assert model.layout is not None and len(model.layout.devices) == 2
    assert model.verdict() == "fits"


def test_boundary_snaps_to_whole_layers_and_clamps(model):
    model.set_split((0, 2, 4))
    assert model.set_boundary(1, 2.6) == 3
    assert model.split == (0, 3, 4)
    assert model.set_boundary(1, 1.4) == 1
    # every stage keeps a layer: the boundary cannot reach 0 or 4
    assert model.set_boundary(1, -7.0) == 1
    assert model.set_boundary(1, 99) == 3
    with pytest.raises(IndexError):
        model.set_boundary(0, 1)


def test_moving_a_boundary_moves_the_priced_weight_bytes(model, synth_model):
    path = synth_model("llama")
    seen = []
    model.events.layout.connect(lambda layout: seen.append(layout))
    for b in (1, 2, 3):
        model.set_boundary(1, b)
        first, last = model.layout.devices
        assert first.layers == (0, b) and last.layers == (b, 4)
        # the priced weights are exactly the bytes of the layers each stage keeps
        assert first.terms["weights"] >= layer_bytes(path, 0, b)
        assert first.terms["weights"] - layer_bytes(path, 0, b) < 4096 * 16  # alignment only
    n = len(seen)
    model.set_boundary(1, 3.2)  # snaps to where it already is: no re-price
    assert len(seen) == n


def test_nudge(model):
    model.set_split((0, 2, 4))
    model.nudge_boundary(1, +1)
    assert model.split == (0, 3, 4)
    model.nudge_boundary(1, +1)
    assert model.split == (0, 3, 4)


def test_exclude_a_device(model):
    model.set_excluded(1, True)
    assert len(model.active_devices()) == 1 and model.split == (0, 4)
    assert len(model.layout.devices) == 1
    model.set_excluded(0, True)  # the last device cannot be excluded
    assert len(model.active_devices()) == 1
    model.set_excluded(1, False)
    assert len(model.split) == 3


def test_every_setting_reprices(model):
    seen = []
    model.events.layout.connect(lambda layout: seen.append(layout))
    model.set_ctx(512)
    seen.clear()
    kv_before = model.layout.devices[0].terms["kv"]
    model.set_ctx(2048)
    assert model.layout.devices[0].terms["kv"] > kv_before
    model.set_kv_type("q8_0")
    assert model.layout.devices[0].terms["kv"] < model.price_plan(model.plan(kv_type="f16")).devices[0].terms["kv"]
    model.set_prefill_chunk(128)
    model.set_cache_reserve(0)
    model.set_arena("chunked:64")
    assert len(seen) == 5
    with pytest.raises(CarveError):
        model.set_kv_type("q4")
    with pytest.raises(CarveError):
        model.set_arena("chunked:0")


def test_context_clamped_to_training_length(model):
    model.set_ctx(10**9)
    assert model.ctx == model.max_ctx == 2048


def test_verdict_and_fixes_make_it_fit(demo_model_path, make_gpu):
    # the demo model: its KV cache at 32k context is large enough to decide the fit
    m = PlanModel()
    m.open_model(str(demo_model_path))
    m.set_cache_reserve(0)
    m.set_devices([make_gpu(0, 8000)])

    def need(ctx):  # everything but the elastic dequant cache, which takes what is left
        d = m.price_plan(m.plan(ctx=ctx)).devices[0]
        return d.total - d.terms["dequant_cache"]

    # free memory between the two: ctx 32768 does not fit, a smaller one does
    mid = (need(256) + need(32768)) // 2
    m.set_devices([replace(make_gpu(0, 8000), free=mid)])
    m.set_ctx(32768)
    assert m.verdict() == "does not fit"
    fixes = m.fixes()
    labels = [f.label for f in fixes]
    assert any(label.startswith("Set context to") for label in labels), labels
    ctx_fix = next(f for f in fixes if f.label.startswith("Set context"))
    ctx_fix.apply()
    assert m.verdict() in ("fits", "tight")
    assert 256 <= m.ctx < 32768
    # the fix is the largest context that fits (in steps of 256)
    assert m.price_plan(m.plan(ctx=m.ctx + 256)).devices[0].verdict == "does not fit"


def test_settings_round_trip(model):
    model.set_ctx(1024)
    model.set_kv_type("q8_0")
    model.set_arena("per-tensor")
    model.set_split((0, 1, 4))
    saved = model.settings()
    other = PlanModel()
    other.set_model(model.gguf, model.hparams)
    other.set_devices(model.devices)
    other.apply_settings(saved)
    assert other.settings() == saved
    assert other.layout.devices[0].total == model.layout.devices[0].total


def test_settings_that_no_longer_apply_are_dropped(model):
    model.apply_settings({"split": [0, 1, 2, 4], "kv_type": "bogus", "arena": "nonsense"})
    assert len(model.split) == 3 and model.kv_type == "f16" and model.arena == "packed"


def test_auto_split_uses_the_search(model, make_gpu):
    model.set_devices([make_gpu(0, 3000), make_gpu(1, 20000)])
    assert model.auto_split()
    assert valid_split(model.split, 4, 2)


def test_a_plan_that_does_not_run_here_names_why_and_cannot_launch(qtbot, synth_model,
                                                                     make_gpu):
    from app.theme import LIGHT
    from app.widgets.fit_check import FitCheck
    from app.widgets.launch_bar import LaunchBar

    m = PlanModel()
    m.open_model(str(synth_model("qwen2", "f32")))
    m.set_devices([make_gpu(0, 8000)])
    reason = ("F32 (blk.0.attn_q.weight and 28 more) has no GPU kernel: run on the CPU engine "
              "(--gpus cpu) or use a file without it")
    assert m.verdict() == "does not run here" and m.reason() == reason
    assert m.fixes() == []  # no memory change makes it run
    fit = FitCheck(m, LIGHT)
    bar = LaunchBar()
    qtbot.addWidget(fit)
    qtbot.addWidget(bar)
    m.events.layout.connect(lambda *_: bar.set_verdict(m.verdict(), m.reason()))
    m.set_ctx(1024)  # re-prices: both views follow
    assert fit.table.item(0, fit.table.columnCount() - 1).text() == "does not run here"
    assert reason in fit.summary.text() and reason in fit.advice.text()
    assert not bar.launch_button.isEnabled() and not bar.can_launch()
    assert bar.status.text() == f"This plan does not run here: {reason}"
    assert bar.override.isHidden()  # "Launch anyway" cannot help: nothing would run it
    bar.override.setChecked(True)
    assert not bar.can_launch()
    # the same file on a plan whose runner runs it: Launch is back
    m.set_devices([_cpu()])
    assert m.verdict() == "fits" and m.reason() == ""
    assert bar.launch_button.isEnabled()


def _cpu():
    from engine.hardware.devices import DeviceSpec

    return DeviceSpec(index=-1, name="cpu", total=64 << 30, free=64 << 30)

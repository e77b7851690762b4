"""A mixture-of-experts model in the window: the model panel's MoE line, the experts column of
the fit check, the skipped NextN layer, and the experts' own colour in the VRAM bars."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.models.device_board import DeviceBoard
from app.models.model_summary import summarize
from app.theme import DARK, LIGHT
from app.widgets.fit_check import COLUMNS
from app.widgets.model_panel import ModelPanel
from app.widgets.vram_bars import VramBars
from app.window_main import MainWindow
from engine.gguf.hparams import HParams
from engine.hardware import devices
from engine.hardware.devices import DeviceSnapshot
from engine.synth.header import HeaderModel
from engine.synth.shapes import SHAPES

FAKE = str(Path(__file__).resolve().parents[2] / "tests" / "fake_engine.py")
MIB = 1 << 20


@pytest.mark.parametrize(("shape", "line"), [
    ("qwen3moe-30b-a3b", "128 experts, 8 active, ~3.3 B active parameters per token"),
    ("gpt-oss-20b", "32 experts, 4 active, ~4.1 B active parameters per token"),
    ("glm4.5-air", "128 experts + 1 shared, 8 active, ~13 B active parameters per token"),
    # DeepSeek-V3's published 671 B / 37 B
    ("deepseek-v3", "256 experts + 1 shared, 8 active, ~37 B active parameters per token"),
])
def test_model_panel_shows_the_moe_line(qtbot, shape, line):
    model = HeaderModel(SHAPES[shape])
    panel = ModelPanel()
    qtbot.addWidget(panel)
    panel.show_summary(summarize(model, HParams.from_model(model)))
    assert panel._values["MoE"].text() == line
    dense = HeaderModel(SHAPES["qwen2-7b"])
    panel.show_summary(summarize(dense, HParams.from_model(dense)))
    assert "MoE" not in panel._values and panel._values["Layers"].text() == "28"


def _gpu(i: int) -> DeviceSnapshot:
    total = 24_564 * MIB
    return DeviceSnapshot(nvml_index=i, cuda_index=i, name="NVIDIA GeForce RTX 4090",
                          uuid=f"GPU-{i}", pci_bus_id=f"0000:0{i}:00.0", total=total,
                          free=23_000 * MIB, used=total - 23_000 * MIB, reserved=0,
                          temperature=None, utilization=None, memory_utilization=None)


def test_window_bills_experts_and_the_skipped_layer(qtbot, synth_model, monkeypatch):
    monkeypatch.setattr(devices, "snapshot", lambda: [_gpu(0), _gpu(1)])
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("glm4moe-tiny")), "auto")
    w.show()
    try:
        assert w.plan.n_layer == 3 and w.plan.layout.devices[-1].layers[1] == 3
        panel = w.model_panel._values
        assert panel["MoE"].text().startswith("4 experts + 1 shared, 2 active, ~")
        assert panel["Layers"].text() == "3 (+1 next-token-prediction, not run)"
        fit = w.fit
        col = next(i for i, (_, key) in enumerate(COLUMNS) if key == "experts")
        assert not fit.table.isColumnHidden(col)
        experts = w.plan.layout.devices[0].terms["experts"]
        assert experts > 0 and fit.table.item(0, col).text().endswith(("KiB", "MiB"))
        assert fit.skipped.isVisibleTo(fit)
        assert fit.skipped.text().startswith("skipped: 1 next-token-prediction layer, ")
    finally:
        w.close()


def test_dense_model_hides_the_experts_column(qtbot, synth_model, monkeypatch):
    monkeypatch.setattr(devices, "snapshot", lambda: [_gpu(0)])
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen2")), "auto")
    try:
        col = next(i for i, (_, key) in enumerate(COLUMNS) if key == "experts")
        assert w.fit.table.isColumnHidden(col) and not w.fit.skipped.isVisibleTo(w)
    finally:
        w.close()


def test_vram_bars_give_experts_their_own_colour(qtbot, synth_model):
    from engine.gguf.reader import GGUFModel
    from engine.hardware.devices import DeviceSpec
    from engine.planning.plan import Plan
    from engine.planning.price import price

    model = GGUFModel.open(synth_model("qwen3moe-tiny"))
    dev = DeviceSpec(0, "card0", 24 << 30, 23 << 30, simulated=True)
    layout = price(Plan("m", (dev,), (0, 4), ctx=256), model)
    board = DeviceBoard()
    board.set_simulated("1x24GiB", [dev])
    bars = VramBars(board, DARK)
    qtbot.addWidget(bars)
    board.set_launched(layout)
    assert LIGHT.terms["experts"] not in (LIGHT.terms["weights"], LIGHT.terms["kv"])
    assert DARK.terms["experts"] != DARK.terms["weights"]
    assert "experts" in bars._items and "experts" in bars.legend.text()
    assert len(board.rows) == 1
    assert board.rows[0].ours["experts"] == layout.devices[0].terms["experts"] > 0
    # the experts' segment sits right of the weights and is as wide as the term
    weights, experts = bars._items["weights"].opts, bars._items["experts"].opts
    assert experts["x0"][0] == pytest.approx(weights["x0"][0] + weights["width"][0])
    assert experts["width"][0] == pytest.approx(layout.devices[0].terms["experts"] / (1 << 30))


def test_a_moe_file_with_a_bad_expert_tensor_leaves_the_window_usable(qtbot, synth_model,
                                                                      monkeypatch, tmp_path):
    import engine.synth.gen as gen
    from engine.synth.gen import write_model

    table = gen.tensor_table
    monkeypatch.setattr(gen, "tensor_table", lambda s: [
        (n, (d[0], d[1], 3) if n == "blk.2.ffn_up_exps.weight" else d) for n, d in table(s)])
    bad = write_model(tmp_path / "bad-moe.gguf", "qwen3moe-tiny")[0]
    monkeypatch.setattr(gen, "tensor_table", table)
    monkeypatch.setattr(devices, "snapshot", lambda: [_gpu(0)])
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen3moe-tiny")), "auto")
    try:
        good = w.plan.layout
        assert good is not None
        assert not w.open_model(str(bad))
        text = w.model_panel.path.text()
        assert "bad-moe.gguf" in text and "blk.2.ffn_up_exps.weight holds 3 experts" in text
        assert w.plan.layout is good and w.launch_bar.launch_button.isEnabled()
        assert w.open_model(str(synth_model("glm4moe-tiny")))  # and the next file opens
        assert w.plan.layout.skipped_layers == 1
    finally:
        w.close()


def test_a_plan_on_the_torch_engine_says_so(qtbot, synth_model, monkeypatch):
    # a MoE file with 48-wide heads runs on the torch engine: the fit check says so beside the
    # verdict; deepseek2's latent attention (on either KV cache) and a llama file on the same
    # card run on the Triton runner, and it says nothing of the kind
    monkeypatch.setattr(devices, "snapshot", lambda: [_gpu(0)])
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen3moe-h48-tiny")), "auto")
    w.show()
    try:
        assert w.plan.layout.verdict == "fits"
        assert w.fit.advice.isVisibleTo(w.fit)
        text = w.fit.advice.text()
        assert "Runs on the torch engine" in text and "have 48" in text
        w.restore(str(synth_model("deepseek2-tiny")), "auto")
        assert w.plan.layout.verdict == "fits"
        assert "torch engine" not in w.fit.advice.text()
        w.plan.set_kv_type("q8_0")
        assert "torch engine" not in w.fit.advice.text()
        w.restore(str(synth_model("llama")), "auto")
        assert "torch engine" not in w.fit.advice.text()
    finally:
        w.close()

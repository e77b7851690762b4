"""What a newcomer meets first: a machine without a GPU launches on the CPU engine and says so, a
simulated rig plans but explains how to launch, the reply streams with its figures, Auto keeps
a small model on one GPU, empty states look intentional, and the title names the open model."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.models.plan_model import PlanModel
from app.theme import LIGHT
from app.widgets.rig_picker import LIVE_CPU
from app.window_main import MainWindow
from engine.gguf.hparams import HParams
from engine.hardware import devices
from engine.hardware.rigs import parse_rig
from engine.synth.header import HeaderModel
from engine.synth.shapes import Shape

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(ROOT / "tests" / "fake_engine.py")


@pytest.fixture
def no_gpu(monkeypatch):
    """A machine whose NVML finds no NVIDIA GPU (whatever this one has)."""
    monkeypatch.setattr(devices, "snapshot", lambda: [])
    monkeypatch.setattr(devices, "no_gpu_reason",
                        lambda: "no NVIDIA GPU found: NVMLError_LibraryNotFound")


@pytest.fixture
def window(qtbot, no_gpu):
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    w.show()
    yield w
    w.close()


def test_without_a_gpu_this_machine_is_the_cpu_and_launch_says_so(qtbot, window, synth_model,
                                                                   monkeypatch):
    monkeypatch.setenv("CARVE_FAKE_TOKEN_DELAY", "0.05")  # a reply slow enough to watch
    assert window.restore(str(synth_model("qwen2")), None) == ""
    assert window.rig == "auto" and window.rig_picker.combo.currentText() == LIVE_CPU
    assert [d.is_cpu for d in window.plan.plan().devices] == [True]
    assert "No NVIDIA GPU found" in window.rig_picker.banner.text()
    caption = window.vram._captions[0].toPlainText()
    assert caption.startswith("CPU") and "simulated" not in caption  # this machine's RAM
    bar = window.launch_bar
    assert bar.launch_button.isEnabled() and bar.launch_button.text() == "Launch on CPU"
    assert bar.status.text() == ("Plan fits — ready to launch. No NVIDIA GPU was found, so the "
                                 "CPU engine runs the model.")
    with qtbot.waitSignal(window.client.loaded, timeout=15_000):
        bar.launch_button.click()
    # while the reply streams, the status under the chat shows its figures, not "ready"
    chat = window.chat
    qtbot.keyClicks(chat.input, "tell me about layers and splits")
    qtbot.keyClick(chat.input, Qt.Key.Key_Return)
    assert chat.stats.text() == "reading the prompt…"  # sent, no token yet: not "ready"
    qtbot.waitUntil(lambda: "generating:" in chat.stats.text(), timeout=10_000)
    assert window.history.streaming
    text = chat.stats.text()
    assert "tokens/s" in text and f"/ {window.plan.ctx:,} tokens" in text, text
    with qtbot.waitSignal(window.client.done, timeout=15_000):
        pass


def test_a_simulated_rig_plans_but_launch_explains_how_to_launch(qtbot, window, synth_model):
    assert window.restore(str(synth_model("qwen2")), "rtx4090,rtx4090") == ""
    bar = window.launch_bar
    assert window.plan.verdict() == "fits"
    assert not bar.launch_button.isEnabled() and not bar.can_launch()
    sentence = ("2× RTX 4090 is a simulated rig, for planning only: to launch, choose “This "
                "machine” (the CPU here) under GPUs › Plan for.")
    assert bar.status.text() == sentence and bar.launch_button.toolTip() == sentence
    window.launch()  # the menu's Launch or a stray shortcut: still nothing starts
    assert window.client.state == "stopped" and not window.client.is_running()
    # a plan that does not fit on the simulated rig: planning advice, but no "Launch anyway"
    window.plan.set_ctx(window.plan.max_ctx)
    window.set_rig("1GiB")
    assert window.plan.verdict() == "does not fit" and bar.override.isHidden()
    assert bar.status.text().startswith("1 GiB is a simulated rig, for planning only")
    # "This machine": the CPU, and Launch is back
    window.rig_picker.combo.setCurrentText(LIVE_CPU)
    window.rig_picker.combo.lineEdit().editingFinished.emit()
    assert window.rig == "auto" and bar.launch_button.isEnabled()
    assert bar.launch_button.text() == "Launch on CPU"


def test_the_title_names_the_open_model(window, synth_model):
    assert window.windowTitle() == "Carve"
    path = synth_model("gemma3")
    window.open_model(str(path))
    assert window.windowTitle() == f"{path.name} — Carve"


def test_the_empty_layer_plot_shows_a_sentence_and_no_axis(window, synth_model, tmp_path,
                                                           monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))  # no demo model yet
    assert window.restore(None, None) == ""  # a first start with no model anywhere
    editor = window.split_editor
    axis = editor.plot.getPlotItem().getAxis("bottom")
    assert editor.placeholder.isVisible() and not axis.isVisible()
    assert "Open a model" in editor.placeholder.textItem.toPlainText()
    window.open_model(str(synth_model("llama")))
    assert not editor.placeholder.isVisible() and axis.isVisible()


# a 13B-class llama: about 7 GiB of Q4_K_M weights; 32k of f16 context is 25 GiB of KV more
LLAMA13 = HeaderModel(Shape("llama", 40, 5120, 40, 40, 13824, 32000, n_ctx=32768),
                      name="llama13.gguf")


def test_auto_keeps_one_gpu_and_offers_spread_when_one_no_longer_fits():
    m = PlanModel()
    m.set_devices(parse_rig("2x24GiB"))
    m.set_ctx(4096)
    m.set_model(LLAMA13, HParams.from_model(LLAMA13))
    assert len(m.active_devices()) == 1 and m.excluded == {1} and m.verdict() == "fits"
    m.set_ctx(32768)  # the context no longer fits on one card: the fix is one click away
    assert m.verdict() == "does not fit"
    spread = next(f for f in m.fixes() if f.label == "Spread over every GPU")
    spread.apply()
    assert len(m.active_devices()) == 2 and m.verdict() in ("fits", "tight")
    # the choice holds for the next model: a small one is spread too, until Auto is picked
    m.set_model(LLAMA13, HParams.from_model(LLAMA13))
    assert len(m.active_devices()) == 2
    m.set_ctx(4096)
    m.pick_devices("auto")
    assert len(m.active_devices()) == 1


def test_gpus_that_cuda_visible_devices_hides_leave_the_cpu(qtbot, monkeypatch, synth_model):
    from engine.hardware.devices import DeviceSnapshot

    hidden = DeviceSnapshot(nvml_index=0, cuda_index=-1, name="NVIDIA H200", uuid="GPU-0",
                            pci_bus_id="0000:01:00.0", total=140 << 30, free=139 << 30,
                            used=1 << 30, reserved=0, temperature=None, utilization=None,
                            memory_utilization=None)
    monkeypatch.setattr(devices, "snapshot", lambda: [hidden])
    w = MainWindow(LIGHT, live_poll=False, remember=False)
    qtbot.addWidget(w)
    assert w.restore(str(synth_model("qwen2")), None) == ""
    assert [d.is_cpu for d in w.plan.plan().devices] == [True]
    assert w.launch_bar.launch_button.text() == "Launch on CPU"
    assert w.rig_picker.banner.toolTip() == "CUDA_VISIBLE_DEVICES hides every GPU"

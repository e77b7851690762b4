"""The whole window: restore, launch against the fake engine, chat streaming, crash, snapshot,
and the layering rule (building the window imports neither torch nor triton)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.models.presets import PresetStore
from app.theme import LIGHT
from app.window_main import MainWindow
from engine.hardware import devices
from engine.hardware.devices import DeviceSnapshot

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(ROOT / "tests" / "fake_engine.py")
MIB = 1 << 20


def nvml_gpu(i: int, free_mib: int = 23_000) -> DeviceSnapshot:
    total = 24_564 * MIB
    return DeviceSnapshot(nvml_index=i, cuda_index=i, name="NVIDIA GeForce RTX 4090",
                          uuid=f"GPU-{i}", pci_bus_id=f"0000:0{i}:00.0", total=total,
                          free=free_mib * MIB, used=total - free_mib * MIB, reserved=0,
                          temperature=None, utilization=None, memory_utilization=None)


@pytest.fixture
def machine_gpus(monkeypatch):
    """This machine's GPUs as NVML reports them (faked at devices.snapshot): two idle RTX 4090s.
    Tests edit the list in place."""
    gpus = [nvml_gpu(0), nvml_gpu(1)]
    monkeypatch.setattr(devices, "snapshot", lambda: list(gpus))
    return gpus


@pytest.fixture
def window(qtbot, synth_model, request, machine_gpus):
    scenario = getattr(request, "param", "normal")
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, scenario], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen2")), "auto")
    w.show()
    yield w
    w.close()


def test_restore_plans_at_once(window):
    # Auto keeps a model that fits on one GPU on one; Spread, one click away, uses both
    assert window.plan.layout is not None and len(window.plan.layout.devices) == 1
    assert not window.board.simulated and len(window.board.rows) == 2
    assert window.plan.excluded == {1} and window.board.rows[1].excluded
    assert window.launch_bar.launch_button.isEnabled()
    assert window.launch_bar.launch_button.text() == "Launch"
    assert "qwen2" in window.model_panel._values["Architecture"].text()
    window.split_editor.spread_button.click()
    assert [d.device.index for d in window.plan.layout.devices] == [0, 1]
    assert window.split_editor._use_boxes[1].isChecked()
    window.split_editor.auto_button.click()
    assert [d.device.index for d in window.plan.layout.devices] == [0]


def test_launch_load_and_chat_streams_into_the_view(qtbot, window):
    with qtbot.waitSignal(window.client.loaded, timeout=15_000):
        window.launch_bar.launch_button.click()
    assert window.tabs.currentIndex() == 1
    assert "priced" in window.launch_bar.report.text()
    assert window.board.launched and window.board.rows[0].ours["weights"] > 0
    qtbot.keyClicks(window.chat.input, "carve me a plan")
    with qtbot.waitSignal(window.client.done, timeout=15_000):
        qtbot.keyClick(window.chat.input, Qt.Key.Key_Return)
        assert not window.chat.send_button.isEnabled()  # one reply at a time
    qtbot.waitUntil(lambda: "You said: carve me a plan" in window.chat.view.toPlainText(),
                    timeout=3000)
    assert "tokens/s" in window.chat.stats.text()
    # regenerate replaces the reply, it does not add a second one
    with qtbot.waitSignal(window.client.done, timeout=15_000):
        window.chat.regen_button.click()
    assert [m.role for m in window.history.messages] == ["user", "assistant"]
    with qtbot.waitSignal(window.client.unloaded, timeout=5000):
        window.launch_bar.unload_button.click()
    assert not window.board.launched


def test_launch_is_refused_when_it_does_not_fit_unless_overridden(qtbot, window, machine_gpus):
    machine_gpus[:] = [nvml_gpu(0, free_mib=100)]  # not even the runtime overhead fits
    window.set_rig("auto")
    assert window.plan.verdict() == "does not fit"
    assert not window.launch_bar.launch_button.isEnabled()
    window.launch_bar.override.setChecked(True)
    assert window.launch_bar.launch_button.isEnabled()


@pytest.mark.parametrize("window", ["crash-load"], indirect=True)
def test_engine_crash_shows_its_stderr_and_the_app_keeps_running(qtbot, window):
    with qtbot.waitSignal(window.client.crashed, timeout=15_000):
        window.launch_bar.launch_button.click()
    assert "crashing mid-load" in window.crash_box.detailedText()
    assert window.isVisible() and window.launch_bar.launch_button.isEnabled()
    assert "status 3" in window.launch_bar.status.text()


def test_presets_and_last_session_survive_a_restart(qtbot, window, synth_model):
    window.plan.set_ctx(1024)
    window.plan.set_kv_type("q8_0")
    window.presets.save_as("small")
    window.close()  # saves the last session
    again = MainWindow(LIGHT, live_poll=False)
    qtbot.addWidget(again)
    again.restore(None, None)
    assert again.rig == "auto" and again.plan.ctx == 1024 and again.plan.kv_type == "q8_0"
    assert again.presets.combo.findText("small") >= 0
    assert PresetStore().recent_files()[0].endswith(synth_model("qwen2").name)


def test_a_bad_file_shows_a_sentence(qtbot, window, tmp_path):
    bad = tmp_path / "not-a-model.gguf"
    bad.write_bytes(b"hello, not a gguf")
    assert not window.open_model(str(bad))
    assert "not-a-model.gguf" in window.model_panel.path.text()
    assert window.plan.layout is not None  # the previous model stays planned


def _run(code: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", PYTHONPATH=str(ROOT), **(env_extra or {}))
    return subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


def test_building_the_window_imports_neither_torch_nor_triton(synth_model, tmp_path):
    code = f"""
import json, sys
from PySide6.QtWidgets import QApplication
app = QApplication([])
from app.window_main import MainWindow
from app.theme import LIGHT
w = MainWindow(LIGHT, live_poll=False)
w.restore({str(synth_model("llama"))!r}, "2x24GiB")
w.show(); app.processEvents()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "triton"))))
"""
    out = _run(code, {"CARVE_CONFIG_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_snapshot_renders_the_window(synth_model, tmp_path):
    png = tmp_path / "carve.png"
    env = dict(os.environ, PYTHONPATH=str(ROOT), CARVE_CONFIG_DIR=str(tmp_path / "cfg"))
    env.pop("QT_QPA_PLATFORM", None)  # --snapshot picks the offscreen platform itself
    out = subprocess.run(
        [sys.executable, "-m", "app", "--snapshot", str(png), "--model", str(synth_model("llama")),
         "--gpus", "4x24GiB", "--theme", "dark"],
        check=False, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    from PySide6.QtGui import QImage

    image = QImage(str(png))
    assert (image.width(), image.height()) == (1280, 800)
    assert not (tmp_path / "cfg" / "last.json").exists()  # a snapshot leaves the session alone


def test_dropping_a_gguf_opens_it(qtbot, window, synth_model):
    from PySide6.QtCore import QMimeData, QPointF, QUrl
    from PySide6.QtGui import QDropEvent

    path = synth_model("gemma3")
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(path))])
    event = QDropEvent(QPointF(10, 10), Qt.DropAction.CopyAction, mime, Qt.MouseButton.NoButton,
                       Qt.KeyboardModifier.NoModifier)
    window.dropEvent(event)
    assert window.plan.hparams.arch == "gemma3" and window.plan.n_layer == 6


def test_typing_a_rig_replans_and_a_bad_one_says_why(qtbot, window):
    combo = window.rig_picker.combo
    combo.setEditText("3x24GiB")
    combo.lineEdit().editingFinished.emit()
    window.split_editor.spread_button.click()
    assert window.rig == "3x24GiB" and len(window.plan.layout.devices) == 3
    assert not window.rig_picker.banner.isVisibleTo(window)  # this machine has GPUs
    combo.setEditText("3xbanana")
    combo.lineEdit().editingFinished.emit()
    assert window.rig == "3x24GiB"
    assert "banana" in window.launch_bar.status.text()


def test_switching_theme_at_run_time_is_remembered(qtbot, synth_model):
    from PySide6.QtWidgets import QApplication

    from app.theme import DARK

    w = MainWindow(LIGHT, live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("llama")), "2x24GiB")
    w.apply_theme(DARK)
    assert w.vram.theme is DARK and w.split_editor.theme is DARK and w.fit.theme is DARK
    assert "#1b1e24" in QApplication.instance().styleSheet()  # the dark sheet is applied
    assert PresetStore().ui()["theme"] == "dark"
    w.apply_theme(LIGHT)



@pytest.mark.parametrize("option, value, words", [
    ("--model", "/nonexistent/model.gguf", "model.gguf"),
    ("--gpus", "3xbanana", "banana"),
])
def test_snapshot_with_a_bad_option_exits_2_with_one_line(tmp_path, option, value, words):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CARVE_CONFIG_DIR=str(tmp_path / "cfg"))
    out = subprocess.run([sys.executable, "-m", "app", "--snapshot", str(tmp_path / "x.png"),
                          option, value], check=False, capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.splitlines() if ln.startswith("carve:")]
    assert len(lines) == 1 and words in lines[0] and "Traceback" not in out.stderr
    assert not (tmp_path / "x.png").exists()


def test_cancel_a_load_then_quit_ends_the_engine(qtbot, window):
    with qtbot.waitSignal(window.client.unloaded, timeout=15_000):
        window.launch_bar.launch_button.click()
        assert window.launch_bar.cancel_button.isVisibleTo(window)
        window.launch_bar.cancel_button.click()
    assert not window.board.launched and window.client.state == "idle"
    assert window.client.is_running()
    window.close()  # quitting ends the engine: nothing is left holding VRAM
    assert not window.client.is_running()


def test_the_load_report_shows_the_measured_runtime_overhead_and_the_runner(window):
    # what the GPU runner's Loaded event carries beyond priced/allocated (engine/runtime)
    gib = 1 << 30
    window.launch_bar.on_loaded([
        {"index": 0, "priced": 5 * gib, "allocated": 5 * gib, "nvml_used": 6 * gib,
         "overhead_measured": 700 << 20, "overhead_priced": 724 << 20, "runner": "triton"},
        {"index": 1, "priced": 5 * gib, "allocated": 5 * gib + (4 << 20)},
    ])
    text = window.launch_bar.report.text()
    assert "GPU 0" in text and "runtime 700" in text and "priced 724" in text
    assert "triton kernels" in text
    assert "differs by 4" in text  # the second GPU: allocated is not the priced figure


def test_a_first_start_assembles_the_demo_model_off_the_gui_thread_and_opens_it(
        qtbot, tmp_path, monkeypatch):
    from engine.gguf import demo

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))  # a newcomer's machine
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    seen: list[str] = []
    w.launch_bar.show_message = lambda text: seen.append(text)  # the bar's status line
    assert w.restore(None, "2x24GiB", assemble_demo=True) == ""
    assert w.assembler is not None and w.plan.gguf is None  # restore returned at once
    qtbot.waitUntil(lambda: w.plan.gguf is not None, timeout=120_000)
    assert Path(w.plan.gguf.paths[0]).name == demo.DEMO_FILENAME
    assert any("Assembling the demo model" in s and " of " in s for s in seen)
    assert w.plan.layout is not None and w.plan.verdict()  # planned like any opened model
    w.close()  # nothing left running
    assert w.assembler.running is False

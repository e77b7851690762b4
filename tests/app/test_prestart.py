"""The window starts the engine process when a model opens (it imports torch and the kernels
while the user reads the plan), takes no GPU memory before Launch, and Launch then only loads."""

from __future__ import annotations

import sys
from pathlib import Path

from app.theme import LIGHT
from app.window_main import MainWindow
from engine.hardware import devices
from tests.app.test_window import nvml_gpu

FAKE = str(Path(__file__).resolve().parents[1] / "fake_engine.py")


def test_opening_a_model_starts_the_engine_and_launch_reuses_it(qtbot, synth_model,
                                                                monkeypatch) -> None:
    monkeypatch.setattr(devices, "snapshot", lambda: [nvml_gpu(0)])
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False,
                   prestart_engine=True)
    qtbot.addWidget(w)
    assert not w.client.is_running()
    with qtbot.waitSignal(w.client.ready, timeout=15_000):
        w.restore(str(synth_model("qwen2")), "auto")
    pid = w.client.pid
    assert w.client.state == "idle" and pid > 0  # started, nothing loaded
    with qtbot.waitSignal(w.client.loaded, timeout=15_000):
        w.launch_bar.launch_button.click()
    assert w.client.pid == pid  # the same process loaded the model
    w.close()
    qtbot.waitUntil(lambda: not w.client.is_running(), timeout=10_000)


def test_without_prestart_nothing_runs_until_launch(qtbot, synth_model, monkeypatch) -> None:
    monkeypatch.setattr(devices, "snapshot", lambda: [nvml_gpu(0)])
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen2")), "auto")
    assert not w.client.is_running()
    w.close()

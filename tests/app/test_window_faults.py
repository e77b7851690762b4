"""The window against engine faults (fake engine): a hung engine is noticed, killed and named,
and one killed mid-reply keeps the conversation text; Launch works again after both."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import psutil
from PySide6.QtCore import Qt

from app.theme import LIGHT
from app.window_main import MainWindow

FAKE = str(Path(__file__).resolve().parents[2] / "tests" / "fake_engine.py")


def make_window(qtbot, synth_model, scenario: str) -> MainWindow:
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, scenario], live_poll=False)
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen2")), "cpu")
    w.show()
    return w


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_hung_engine_is_noticed_killed_and_named(qtbot, synth_model):
    w = make_window(qtbot, synth_model, "hang")
    try:
        w.client.silence_limit = 1.0
        with qtbot.waitSignal(w.client.crashed, timeout=15_000) as crashed:
            w.launch_bar.launch_button.click()
        pid = w.client._proc.processId() or w.client.pid
        assert crashed.args[0].startswith("The engine stopped answering (nothing for")
        assert "stopped answering" in w.launch_bar.status.text()
        assert w.launch_bar.launch_button.isEnabled()
        qtbot.waitUntil(lambda: pid == 0 or gone(pid), timeout=5000)
    finally:
        w.close()


def test_killed_mid_reply_keeps_the_conversation_and_launch_works_again(qtbot, synth_model,
                                                                       monkeypatch):
    monkeypatch.setenv("CARVE_FAKE_TOKEN_DELAY", "0.3")
    w = make_window(qtbot, synth_model, "normal")
    try:
        with qtbot.waitSignal(w.client.loaded, timeout=15_000):
            w.launch_bar.launch_button.click()
        qtbot.keyClicks(w.chat.input, "keep this question")
        with qtbot.waitSignal(w.client.token, timeout=15_000):
            qtbot.keyClick(w.chat.input, Qt.Key.Key_Return)
        pid = w.client.pid
        with qtbot.waitSignal(w.client.crashed, timeout=15_000):
            os.kill(pid, signal.SIGKILL)
        assert gone(pid)
        assert "keep this question" in w.chat.view.toPlainText()
        assert w.history.messages[0].content == "keep this question"
        assert not w.history.streaming
        assert w.launch_bar.status.text().startswith("⚠ The engine was killed.")
        assert w.launch_bar.launch_button.isEnabled()
        with qtbot.waitSignal(w.client.loaded, timeout=15_000):
            w.launch_bar.launch_button.click()
        assert w.client.pid != pid
    finally:
        w.close()
    assert gone(w.client.pid) or not w.client.is_running()

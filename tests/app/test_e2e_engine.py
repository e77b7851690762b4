"""End to end: the window launches the real engine on the demo model (CPU) and a chat reply
streams into the view. Skipped, with the reason shown, when the engine or the model is missing."""

from __future__ import annotations

import importlib.util

import pytest
from PySide6.QtCore import Qt

from app.theme import LIGHT
from app.window_main import MainWindow

pytestmark = [pytest.mark.slow, pytest.mark.demo]


@pytest.fixture
def engine_ready():
    if importlib.util.find_spec("engine.runtime.server") is None:
        pytest.skip("engine/runtime/server.py is not there yet: no real engine to launch")
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed: the engine process cannot run")


def test_chat_reply_streams_from_the_real_engine(qtbot, engine_ready, demo_model_path):
    w = MainWindow(LIGHT, live_poll=False, remember=False)
    qtbot.addWidget(w)
    w.restore(str(demo_model_path), "cpu")
    w.plan.set_ctx(512)
    w.chat.sampling.temperature.setValue(0.0)  # greedy: a short, stable reply
    w.chat.sampling.max_tokens.setValue(12)
    w.show()
    assert w.plan.verdict() != "does not fit", w.plan.layout
    errors = []
    w.client.error.connect(lambda message, fatal: errors.append(message))
    w.client.crashed.connect(errors.append)
    with qtbot.waitSignal(w.client.loaded, timeout=180_000) as loaded:
        w.launch_bar.launch_button.click()
    assert errors == []
    (device,) = loaded.args[0]
    # the one rule: what the GUI priced before launch is what the engine allocated
    assert device["allocated"] == device["priced"] == w.plan.layout.devices[0].allocated
    assert "= priced" in w.launch_bar.report.text()
    tokens = []
    w.client.token.connect(lambda i, t: tokens.append(t))
    qtbot.keyClicks(w.chat.input, "What is 2+2? Answer with one number.")
    with qtbot.waitSignal(w.client.done, timeout=180_000) as done:
        qtbot.keyClick(w.chat.input, Qt.Key.Key_Return)
    assert errors == []
    assert done.args[0]["completion_tokens"] >= 1 and tokens
    reply = w.history.messages[-1].content
    assert reply.strip() and reply == "".join(tokens)
    qtbot.waitUntil(lambda: reply.strip()[:8] in w.chat.view.toPlainText(), timeout=3000)
    assert "4" in reply  # greedy answer of a coder-instruct model to 2+2
    w.close()  # ends the engine
    assert not w.client.is_running()

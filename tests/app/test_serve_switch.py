"""The window's Serve switch (app/widgets/serve_switch.py) against the scripted fake engine: it
serves the launched model over HTTP from the window's own engine process, a server request and a
chat reply wait for each other instead of mixing their tokens, the count of requests served
shows, and switching off (or unloading) stops the server."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import Qt

from app.theme import LIGHT
from app.window_main import MainWindow

httpx = pytest.importorskip("httpx")

FAKE = str(Path(__file__).resolve().parents[1] / "fake_engine.py")


@pytest.fixture
def window(qtbot, synth_model, monkeypatch):
    monkeypatch.setenv("CARVE_FAKE_TOKEN_DELAY", "0.03")  # a reply takes ~0.3 s
    w = MainWindow(LIGHT, engine_program=[sys.executable, FAKE, "normal"], live_poll=False,
                   remember=False)  # fmt: skip
    qtbot.addWidget(w)
    w.restore(str(synth_model("qwen2")), "cpu")
    w.serve.port = 0  # any free port
    w.show()
    yield w
    w.close()


def _launch(qtbot, w) -> None:
    assert not w.serve.button.isEnabled()  # nothing loaded: nothing to serve
    with qtbot.waitSignal(w.client.loaded, timeout=20_000):
        w.launch_bar.launch_button.click()
    assert w.serve.button.isEnabled()


def _post_in_thread(url: str, body: dict) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out["response"] = httpx.post(url + "/chat/completions", json=body, timeout=20)
        except httpx.HTTPError as err:
            out["error"] = err

    threading.Thread(target=run, daemon=True).start()
    return out


def test_serve_answers_from_the_windows_engine_and_queues_with_the_chat(qtbot, window):
    w = window
    _launch(qtbot, w)
    w.serve.button.click()
    assert w.serve.serving and w.serve.url.startswith("http://127.0.0.1:")
    assert "0 requests served" in w.serve.status.text()
    model = Path(w.launched_layout.plan.model).stem

    # a chat reply streams; a server request sent meanwhile waits for it, then gets its own
    qtbot.keyClicks(w.chat.input, "first")
    qtbot.keyClick(w.chat.input, Qt.Key.Key_Return)
    assert w.history.streaming
    got = _post_in_thread(w.serve.url, {"model": model, "messages": [
        {"role": "user", "content": "ping"}]})  # fmt: skip
    qtbot.waitUntil(lambda: bool(got), timeout=20_000)
    res = got["response"]
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["message"]["content"] == (
        "Hello from the fake engine. You said: ping ")
    assert w.history.messages[-1].content == "Hello from the fake engine. You said: first "
    assert [m.role for m in w.history.messages] == ["user", "assistant"]  # the server's: not here
    qtbot.waitUntil(lambda: "1 request served" in w.serve.status.text(), timeout=3000)

    # a chat message sent while a server request runs waits for it, then gets its reply
    got = _post_in_thread(w.serve.url, {"messages": [{"role": "user", "content": "pong"}],
                                        "stream": True})  # fmt: skip
    qtbot.waitUntil(lambda: w.client.state == "generating", timeout=10_000)
    qtbot.keyClicks(w.chat.input, "second")
    qtbot.keyClick(w.chat.input, Qt.Key.Key_Return)
    assert "waiting for the server" in w.chat.stats.text() and w.chat.stop_button.isEnabled()
    qtbot.waitUntil(lambda: bool(got), timeout=20_000)
    lines = [ln[6:] for ln in got["response"].text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    text = "".join(json.loads(ln)["choices"][0]["delta"].get("content", "") for ln in lines[:-1])
    assert text == "Hello from the fake engine. You said: pong "
    qtbot.waitUntil(lambda: len(w.history.messages) == 4 and not w.history.streaming,
                    timeout=20_000)  # fmt: skip
    assert w.history.messages[-1].content == "Hello from the fake engine. You said: second "
    qtbot.waitUntil(lambda: "2 requests served" in w.serve.status.text(), timeout=3000)

    url = w.serve.url
    w.serve.button.click()  # off
    assert not w.serve.serving and w.serve.status.text() == ""
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5)


def test_unloading_the_model_stops_serving(qtbot, window):
    w = window
    _launch(qtbot, w)
    w.serve.button.click()
    url = w.serve.url
    assert httpx.get(url + "/models", timeout=5).json()["data"][0]["object"] == "model"
    with qtbot.waitSignal(w.client.unloaded, timeout=10_000):
        w.client.unload()
    qtbot.waitUntil(lambda: not w.serve.serving, timeout=5000)
    assert not w.serve.button.isChecked() and not w.serve.button.isEnabled()
    assert "no longer loaded" in w.serve.status.text()
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/models", timeout=5)


def test_a_taken_port_is_shown_not_raised(qtbot, window):
    import socket

    w = window
    _launch(qtbot, w)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        w.serve.port = sock.getsockname()[1]
        w.serve.button.click()
        assert not w.serve.serving and not w.serve.button.isChecked()
        assert w.serve.status.text().startswith("⚠ cannot listen on 127.0.0.1:")

"""EngineClient against the scripted fake engine (tests/fake_engine.py) and raw byte streams."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

import pytest

from app.engine_client import EngineClient
from engine.process import protocol

FAKE = str(Path(__file__).resolve().parents[1] / "fake_engine.py")


@pytest.fixture
def make_client(qtbot):
    clients = []

    def make(scenario: str = "normal", program: list[str] | None = None) -> EngineClient:
        client = EngineClient(program or [sys.executable, FAKE, scenario])
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.close_blocking(500)


def started(qtbot, client: EngineClient) -> EngineClient:
    with qtbot.waitSignal(client.ready, timeout=10_000):
        client.start()
    assert client.state == "idle" and client.pid > 0
    return client


def test_load_progress_then_loaded_then_chat(qtbot, make_client):
    client = started(qtbot, make_client())
    progress, tokens = [], []
    client.progress.connect(lambda *a: progress.append(a))
    client.token.connect(lambda i, t: tokens.append(t))
    with qtbot.waitSignal(client.loaded, timeout=10_000) as loaded:
        client.load({"model": "fake"})
    assert client.state == "loaded"
    assert [p[1] for p in progress] == [(100 << 20) * i // 5 for i in range(1, 6)]
    assert all(p[2] == 100 << 20 and p[0] == "weights" for p in progress)
    assert loaded.args[0][0]["priced"] == loaded.args[0][0]["allocated"]
    with qtbot.waitSignal(client.done, timeout=10_000) as done:
        client.generate([{"role": "user", "content": "hi"}], {"temperature": 0.0}, "g1")
        assert client.state == "generating"
    assert "".join(tokens) == "Hello from the fake engine. You said: hi "
    assert done.args[0]["reason"] == "stop" and done.args[0]["request"] == "g1"
    assert client.state == "loaded"
    with qtbot.waitSignal(client.unloaded, timeout=5000):
        client.unload()
    assert client.state == "idle"


def test_stop_cancels_a_flood_within_a_token_or_two(qtbot, make_client):
    client = started(qtbot, make_client("flood"))
    with qtbot.waitSignal(client.loaded, timeout=10_000):
        client.load({})
    tokens = []
    client.token.connect(lambda i, t: tokens.append(t))
    client.generate([{"role": "user", "content": "go"}], {}, "f", max_tokens=2000)
    qtbot.waitUntil(lambda: len(tokens) >= 50, timeout=10_000)
    with qtbot.waitSignal(client.done, timeout=5000) as done:
        client.stop()
    assert done.args[0]["reason"] == "cancelled"
    assert len(tokens) < 2000


def test_engine_error_is_a_signal_not_a_crash(qtbot, make_client):
    client = started(qtbot, make_client("load-error"))
    with qtbot.waitSignal(client.error, timeout=10_000) as err:
        client.load({})
    message, fatal = err.args
    assert "does not fit" in message and not fatal
    assert client.state == "idle" and client.is_running()


def test_crash_mid_load_reports_the_last_stderr_lines(qtbot, make_client):
    client = started(qtbot, make_client("crash-load"))
    with qtbot.waitSignal(client.crashed, timeout=10_000) as crashed:
        client.load({})
    assert "exited with status 3" in crashed.args[0]
    assert "crashing mid-load" in crashed.args[0]
    assert client.state == "stopped" and not client.is_running()


def test_killed_engine_is_reported(qtbot, make_client):
    client = started(qtbot, make_client())
    with qtbot.waitSignal(client.crashed, timeout=10_000) as crashed:
        os.kill(client.pid, signal.SIGKILL)
    assert "killed" in crashed.args[0]


def test_a_hung_engine_is_terminated_then_killed(qtbot, make_client):
    client = started(qtbot, make_client("hang"))
    crashes = []
    client.crashed.connect(crashes.append)
    with qtbot.waitSignal(client.exited, timeout=10_000):
        client.shutdown(grace_ms=200)  # ignores shutdown, EOF and SIGTERM: only SIGKILL ends it
    assert not client.is_running() and crashes == []


def test_close_blocking_ends_a_hung_engine(qtbot, make_client):
    client = started(qtbot, make_client("hang"))
    client.close_blocking(grace_ms=200)
    assert not client.is_running()


def test_normal_shutdown_is_not_a_crash(qtbot, make_client):
    client = started(qtbot, make_client())
    crashes = []
    client.crashed.connect(crashes.append)
    with qtbot.waitSignal(client.exited, timeout=10_000):
        client.shutdown()
    assert crashes == []


def _writer(chunks: list[bytes]) -> list[str]:
    """A program that writes the given byte chunks to stdout with pauses, then waits for EOF."""
    code = textwrap.dedent(f"""
        import sys, time
        for chunk in {chunks!r}:
            sys.stdout.buffer.write(chunk); sys.stdout.buffer.flush(); time.sleep(0.05)
        sys.stdin.read()
    """)
    return [sys.executable, "-c", code]


def test_bad_lines_each_become_one_invalid_data_signal(qtbot, make_client):
    tok = protocol.encode(protocol.Token(7, "é"))
    ready = protocol.encode(protocol.Ready(pid=1))
    chunks = [
        ready + tok,  # two messages in one write
        tok[:9],  # half a message ...
        tok[9:],  # ... and the rest
        b"not json\n",
        b'{"v": 99, "type": "token", "id": 1, "text": "x"}\n',  # wrong version
        b'{"v": 1, "type": "token", "id": "one", "text": "x"}\n',  # wrong field type
        b'{"v": 1, "type": "warp"}\n',  # unknown type
        b"\xff\xfe\n",  # not UTF-8
        protocol.encode(protocol.Load(plan={})),  # a request, not an event
        tok,
    ]
    client = make_client(program=_writer(chunks))
    tokens, invalid = [], []
    client.token.connect(lambda i, t: tokens.append((i, t)))
    client.invalid_data.connect(invalid.append)
    client.start()
    qtbot.waitUntil(lambda: len(tokens) == 3 and len(invalid) == 6, timeout=10_000)
    assert tokens == [(7, "é")] * 3
    assert client.is_running()


def test_an_engine_that_cannot_start(qtbot, make_client):
    client = make_client(program=["/nonexistent/carve-engine"])
    with qtbot.waitSignal(client.crashed, timeout=5000) as crashed:
        client.start()
    assert "could not start" in crashed.args[0]

"""The real window process (`app.window_start.main` under the offscreen platform, driven by
window_signal_driver.py) sent SIGTERM or SIGINT mid-load or mid-reply: it closes as its close
button does, says so in one line, exits 0, and leaves no engine (nor anything the engine
started) running: the engine is gone when the window's close returns, not later by its own
parent watchdog. With the real engine on the tiny model, and with a fake engine that never
answers and ignores shutdown and SIGTERM (the window must escalate to SIGKILL)."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

HERE = Path(__file__).resolve().parent
DRIVER = str(HERE / "window_signal_driver.py")
FAKE = str(HERE.parent / "fake_engine.py")


def _lines(stream, out: queue.Queue) -> None:
    for line in stream:
        out.put(line.rstrip("\n"))
    out.put(None)


def _expect(lines: queue.Queue, prefix: str, seen: list[str], timeout: float = 60) -> str:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            line = lines.get(timeout=max(0.0, end - time.monotonic()))
        except queue.Empty:
            break
        if line is None:
            break
        seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"no {prefix!r} line from the window; it said {seen}")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def signal_the_window(model: Path, when: str, sig: int, program: list[str] = (),
                      env: dict[str, str] | None = None) -> tuple[str, str]:
    """Start the window, signal it at the driver's trigger; (the client state at the trigger,
    the state when the close began). Asserts the exit and that nothing it started runs on."""
    proc = subprocess.Popen(
        [sys.executable, DRIVER, str(model), when, *program],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=os.environ | {"QT_QPA_PLATFORM": "offscreen"} | (env or {}))
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    seen: list[str] = []
    try:
        engine = int(_expect(lines, "engine ", seen).split()[1])
        at = _expect(lines, "trigger ", seen).split()[1]
        family = [engine, *(c.pid for c in psutil.Process(engine).children(recursive=True))]
        os.kill(proc.pid, sig)
        closed = _expect(lines, "closed ", seen, timeout=30).split()[1]
        after = _expect(lines, "after-close ", seen, timeout=30).split()[1]
        rc = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = proc.stderr.read()
    assert rc == 0, (rc, err)
    assert after == "stopped", seen  # the close itself ended the engine
    name = signal.Signals(sig).name
    assert f"carve: {name}: closing the window and its engine" in err, err
    assert "Traceback" not in err, err
    left = [pid for pid in family if _alive(pid)]
    assert not left, f"still running after the window exited: {left}"
    return at, closed


@pytest.mark.parametrize(("when", "sig"), [("load", signal.SIGTERM), ("reply", signal.SIGINT)])
def test_the_real_engine_ends_with_the_window(synth_model, when, sig):
    at, closed = signal_the_window(synth_model("llama"), when, sig)
    if when == "load":
        assert at == "loading", at  # the first progress event of the load
    else:
        assert at == "generating", at  # the first token of the reply


def test_an_engine_that_ignores_shutdown_is_killed_before_the_window_exits(synth_model):
    t0 = time.monotonic()
    at, closed = signal_the_window(synth_model("llama"), "start", signal.SIGTERM,
                                   [sys.executable, FAKE, "hang"])
    assert at == closed == "loading", (at, closed)  # Launch waits on an engine that never answers
    assert time.monotonic() - t0 < 30  # shutdown, 3 s, terminate, 3 s, kill

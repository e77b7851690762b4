"""`carve chat` as a person runs it, with the real engine on the tiny model, faulted mid-reply:
its engine SIGKILLed (one sentence naming the signal, exit 2), Ctrl-C (SIGINT: the reply stops,
the session goes on), SIGTERM to carve chat (exit 143, the engine shut down before it exits).
Each time no process carve chat started is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]


class Chat:
    """`carve chat MODEL` on pipes: stdout and stderr gathered by threads, stdin kept open."""

    def __init__(self, model: Path) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("CARVE_ENGINE_CMD", None)
        # a long reply (the tiny model at temperature 1 rarely samples its end token)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "chat", str(model), "--gpus", "cpu", "--ctx", "2048",
             "--max-tokens", "2000", "--seed", "7", "--temp", "1"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
            env=env)
        self.out, self.err = bytearray(), bytearray()
        for stream, buf in ((self.proc.stdout, self.out), (self.proc.stderr, self.err)):
            threading.Thread(target=self._gather, args=(stream, buf), daemon=True).start()

    @staticmethod
    def _gather(stream, buf: bytearray) -> None:
        while chunk := stream.read1(4096):
            buf.extend(chunk)

    def wait_for(self, buf: bytearray, needle: bytes, after: int = 0, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while (at := buf.find(needle, after)) < 0:
            assert self.proc.poll() is None or time.monotonic() < end, self.report()
            assert time.monotonic() < end, f"never saw {needle!r}: {self.report()}"
            time.sleep(0.01)
        return at + len(needle)

    def ask(self, text: str, after: int = 0) -> int:
        """At the prompt written after byte ``after`` of stdout, send a question; return once
        its reply streams (some bytes after the prompt) with the reply's first byte."""
        start = self.wait_for(self.out, b"> ", after)
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()
        end = time.monotonic() + 60
        while len(self.out) < start + 8:
            assert time.monotonic() < end, f"no reply: {self.report()}"
            time.sleep(0.005)
        return start

    def engine(self) -> psutil.Process:
        (child,) = psutil.Process(self.proc.pid).children()
        return child

    def family(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def report(self) -> str:
        return f"stdout {bytes(self.out[-300:])!r} stderr {bytes(self.err[-800:])!r}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _gone(procs: list[psutil.Process]) -> list[int]:
    left = []
    for p in procs:
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return left


@pytest.fixture
def chat(synth_model):
    c = Chat(synth_model("llama"))
    yield c
    c.close()


def test_engine_killed_mid_reply_is_one_sentence_and_exit_2(chat):
    chat.ask("Tell me a long story.")
    family = chat.family()
    os.kill(chat.engine().pid, signal.SIGKILL)
    rc = chat.proc.wait(timeout=30)
    err = chat.err.decode()
    assert rc == 2, chat.report()
    last = err.strip().splitlines()[-1]
    assert last.startswith("carve: the engine process exited (status -9): killed by SIGKILL, "
                           "by another program or by the system running out of memory"), last
    assert "Traceback" not in err, err
    assert not _gone(family)


def test_ctrl_c_mid_reply_stops_it_and_the_session_goes_on(chat):
    first = chat.ask("Tell me a long story.")
    os.kill(chat.proc.pid, signal.SIGINT)  # what Ctrl-C sends carve chat (the engine has its own
    # session, so a terminal's Ctrl-C never reaches it)
    chat.wait_for(chat.err, b" tokens (stopped)")
    engine = chat.engine()
    chat.ask("And another one.", first)  # the same engine answers the next turn
    assert chat.engine().pid == engine.pid
    os.kill(chat.proc.pid, signal.SIGINT)
    at = chat.wait_for(chat.err, b" tokens (stopped)")
    chat.wait_for(chat.err, b" tokens (stopped)", at)  # both replies were stopped
    family = chat.family()
    chat.proc.stdin.close()  # Ctrl-D
    assert chat.proc.wait(timeout=30) == 0, chat.report()
    assert "Traceback" not in chat.err.decode()
    assert not _gone(family)


def test_sigterm_to_carve_chat_shuts_its_engine_down(chat):
    chat.ask("Tell me a long story.")
    family = chat.family()
    os.kill(chat.proc.pid, signal.SIGTERM)
    assert chat.proc.wait(timeout=30) == 143, chat.report()
    err = chat.err.decode()
    assert "carve: SIGTERM: stopping the engine" in err and "Traceback" not in err, err
    assert not _gone(family)  # gone when carve chat exits: shut down, not left to its watchdog


@pytest.mark.parametrize("value", ["soon", "0", "-5", "1", "inf", "nan"])
def test_a_bad_silence_limit_is_one_line_before_any_engine(synth_model, monkeypatch, capsys,
                                                             value):
    from app import cli_chat

    monkeypatch.setenv("CARVE_SILENCE_LIMIT", value)
    assert cli_chat.main(["chat", str(synth_model("llama")), "--gpus", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"carve: CARVE_SILENCE_LIMIT={value!r}: give the seconds") and \
        "\n" not in err, err

"""A plain-Python client of the engine process, for the CLIs (the GUI has its own, on QProcess).

    with EngineProcess() as engine:
        engine.send(protocol.Load(plan.to_json()))
        for event in engine.events():
            ...

Pure Python, no torch: `app/` imports it. The engine runs in its own session (no controlling
terminal's process group), so a Ctrl-C in the terminal reaches only the CLI, which decides to
send `stop`; the engine's parent watchdog still ends it if the CLI dies.

A hung engine (stopped, frozen, deadlocked in its output) is noticed: while a request of ours
runs, the engine sends some event at least every `protocol.HEARTBEAT` seconds (progress,
tokens, or `alive`); after `silence_limit` seconds with none the client kills it, and the
waiting caller gets EngineExited saying so.
"""

from __future__ import annotations

import collections
import os
import queue
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Self

from engine.process import protocol as p
from spec.errors import CarveError

ENGINE_ENV = "CARVE_ENGINE_CMD"  # a command line replacing `python -m engine.runtime.server` (tests)


SILENCE_ENV = "CARVE_SILENCE_LIMIT"  # seconds of silence before a busy engine counts as hung


def engine_command() -> list[str]:
    override = os.environ.get(ENGINE_ENV, "").strip()
    return shlex.split(override) if override else [sys.executable, "-m", "engine.runtime.server"]


def silence_limit_setting() -> float:
    """CARVE_SILENCE_LIMIT (seconds, more than the engine's heartbeat), else the protocol's."""
    text = os.environ.get(SILENCE_ENV, "").strip()
    if not text:
        return p.SILENCE_LIMIT
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 2 * p.HEARTBEAT or value == float("inf"):
        raise CarveError(f"{SILENCE_ENV}={text!r}: give the seconds a busy engine may stay silent "
                         f"before it is killed, more than {2 * p.HEARTBEAT:g} (default "
                         f"{p.SILENCE_LIMIT:g})")
    return value


class EngineExited(CarveError):
    """The engine process ended while a client waited for it."""


# requests whose answer the client waits for, and the events that end that wait
_ASKS = (p.Load, p.Generate, p.Tokenize, p.Perplexity)
_ANSWERS = (p.Loaded, p.Unloaded, p.Done, p.Error, p.Tokens)


class EngineProcess:
    """Owns one engine process: spawns it, writes requests, reads events, ends it on exit."""

    def __init__(
        self,
        command: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        echo_stderr: bool = False,
        silence_limit: float | None = None,
    ) -> None:
        self.command = list(command) if command else engine_command()
        self._env = env
        self._echo = echo_stderr
        self._events: queue.Queue[p.Event | p.ProtocolError | None] = queue.Queue()
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=20)
        self._write_lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.silence_limit = silence_limit_setting() if silence_limit is None else silence_limit
        self._waiting = 0  # requests sent whose answer has not come back
        self._heard = time.monotonic()  # the last event (or the first request it owes one for)
        self._hung = ""  # why the client killed the engine, when it did

    # ------------------------------------------------------------ lifecycle

    def start(self) -> EngineProcess:
        env = dict(os.environ if self._env is None else self._env)
        # `python -m engine.runtime.server` must find this checkout's package, wherever the CLI runs
        # (the folder holding engine/; engine/ itself on the path would make its `gguf` package
        # shadow the gguf library the kernels read their lookup tables from)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH", "")]))
        try:
            self.proc = subprocess.Popen(
                self.command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
            )
        except OSError as err:
            raise CarveError(
                f"cannot start the engine ({shlex.join(self.command)}): {err}"
            ) from None
        threading.Thread(target=self._read_stdout, daemon=True, name="engine-out").start()
        self._stderr_thread = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr_thread.start()
        threading.Thread(target=self._watch_silence, daemon=True, name="engine-silence").start()
        return self

    def __enter__(self) -> Self:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout: float = 5.0) -> int | None:
        """Ask the engine to shut down, then terminate, then kill. Returns its exit status."""
        proc = self.proc
        if proc is None:
            return None
        if proc.poll() is None:
            try:
                self.send(p.Shutdown())
                proc.stdin.close()  # EOF: the engine exits even if it missed the shutdown
            except (OSError, CarveError, ValueError):
                pass
            for signal_step in (None, proc.terminate, proc.kill):
                if signal_step is not None:
                    signal_step()
                try:
                    proc.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        return proc.returncode

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stderr_tail(self) -> str:
        return "\n".join(self._stderr_tail)

    # ------------------------------------------------------------ I/O

    def send(self, msg: p.Request) -> None:
        if self.proc is None or self.proc.stdin is None:
            raise CarveError("the engine is not started")
        try:
            with self._write_lock:
                if isinstance(msg, _ASKS):
                    if not self._waiting:
                        self._heard = time.monotonic()
                    self._waiting += 1
                self.proc.stdin.write(p.encode(msg))
                self.proc.stdin.flush()
        except (BrokenPipeError, ValueError, OSError):
            raise self._exited() from None

    def next_event(self, timeout: float | None = None) -> p.Event | p.ProtocolError | None:
        """The next event, None after `timeout` seconds; EngineExited once the engine is gone
        and every event it wrote has been read."""
        try:
            item = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if item is None:
            self._events.put(None)  # stays at the end for every later caller
            raise self._exited()
        return item

    def events(self, timeout: float | None = None) -> Iterator[p.Event | p.ProtocolError]:
        """Events until the engine exits (EngineExited) or `timeout` seconds pass with none
        (then the iterator ends)."""
        while (item := self.next_event(timeout)) is not None:
            yield item

    def wait_for(self, *types: type, timeout: float | None = None) -> p.Event:
        """Skip events until one of `types`; an `error` event raises it as a CarveError."""
        while True:
            item = self.next_event(timeout)
            if item is None:
                raise CarveError(f"the engine did not answer within {timeout:.0f} s")
            if isinstance(item, types):
                return item
            if isinstance(item, p.Error):
                raise CarveError(item.message)

    def _exited(self) -> EngineExited:
        if self._hung:
            return EngineExited(self._hung)
        try:
            code = self.proc.wait(timeout=5) if self.proc else None
        except subprocess.TimeoutExpired:
            code = "unknown: it closed its output but still runs"
        self._stderr_thread.join(timeout=1)  # its last words explain the exit
        tail = self._stderr_tail[-1] if self._stderr_tail else ""
        detail = f"; last log line: {tail}" if tail else ""
        how = ""
        if isinstance(code, int) and code < 0:  # a signal ended it: say which, and who sends it
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = f"signal {-code}"
            how = (f": killed by {name}" + (", by another program or by the system running out of "
                                            "memory" if name == "SIGKILL" else ""))
        return EngineExited(f"the engine process exited (status {code}){how}{detail}")

    def _read_stdout(self) -> None:
        decoder = p.LineDecoder(p.EVENTS)
        stream = self.proc.stdout
        while chunk := stream.read1(1 << 16):
            for item in decoder.feed(chunk):
                self._heard = time.monotonic()
                if isinstance(item, _ANSWERS) or (
                        isinstance(item, p.PerplexityResult) and item.chunks >= item.total):
                    with self._write_lock:
                        self._waiting = max(0, self._waiting - 1)
                if not isinstance(item, p.Alive):  # a heartbeat is for this class only
                    self._events.put(item)
        for item in decoder.finish():
            self._events.put(item)
        self._events.put(None)

    def _watch_silence(self) -> None:
        """Kill the engine when a request of ours has heard nothing for silence_limit s."""
        proc = self.proc
        while proc.poll() is None:
            time.sleep(min(1.0, self.silence_limit / 4))
            quiet = time.monotonic() - self._heard
            if self._waiting and quiet > self.silence_limit and proc.poll() is None:
                self._hung = (f"the engine stopped answering (nothing for {quiet:.0f} s while it "
                              "worked on a request), so it was killed; start it again")
                proc.kill()
                return

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode("utf-8", "replace").rstrip("\n")
            self._stderr_tail.append(line)
            if self._echo:
                print(line, file=sys.stderr, flush=True)

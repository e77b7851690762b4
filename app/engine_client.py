"""The one owner of the engine process (qutebrowser's ``guiprocess``/``ipc`` habit).

``EngineClient`` starts ``python -m engine.runtime.server`` in a QProcess, writes requests as JSON lines
and turns each line the engine prints into one Qt signal. A line that does not decode becomes one
``invalid_data`` signal, never an exception. The process dying unasked becomes ``crashed`` with
its last stderr lines. Quitting ends it: ``shutdown`` asks, then terminates, then kills.
A hung engine (stopped, frozen) is killed after ``silence_limit`` seconds without any event
while it starts, loads or answers (the engine sends ``alive`` meanwhile), and ``crashed`` says so.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

import app.pyside_refcount  # noqa: F401  (PySide6 6.12.0 refcount bug: before any Qt call)
from engine.process import protocol

STDERR_KEEP = 40  # lines of engine stderr kept for the crash message
BUSY = ("starting", "loading", "generating")  # states in which the engine owes us events


class EngineClient(QObject):
    """Signals carry plain Python values; ints that may exceed 32 bits travel as ``object``."""

    state_changed = Signal(str)  # "stopped" | "starting" | "idle" | "loading" | "loaded" | "generating"
    ready = Signal()
    progress = Signal(str, object, object, float)  # stage, bytes done, bytes total, bytes/s
    loaded = Signal(list)  # per device: {index, priced, allocated, nvml_used}
    token = Signal(int, str)  # id, text
    done = Signal(dict)  # reason, prompt_tokens, completion_tokens, prefill_tps, decode_tps
    error = Signal(str, bool)  # message a person can act on, fatal
    unloaded = Signal()  # nothing is held any more (after unload, or a cancelled load)
    note = Signal(str)  # something a person should know ("no chat template: using ChatML")
    event = Signal(object)  # every decoded event (protocol dataclass), tokens/perplexity included
    invalid_data = Signal(str)  # one per line that is not a valid protocol event
    crashed = Signal(str)  # exit description + last stderr lines
    exited = Signal()  # the process is gone (asked or not)

    def __init__(self, program: list[str] | None = None, parent: QObject | None = None,
                 silence_limit: float = protocol.SILENCE_LIMIT) -> None:
        super().__init__(parent)
        self.program = program or [sys.executable, "-m", "engine.runtime.server"]
        self.state = "stopped"
        self.pid = 0
        self.stderr_tail: deque[str] = deque(maxlen=STDERR_KEEP)
        self._decoder = protocol.LineDecoder(protocol.EVENTS)
        self._stderr_buf = b""
        self._stopping = False
        self._proc: QProcess | None = None
        self._escalate = QTimer(self)
        self._escalate.setSingleShot(True)
        self._escalate.timeout.connect(self._on_escalate)
        self.silence_limit = silence_limit
        self._heard = time.monotonic()  # the last event, or the start of the current wait
        self._hung = ""  # why this client killed the engine
        self._silence = QTimer(self)
        self._silence.setInterval(int(min(1.0, silence_limit / 4) * 1000))
        self._silence.timeout.connect(self._check_silence)

    # -- process lifetime --------------------------------------------------------------------
    def is_running(self) -> bool:
        return self._proc is not None and self._proc.state() != QProcess.ProcessState.NotRunning

    def start(self) -> None:
        if self.is_running():
            return
        proc = QProcess(self)
        env = QProcessEnvironment.systemEnvironment()
        # NVML and CUDA must number the GPUs the same way (devices are matched by PCI bus).
        env.insert("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        env.insert("PYTHONUNBUFFERED", "1")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env.insert("PYTHONPATH", os.pathsep.join(filter(None, [root, env.value("PYTHONPATH")])))
        proc.setProcessEnvironment(env)
        proc.readyReadStandardOutput.connect(self._on_stdout)
        proc.readyReadStandardError.connect(self._on_stderr)
        proc.finished.connect(self._on_finished)
        proc.errorOccurred.connect(self._on_error_occurred)
        self._proc = proc
        self._stopping = False
        self._hung = ""
        self._decoder = protocol.LineDecoder(protocol.EVENTS)
        self._stderr_buf = b""
        self.stderr_tail.clear()
        self._set_state("starting")
        proc.start(self.program[0], self.program[1:])
        self._silence.start()

    def shutdown(self, grace_ms: int = 3000) -> None:
        """Ask the engine to exit; terminate it after ``grace_ms``, kill it after twice that."""
        if not self.is_running():
            return
        self._stopping = True
        self.send(protocol.Shutdown())
        self._proc.closeWriteChannel()  # the engine also exits when its stdin closes
        self._escalate.setProperty("step", "terminate")
        self._escalate.start(grace_ms)

    def close_blocking(self, grace_ms: int = 3000) -> None:
        """For application quit: the engine is gone (and its VRAM free) when this returns."""
        if not self.is_running():
            return
        self.shutdown(grace_ms)
        proc = self._proc
        if not proc.waitForFinished(grace_ms):
            proc.terminate()
            if not proc.waitForFinished(grace_ms):
                proc.kill()
                proc.waitForFinished(grace_ms)
        self._escalate.stop()

    def _on_escalate(self) -> None:
        if not self.is_running():
            return
        if self._escalate.property("step") == "terminate":
            self._proc.terminate()
            self._escalate.setProperty("step", "kill")
            self._escalate.start(self._escalate.interval())
        else:
            self._proc.kill()

    # -- requests ----------------------------------------------------------------------------
    def send(self, request: protocol.Message) -> bool:
        if not self.is_running():
            return False
        self._proc.write(protocol.encode(request))
        return True

    def load(self, plan_json: dict[str, Any]) -> None:
        self.start()
        if self.send(protocol.Load(plan=plan_json)):
            self._set_state("loading")

    def generate(self, messages: list[dict[str, str]], sampling: dict[str, Any], gen_id: str = "",
                 max_tokens: int | None = None, **more: Any) -> None:
        """`more`: the other Generate fields (prompt, exact_max_tokens), as the server sends."""
        request = protocol.Generate(messages=messages, id=gen_id, sampling=sampling,
                                    max_tokens=max_tokens, **more)
        if self.send(request):
            self._set_state("generating")

    def stop(self) -> None:
        """Cancel the running load or generation (the engine answers within one token)."""
        self.send(protocol.Stop())

    def unload(self) -> None:
        self.send(protocol.Unload())

    # -- engine output -----------------------------------------------------------------------
    def _on_stdout(self) -> None:
        for msg in self._decoder.feed(bytes(self._proc.readAllStandardOutput().data())):
            self._heard = time.monotonic()
            if not isinstance(msg, protocol.Alive):  # a heartbeat is for this class only
                self._dispatch(msg)

    def _check_silence(self) -> None:
        quiet = time.monotonic() - self._heard
        if self.state in BUSY and quiet > self.silence_limit and self.is_running():
            self._hung = (f"The engine stopped answering (nothing for {quiet:.0f} s while it "
                          f"was {self.state}), so it was stopped.")
            self._proc.kill()

    def _dispatch(self, msg: protocol.Message | protocol.ProtocolError) -> None:
        p = protocol
        if isinstance(msg, p.ProtocolError):
            self.invalid_data.emit(f"{msg.message}: {msg.excerpt}")
            return
        if isinstance(msg, p.Token):
            self.token.emit(msg.id, msg.text)
        elif isinstance(msg, p.Progress):
            self.progress.emit(msg.stage, msg.done, msg.total, msg.rate)
        elif isinstance(msg, p.Loaded):
            self._set_state("loaded")
            self.loaded.emit(list(msg.devices))
        elif isinstance(msg, p.Unloaded):
            self._set_state("idle")
            self.unloaded.emit()
        elif isinstance(msg, p.Done):
            self._set_state("loaded")
            self.done.emit(p.to_dict(msg))
        elif isinstance(msg, p.Error):
            if self.state == "loading" or msg.fatal:
                self._set_state("idle")
            elif self.state == "generating":
                self._set_state("loaded")
            self.error.emit(msg.message, msg.fatal)
        elif isinstance(msg, p.Note):
            self.note.emit(msg.message)
        elif isinstance(msg, p.Ready):
            if self.state == "starting":
                self._set_state("idle")
            self.pid = msg.pid
            self.ready.emit()
        self.event.emit(msg)

    def _on_stderr(self) -> None:
        self._stderr_buf += bytes(self._proc.readAllStandardError().data())
        *lines, self._stderr_buf = self._stderr_buf.split(b"\n")
        for line in lines:
            self.stderr_tail.append(line.decode("utf-8", "replace").rstrip())

    def _on_error_occurred(self, err: QProcess.ProcessError) -> None:
        if err == QProcess.ProcessError.FailedToStart:
            self._set_state("stopped")
            self.crashed.emit(f"the engine could not start ({' '.join(self.program)}): "
                              f"{self._proc.errorString()}")

    def _on_finished(self, code: int, status: QProcess.ExitStatus) -> None:
        self._on_stdout()
        for msg in self._decoder.finish():
            self._dispatch(msg)
        self._on_stderr()
        if self._stderr_buf:
            self.stderr_tail.append(self._stderr_buf.decode("utf-8", "replace").rstrip())
            self._stderr_buf = b""
        self._escalate.stop()
        self._silence.stop()
        expected = self._stopping
        self._set_state("stopped")
        if not expected:
            how = ("was killed" if status == QProcess.ExitStatus.CrashExit
                   else f"exited with status {code}")
            tail = "\n".join(list(self.stderr_tail)[-12:])
            first = self._hung or f"The engine {how}."
            self.crashed.emit(first + (f"\n\nLast output:\n{tail}" if tail else ""))
        self.exited.emit()

    def _set_state(self, state: str) -> None:
        if state != self.state:
            if state in BUSY and self.state not in BUSY:
                self._heard = time.monotonic()  # a new wait starts now, not at the last event
            self.state = state
            self.state_changed.emit(state)

"""GUI responsiveness figures of the window, offscreen (a benchmark, not a test).

    python -m benchmarks.bench_gui [--runs N]

Prints one line each:

- startup: ``carve`` spawned -> window shown, and -> model planned (median of N runs, default 3)
- idle: the longest event-loop gap with nothing happening (the machine's noise)
- drag: the longest event-loop gap while a split boundary is dragged through the view
- streaming, streaming Markdown: the longest event-loop gap while the fake engine streams
  500 tokens/s of plain text, then of paragraphs and code
- polling: CPU share of one core spent by the NVML poller (4 Hz)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Self

ROOT = Path(__file__).resolve().parents[1]


def startup(runs: int = 3) -> tuple[float, float]:
    shown, planned = [], []
    for _ in range(runs):
        env = dict(os.environ, CARVE_STARTUP_TIMING=repr(time.time()), PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-m", "app"], capture_output=True, text=True,
                             env=env, cwd=ROOT, timeout=120, check=True).stdout
        figures = dict(line.split() for line in out.splitlines() if line[:5] in ("shown", "plann"))
        shown.append(float(figures["shown"]))
        planned.append(float(figures["planned"]))
    return statistics.median(shown), statistics.median(planned)


class GapMeter:
    """Longest gap between ticks of a 5 ms timer: how long the event loop was blocked."""

    def __init__(self) -> None:
        from PySide6.QtCore import QElapsedTimer, QTimer

        self.gaps: list[int] = []
        self._clock = QElapsedTimer()
        self._timer = QTimer()
        self._timer.setInterval(5)
        self._timer.timeout.connect(lambda: self.gaps.append(self._clock.restart()))

    def __enter__(self) -> Self:
        self._clock.start()
        self._timer.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._timer.stop()

    @property
    def worst(self) -> int:
        return max(self.gaps[1:], default=0)


def drag(window, app) -> tuple[int, float]:
    from PySide6.QtCore import QEvent, QPointF, Qt
    from PySide6.QtGui import QMouseEvent
    from PySide6.QtWidgets import QApplication

    editor = window.split_editor
    view = editor.plot
    view.scene().minDragTime = 0
    vb = view.getPlotItem().getViewBox()
    viewport = view.viewport()
    b = window.plan.split[1]
    hi = window.plan.boundary_bounds(1)[1]

    def at(x: float):
        return view.mapFromScene(vb.mapViewToScene(QPointF(x, 0.5)))

    def send(kind, pos, button, buttons):
        ev = QMouseEvent(kind, QPointF(pos), QPointF(viewport.mapToGlobal(pos)), button, buttons,
                         Qt.KeyboardModifier.NoModifier)
        QApplication.sendEvent(viewport, ev)

    left, none = Qt.MouseButton.LeftButton, Qt.MouseButton.NoButton
    send(QEvent.Type.MouseMove, at(b), none, none)
    send(QEvent.Type.MouseButtonPress, at(b), left, left)
    moves, busy = 0, 0.0
    with GapMeter() as meter:
        for k in range(240):  # ~4 s of dragging back and forth at 60 moves/s
            x = b + (hi - b) * abs(((k / 60) % 2) - 1)
            start = time.perf_counter()
            send(QEvent.Type.MouseMove, at(x), none, left)
            busy = max(busy, time.perf_counter() - start)
            moves += 1
            end = time.perf_counter() + 1 / 60
            while time.perf_counter() < end:
                app.processEvents()
    send(QEvent.Type.MouseButtonRelease, at(b), left, none)
    return meter.worst, busy * 1e3


def streaming(window, app) -> tuple[int, float, int]:
    from app.engine_client import EngineClient

    client = EngineClient([sys.executable, str(ROOT / "tests" / "fake_engine.py"), "flood"])
    h = window.history
    client.token.connect(lambda i, t: h.append(t))
    done = []
    client.done.connect(lambda s: (h.finish(s), done.append(s)))
    client.start()
    client.load({})
    while client.state != "loaded":
        app.processEvents()
    window.tabs.setCurrentIndex(1)
    h.add_user("flood")
    h.begin_reply()
    with GapMeter() as meter:
        client.generate(h.request_messages(), {}, "bench", max_tokens=2000)
        while not done:
            app.processEvents()
    client.close_blocking(1000)
    return meter.worst, window.chat.view.render_ms_max, done[0]["completion_tokens"]


REPLY = ("Here is how the split works.\n\nEach GPU holds a **contiguous** range of layers; "
         "the first also holds `token_embd`.\n\n```python\ndef stage(lo, hi):\n    "
         "return [f'blk.{i}' for i in range(lo, hi)]\n```\n\n- weights move with the boundary\n"
         "- the KV cache follows the layers\n\n")


def streaming_markdown(window, app, tokens: int = 2000) -> tuple[int, float]:
    """500 t/s of Markdown with paragraphs and code (what a chat model writes), in-process."""
    from PySide6.QtCore import QTimer

    words = REPLY.replace(" ", " \x00").split("\x00")
    h = window.history
    h.new_chat()
    h.add_user("explain")
    h.begin_reply()
    window.chat.view.render_ms_max = 0.0
    sent = [0]

    def push() -> None:  # 5 tokens every 10 ms = 500 t/s
        for _ in range(5):
            h.append(words[sent[0] % len(words)])
            sent[0] += 1

    timer = QTimer()
    timer.setInterval(10)
    timer.timeout.connect(push)
    with GapMeter() as meter:
        timer.start()
        while sent[0] < tokens:
            app.processEvents()
        timer.stop()
        h.finish({"reason": "stop"})
        app.processEvents()
    return meter.worst, window.chat.view.render_ms_max


def idle_gap(app, seconds: float = 3.0) -> int:
    with GapMeter() as meter:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            app.processEvents()
    return meter.worst


def polling(seconds: float = 10.0) -> tuple[float, int, str]:
    from PySide6.QtCore import QCoreApplication, QElapsedTimer

    from app.nvml_poller import NvmlPoller
    from engine.hardware.devices import no_gpu_reason, snapshot

    poller = NvmlPoller()
    clock = QElapsedTimer()
    clock.start()
    poller.start()
    while clock.elapsed() < seconds * 1000:
        QCoreApplication.processEvents()
        time.sleep(0.01)
    poller.stop()
    return poller.cpu_fraction(seconds), len(snapshot()), no_gpu_reason()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_gui", description=__doc__.splitlines()[0]
    )
    ap.add_argument("--runs", type=int, default=3, help="startups timed (default 3)")
    args = ap.parse_args(argv)
    os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
    os.environ.setdefault("CARVE_CONFIG_DIR", "/tmp/carve-bench-config")
    shown, planned = startup(max(1, args.runs))
    print(f"startup: window shown {shown:.2f} s after spawn, model planned {planned:.2f} s "
          f"(median of {max(1, args.runs)})")

    from PySide6.QtWidgets import QApplication

    from app.theme import LIGHT
    from app.window_main import MainWindow, _demo_model

    app = QApplication.instance() or QApplication([])
    window = MainWindow(LIGHT, live_poll=False, remember=False)
    window.restore(_demo_model(), "8xh100")
    window.show()
    app.processEvents()
    print(f"idle: max event-loop gap {idle_gap(app)} ms with nothing happening (machine noise)")
    gap, busy = drag(window, app)
    print(f"drag: max event-loop gap {gap} ms while dragging a boundary over 8 GPUs "
          f"(slowest move handled in {busy:.1f} ms, last price {window.plan.price_ms:.2f} ms)")
    gap, render, n = streaming(window, app)
    print(f"streaming: max event-loop gap {gap} ms at 500 tokens/s from the fake engine ({n} "
          f"tokens in one 2000-word paragraph; slowest frame render {render:.1f} ms)")
    gap, render = streaming_markdown(window, app)
    print(f"streaming Markdown: max event-loop gap {gap} ms at 500 tokens/s (paragraphs and "
          f"code, 2000 tokens; slowest frame render {render:.1f} ms)")
    share, n_gpu, reason = polling()
    where = f"{n_gpu} GPU(s)" if n_gpu else f"no GPU here ({reason})"
    print(f"polling: {share * 100:.3f} % of one core at 4 Hz, {where}")
    window.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``carve`` with no subcommand: the window's entry. ``main(argv)`` parses the arguments, opens
the window (or, with no display, plans the model in the terminal) and runs Qt's event loop;
``--snapshot FILE.png`` renders the window offscreen to an image and exits, for docs and for
checking the look headless.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

from PySide6.QtCore import QTimer
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication, QMainWindow

from app.models.presets import PresetStore
from app.theme import RESOURCES, THEMES, style_sheet
from app.window_main import MainWindow


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="carve", description="Carve: plan, launch and chat with GGUF models.")
    p.add_argument("--model", help="GGUF file to open (default: the last one, else the demo model)")
    p.add_argument("--gpus", help='rig to plan for: "auto" (this machine), "4x24GiB", "rtx4090,a6000", "cpu"')
    p.add_argument("--theme", choices=sorted(THEMES), default=None, help="light or dark look")
    p.add_argument("--snapshot", metavar="FILE.png", help="render the window to an image and exit")
    p.add_argument("--size", default="1280x800", help="window size for --snapshot (WxH)")
    p.add_argument("--tab", choices=("plan", "chat"), default="plan", help="tab shown by --snapshot")
    return p


def has_display() -> bool:
    """Whether a window can open: Qt aborts the process when no platform plugin can start."""
    if "QT_QPA_PLATFORM" in os.environ or not sys.platform.startswith("linux"):
        return True
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def plan_in_terminal(args: argparse.Namespace) -> int:
    """No display (a server, an SSH session): plan the model in the terminal instead."""
    from app import cli_plan
    from engine.gguf.demo import demo_model_path
    from spec.errors import CarveError

    try:
        model = args.model or str(demo_model_path())
    except CarveError as err:
        print(f"carve: no display for the window, and {err}", file=sys.stderr)
        return 2
    print("carve: no display (DISPLAY and WAYLAND_DISPLAY are unset): planning in the terminal; "
          "`carve --snapshot out.png` renders the window", file=sys.stderr)  # fmt: skip
    return cli_plan.main(["plan", model, "--gpus", args.gpus or "auto"])


def close_on_signals(window: QMainWindow) -> QTimer:
    """SIGTERM and SIGINT (Ctrl-C in the terminal that started the window, a logout, `kill`)
    close the window as its close button does: the engine is shut down and waited for, so none
    is left holding memory, and the session is remembered. Python runs a signal handler only
    between bytecodes and Qt's event loop runs none, so a timer wakes the interpreter 5 times a
    second; a second signal while the window closes ends the process at once (the engine's
    watchdog then ends the engine). Returns the timer (it lives as long as the window)."""

    def on_signal(signum: int, _frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL)
        print(f"carve: {signal.Signals(signum).name}: closing the window and its engine",
              file=sys.stderr, flush=True)
        QTimer.singleShot(0, window.close)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    timer = QTimer(window)
    timer.timeout.connect(lambda: None)  # a moment of Python for a pending signal's handler
    timer.start(200)
    return timer


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.snapshot and "QT_QPA_PLATFORM" not in os.environ:
        os.environ["QT_QPA_PLATFORM"] = "offscreen"
    if not args.snapshot and not has_display():
        return plan_in_terminal(args)
    app = QApplication.instance() or QApplication([sys.argv[0]])
    app.setApplicationName("Carve")
    app.setDesktopFileName("carve")  # the installed menu entry (installer/install.sh)
    app.setWindowIcon(QIcon(str(RESOURCES / "carve.svg")))
    saved = PresetStore().ui().get("theme")
    theme = THEMES[args.theme or os.environ.get("CARVE_THEME") or
                   (saved if saved in THEMES else "light")]
    app.setStyle("Fusion")
    app.setStyleSheet(style_sheet(theme))
    window = MainWindow(theme, live_poll=not args.snapshot, remember=not args.snapshot,
                        lazy_plots=not args.snapshot, prestart_engine=not args.snapshot)
    if args.snapshot:
        from app.snapshot import render

        return render(window, app, args)
    from engine.hardware import native

    native.prebuild()  # the host-experts kernel, compiled while the window opens
    window.show()
    close_on_signals(window)
    spawned = os.environ.get("CARVE_STARTUP_TIMING")  # set by `python -m benchmarks.bench_gui`
    if spawned:
        app.processEvents()
        print(f"shown {time.time() - float(spawned):.3f}", flush=True)
    QTimer.singleShot(0, window.build_plots)
    QTimer.singleShot(0, lambda: window.restore(args.model, args.gpus, assemble_demo=True))
    if spawned:
        QTimer.singleShot(0, lambda: (print(f"planned {time.time() - float(spawned):.3f}",
                                            flush=True), window.close()))
    return app.exec()

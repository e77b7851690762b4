"""`carve --snapshot FILE.png`: render the window offscreen to an image and exit (docs, and
checking the look headless)."""

from __future__ import annotations

import argparse
import sys

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication


def parse_size(text: str) -> tuple[int, int] | None:
    w, sep, h = text.lower().partition("x")
    if not (sep and w.isdigit() and h.isdigit() and 200 <= int(w) <= 8000 and 200 <= int(h) <= 8000):
        return None
    return int(w), int(h)


def render(window, app: QApplication, args: argparse.Namespace) -> int:
    """Restore, lay out, let the debounced widgets settle, grab. Exit status as a CLI's."""
    size = parse_size(args.size)
    if size is None:
        print(f"carve: --size {args.size!r} is not WIDTHxHEIGHT (e.g. 1280x800)", file=sys.stderr)
        return 2
    window.resize(*size)
    problem = window.restore(args.model, args.gpus)
    if problem:
        print(f"carve: {problem}", file=sys.stderr)
        return 2
    window.tabs.setCurrentIndex(1 if args.tab == "chat" else 0)
    window.show()
    for _ in range(3):
        app.processEvents()
    QTimer.singleShot(300, app.quit)  # the fixes and arena-waste labels update after a pause
    app.exec()
    ok = window.grab().save(args.snapshot)
    window.close()
    if not ok:
        print(f"carve: could not write {args.snapshot}; check that its folder exists",
              file=sys.stderr)
        return 2
    return 0

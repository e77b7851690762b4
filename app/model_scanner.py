"""Scan the usual model folders in a QThread (a big Hugging Face cache takes a while to walk)."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

import app.pyside_refcount  # noqa: F401  (PySide6 6.12.0 refcount bug: before any Qt call)
from app.models.model_scan import common_model_dirs, scan


class _ScanWorker(QObject):
    found = Signal(str)
    finished = Signal(int)

    def __init__(self, dirs: list[Path]) -> None:
        super().__init__()
        self.dirs = dirs

    @Slot()
    def run(self) -> None:
        n = 0
        for path in scan(self.dirs):
            self.found.emit(str(path))
            n += 1
        self.finished.emit(n)


class ModelScanner(QObject):
    """``start()`` walks the folders off the GUI thread; ``found`` fires per file."""

    found = Signal(str)
    finished = Signal(int)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: QThread | None = None
        self._worker: _ScanWorker | None = None

    def start(self, dirs: list[Path] | None = None) -> list[Path]:
        dirs = common_model_dirs() if dirs is None else dirs
        if self._thread is not None:
            return dirs
        self._thread = QThread(self)
        self._worker = _ScanWorker(dirs)
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.run)
        self._worker.found.connect(self.found)
        self._worker.finished.connect(self._on_finished)
        self._thread.start()
        return dirs

    def _on_finished(self, n: int) -> None:
        self._thread.quit()
        self._thread.wait()
        self._thread = self._worker = None
        self.finished.emit(n)

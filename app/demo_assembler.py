"""Assemble the demo model off the GUI thread on the first start, with progress: a window that
finds no model opens the demo model as soon as its installed chunks are joined and verified."""

from __future__ import annotations

from PySide6.QtCore import QObject, QThread, Signal, Slot

import app.pyside_refcount  # noqa: F401  (PySide6 6.12.0 refcount bug: before any Qt call)
from spec.errors import CarveError


def demo_installed() -> bool:
    """Whether the demo model's chunk packages are installed (a header check, no I/O)."""
    from engine.gguf.demo import demo_chunk_paths

    try:
        demo_chunk_paths()
    except (CarveError, ImportError, OSError):
        return False
    return True


class _Worker(QObject):
    progress = Signal(object, object)  # bytes done, bytes total
    finished = Signal(str)  # the verified file
    failed = Signal(str)  # one sentence

    @Slot()
    def run(self) -> None:
        from engine.gguf.demo import demo_model_path

        try:
            path = demo_model_path(assemble=True, on_progress=self.progress.emit)
        except (CarveError, OSError) as err:
            self.failed.emit(str(err).splitlines()[0] if str(err) else type(err).__name__)
            return
        self.finished.emit(str(path))


class DemoAssembler(QObject):
    """``start()`` joins the demo model's chunks on a QThread; ``progress``, then ``finished``
    (the path) or ``failed`` (a sentence) arrive on the GUI thread."""

    progress = Signal(object, object)
    finished = Signal(str)
    failed = Signal(str)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread: QThread | None = None
        self._worker: _Worker | None = None

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = QThread(self)
        self._worker = _Worker()
        self._worker.moveToThread(self._thread)
        self._thread.started.connect(self._worker.run)
        self._worker.progress.connect(self.progress)
        # bound slots of this GUI-thread object: queued, so they run on the GUI thread
        self._worker.finished.connect(self._on_finished)
        self._worker.failed.connect(self._on_failed)
        self._thread.start()

    def wait(self) -> None:
        """Block until the assembly ends (closing the window mid-way: the file is written to a
        partial name and renamed only once verified, so nothing half-made is left)."""
        if self._thread is not None:
            self._thread.quit()
            self._thread.wait()

    @Slot(str)
    def _on_finished(self, path: str) -> None:
        self._stop()
        self.finished.emit(path)

    @Slot(str)
    def _on_failed(self, message: str) -> None:
        self._stop()
        self.failed.emit(message)

    def _stop(self) -> None:
        self._thread.quit()
        self._thread.wait()
        self._thread = self._worker = None

"""NVML polling on its own QThread: ``engine.hardware.devices.snapshot()`` four times a second, results
delivered to the GUI thread by a queued signal (the GUI never waits on the driver)."""

from __future__ import annotations

import time

from PySide6.QtCore import QObject, QThread, QTimer, Signal, Slot

import app.pyside_refcount  # noqa: F401  (PySide6 6.12.0 refcount bug: before any Qt call)

POLL_MS = 250


class _PollWorker(QObject):
    snapshots = Signal(list)

    def __init__(self, interval_ms: int) -> None:
        super().__init__()
        self.interval_ms = interval_ms
        self.busy_s = 0.0  # CPU-side seconds spent in snapshot(), for the polling-cost figure
        self.polls = 0
        self._timer: QTimer | None = None

    @Slot()
    def begin(self) -> None:
        self._timer = QTimer()
        self._timer.setInterval(self.interval_ms)
        self._timer.timeout.connect(self.poll)
        self._timer.start()
        self.poll()

    @Slot()
    def end(self) -> None:
        if self._timer is not None:
            self._timer.stop()

    @Slot()
    def poll(self) -> None:
        from engine.hardware.devices import snapshot

        start = time.thread_time()
        snaps = snapshot()  # [] without a driver; never raises (engine.hardware.devices contract)
        self.busy_s += time.thread_time() - start
        self.polls += 1
        self.snapshots.emit(list(snaps))


class NvmlPoller(QObject):
    snapshots = Signal(list)

    def __init__(self, interval_ms: int = POLL_MS, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._thread = QThread(self)
        self._thread.setObjectName("nvml-poller")
        self.worker = _PollWorker(interval_ms)
        self.worker.moveToThread(self._thread)
        self._thread.started.connect(self.worker.begin)
        self.worker.snapshots.connect(self.snapshots)

    def start(self) -> None:
        if not self._thread.isRunning():
            self._thread.start()

    def stop(self) -> None:
        if self._thread.isRunning():
            QTimer.singleShot(0, self.worker, self.worker.end)
            self._thread.quit()
            self._thread.wait(2000)

    def cpu_fraction(self, wall_s: float) -> float:
        """Share of one core the polling used over ``wall_s`` seconds of running."""
        return self.worker.busy_s / wall_s if wall_s > 0 else 0.0

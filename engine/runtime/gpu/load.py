"""Copy a stage's tensors from the GGUF file's pages into its VRAM spans through a pinned ring.

Reader threads ``preadv`` file ranges into a ring of pinned host buffers (page cache -> pinned,
GIL released), the main thread queues each buffer's host-to-device copy on a copy stream and
hands the buffer back once its event completes. Nothing registers the file's own pages with
the driver (cudaHostRegister on mmapped pages fails on some filesystems, e.g. ZFS).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable

import torch

from spec.errors import CarveError

RING = 8  # pinned buffers
PIECE = 32 << 20  # bytes per buffer
READERS = 6

Piece = tuple[int, int, torch.Tensor]  # (shard, file offset, destination bytes)


def load_tensors(model, names: Iterable[str], spans: dict[str, torch.Tensor],
                 device: torch.device | str,
                 on_progress: Callable[[str, int, int, float], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> tuple[int, float]:
    """Fill ``spans[name]`` (uint8 views) with each tensor's bytes; returns (bytes, seconds)."""
    pieces = _pieces(model, names, spans)
    progress = _Progress(sum(p[2].numel() for p in pieces), on_progress, cancelled)
    if torch.device(device).type != "cuda":
        _load_direct(model, pieces, progress)
    else:
        _load_pinned(model, pieces, device, progress)
    return progress.total, time.perf_counter() - progress.t0


def _pieces(model, names: Iterable[str], spans: dict[str, torch.Tensor]) -> list[Piece]:
    """Each tensor's bytes in pieces of at most PIECE bytes, checked against its span."""
    pieces = []
    for name in names:
        info = model.tensor(name)
        dst = spans[name].view(torch.uint8).reshape(-1)
        if dst.numel() != info.nbytes:
            raise CarveError(f"{name}: the Layout's span holds {dst.numel()} bytes, the file "
                             f"{info.nbytes}; re-plan the model")
        for o in range(0, info.nbytes, PIECE):
            pieces.append((info.shard, info.offset + o, dst[o:o + PIECE]))
    return pieces


class _Progress:
    """Bytes done, reported through ``on_progress`` ("weights", done, total, bytes/s), and the
    cancellation check."""

    def __init__(self, total: int, on_progress, cancelled) -> None:
        self.total, self.done = total, 0
        self.on_progress, self.cancelled = on_progress, cancelled
        self.t0 = time.perf_counter()

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def add(self, n: int) -> None:
        self.done += n
        if self.on_progress is not None:
            dt = time.perf_counter() - self.t0
            self.on_progress("weights", self.done, self.total, self.done / dt if dt > 0 else 0.0)

    def check(self) -> None:
        if self.cancelled is not None and self.cancelled():
            raise CarveError("load cancelled")


def _fds(model) -> list[int]:
    """Descriptors of the model's files as it opened them (GGUFModel.dup_fds): a file renamed
    over or deleted since loads as it was planned and opened, not whatever the path names now."""
    dup = getattr(model, "dup_fds", None)
    return dup() if dup is not None else [os.open(p, os.O_RDONLY) for p in model.paths]


def _read(fd: int, buf: memoryview, off: int, path: str) -> None:
    if os.preadv(fd, [buf], off) != len(buf):
        raise CarveError(f"{path}: short read at byte {off}; the file is truncated")


def _load_direct(model, pieces: list[Piece], progress: _Progress) -> None:
    """CPU stages (the interpreter runs in CI): no pinned ring, no streams; read each piece
    straight from the file into its span."""
    fds = _fds(model)
    try:
        for shard, off, dst in pieces:
            progress.check()
            _read(fds[shard], memoryview(dst.numpy()), off, model.paths[shard])
            progress.add(dst.numel())
    finally:
        for fd in fds:
            os.close(fd)


def _load_pinned(model, pieces: list[Piece], device, progress: _Progress) -> None:
    """GPU stages: readers fill the pinned ring, this thread queues each buffer's copy to the
    device on a copy stream and hands the buffer back to the readers with the copy's event."""
    ring = _Ring(model, pieces)
    stream = torch.cuda.Stream(device)
    progress.start()
    try:
        ring.start()
        for _ in range(len(pieces)):
            j, slot = ring.next_filled()
            dst = pieces[j][2]
            with torch.cuda.stream(stream):
                dst.copy_(ring.buffers[slot][: dst.numel()], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            ring.hand_back(slot, ev)
            progress.add(dst.numel())
            progress.check()
        stream.synchronize()
    finally:
        ring.stop()
        stream.synchronize()  # no copy may still write into arenas the caller frees next


class _Ring:
    """READERS threads that read the pieces, in any order, into a ring of pinned buffers. A
    buffer is reused once the copy out of it (its event) has completed."""

    def __init__(self, model, pieces: list[Piece]) -> None:
        self.paths, self.pieces = model.paths, pieces
        n = min(RING, max(1, len(pieces)))
        self.buffers = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(n)]
        self.events: list[torch.cuda.Event | None] = [None] * n
        self.free: queue.Queue[int] = queue.Queue()
        for i in range(n):
            self.free.put(i)
        self.work: queue.Queue[int] = queue.Queue()
        for i in range(len(pieces)):
            self.work.put(i)
        self.filled: queue.Queue[tuple[int, int] | BaseException] = queue.Queue()
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._reader, daemon=True)
                        for _ in range(READERS)]
        self.fds = _fds(model)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def next_filled(self) -> tuple[int, int]:
        """(piece, buffer) of the next piece read; a reader's error is raised here."""
        item = self.filled.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def hand_back(self, slot: int, copied: torch.cuda.Event) -> None:
        self.events[slot] = copied
        self.free.put(slot)

    def stop(self) -> None:
        self.stopping.set()
        for _ in self.threads:  # wake readers blocked on a free slot (the main loop stopped early)
            self.free.put(0)
        for t in self.threads:
            if t.ident is not None:  # started
                t.join()
        for fd in self.fds:
            os.close(fd)

    def _reader(self) -> None:
        try:
            while not self.stopping.is_set():
                try:
                    j = self.work.get_nowait()
                except queue.Empty:
                    return
                slot = self.free.get()
                if self.stopping.is_set():
                    return
                self._fill(j, slot)
                self.filled.put((j, slot))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            self.filled.put(exc)

    def _fill(self, j: int, slot: int) -> None:
        ev = self.events[slot]
        if ev is not None:
            ev.synchronize()  # the copy out of this buffer has finished
        shard, off, dst = self.pieces[j]
        _read(self.fds[shard], memoryview(self.buffers[slot].numpy())[: dst.numel()], off,
              self.paths[shard])

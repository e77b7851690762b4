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


def load_tensors(model, names: Iterable[str], spans: dict[str, torch.Tensor],
                 device: torch.device | str,
                 on_progress: Callable[[str, int, int, float], None] | None = None,
                 cancelled: Callable[[], bool] | None = None) -> tuple[int, float]:
    """Fill ``spans[name]`` (uint8 views) with each tensor's bytes; returns (bytes, seconds)."""
    pieces = []  # (shard, file offset, dst view)
    for name in names:
        info = model.tensor(name)
        dst = spans[name].view(torch.uint8).reshape(-1)
        if dst.numel() != info.nbytes:
            raise CarveError(f"{name}: the Layout's span holds {dst.numel()} bytes, the file "
                             f"{info.nbytes}; re-plan the model")
        for o in range(0, info.nbytes, PIECE):
            pieces.append((info.shard, info.offset + o, dst[o:o + PIECE]))
    total = sum(p[2].numel() for p in pieces)
    if torch.device(device).type != "cuda":
        return _load_direct(model, pieces, total, on_progress, cancelled)
    fds = [os.open(p, os.O_RDONLY) for p in model.paths]
    ring = [torch.empty(PIECE, dtype=torch.uint8, pin_memory=True) for _ in range(min(RING, max(1, len(pieces))))]
    events: list[torch.cuda.Event | None] = [None] * len(ring)
    free: queue.Queue[int] = queue.Queue()
    for i in range(len(ring)):
        free.put(i)
    work: queue.Queue[int] = queue.Queue()
    for i in range(len(pieces)):
        work.put(i)
    ready: queue.Queue[tuple[int, int] | BaseException] = queue.Queue()
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                try:
                    j = work.get_nowait()
                except queue.Empty:
                    return
                slot = free.get()
                if stop.is_set():
                    return
                ev = events[slot]
                if ev is not None:
                    ev.synchronize()
                shard, off, dst = pieces[j]
                n = dst.numel()
                mv = memoryview(ring[slot].numpy())[:n]
                got = os.preadv(fds[shard], [mv], off)
                if got != n:
                    raise CarveError(f"{model.paths[shard]}: short read at byte {off}; the file "
                                     f"is truncated")
                ready.put((j, slot))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread, which raises it
            ready.put(exc)

    stream = torch.cuda.Stream(device)
    threads = [threading.Thread(target=reader, daemon=True) for _ in range(READERS)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    done = 0
    try:
        for _ in range(len(pieces)):
            item = ready.get()
            if isinstance(item, BaseException):
                raise item
            j, slot = item
            dst = pieces[j][2]
            with torch.cuda.stream(stream):
                dst.copy_(ring[slot][: dst.numel()], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(stream)
            events[slot] = ev
            free.put(slot)
            done += dst.numel()
            if on_progress is not None:
                dt = time.perf_counter() - t0
                on_progress("weights", done, total, done / dt if dt > 0 else 0.0)
            if cancelled is not None and cancelled():
                raise CarveError("load cancelled")
        stream.synchronize()
    finally:
        stop.set()
        for _ in threads:  # wake readers blocked on a free slot (the main loop stopped early)
            free.put(0)
        for t in threads:
            t.join()
        for fd in fds:
            os.close(fd)
        stream.synchronize()  # no copy may still write into arenas the caller frees next
    return total, time.perf_counter() - t0


def _load_direct(model, pieces, total: int, on_progress, cancelled) -> tuple[int, float]:
    """CPU stages (the interpreter runs in CI): no pinned ring, no streams; read each piece
    straight from the file into its span."""
    t0 = time.perf_counter()
    done = 0
    fds = [os.open(p, os.O_RDONLY) for p in model.paths]
    try:
        for shard, off, dst in pieces:
            if cancelled is not None and cancelled():
                raise CarveError("load cancelled")
            n = dst.numel()
            got = os.preadv(fds[shard], [memoryview(dst.numpy())], off)
            if got != n:
                raise CarveError(f"{model.paths[shard]}: short read at byte {off}; the file "
                                 f"is truncated")
            done += n
            if on_progress is not None:
                dt = time.perf_counter() - t0
                on_progress("weights", done, total, done / dt if dt > 0 else 0.0)
    finally:
        for fd in fds:
            os.close(fd)
    return total, time.perf_counter() - t0

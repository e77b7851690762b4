"""Open a GGUF model (one file or a gguf-split set): its shards' headers (engine/gguf/header.py),
checked as one set, and the tensors' bytes.

Our own reader because gguf.GGUFReader builds a numpy record per field and takes seconds on a
150k-token vocabulary; ours reads only the header (pread; nothing past the tensor table) and is
held equal to GGUFReader in tests. A file that shrinks while it is loaded is a CarveError line
naming it (`read_into`), never a SIGBUS of a memory map.
"""

from __future__ import annotations

import mmap
import os
import re
from pathlib import Path
from typing import Any, Self

import numpy as np

from engine.gguf.header import FileStamp, Header, TensorInfo
from spec.errors import CarveError

__all__ = ["FileStamp", "GGUFModel", "TensorInfo", "shard_paths"]

_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


def shard_paths(path: Path) -> list[Path]:
    """All shard paths of the split set ``path`` belongs to ([path] for a single file)."""
    m = _SHARD_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if count < 1 or not 1 <= int(m["no"]) <= count:
        raise CarveError(f"{path}: shard number {m['no']} of {m['count']} is impossible")
    return [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFModel:
    """A model's header, read once. Tensor bytes are mapped lazily by :meth:`tensor_data`."""

    def __init__(self, headers: list[Header]) -> None:
        self._headers = headers
        self.paths: tuple[Path, ...] = tuple(h.path for h in headers)
        self.metadata: dict[str, Any] = headers[0].metadata
        self.tensors: tuple[TensorInfo, ...] = tuple(t for h in headers for t in h.tensors)
        self.alignment: int = headers[0].alignment
        self.file_size: int = sum(h.size for h in headers)
        # per file, as read: the plan made from this model keeps it (Plan.identity)
        self.stamps: tuple[FileStamp, ...] = tuple(h.stamp for h in headers)
        self._by_name: dict[str, TensorInfo] = {}
        for t in self.tensors:
            if t.name in self._by_name:
                raise CarveError(f"{self.paths[t.shard]}: duplicate tensor name {t.name!r}; "
                                 "the file is damaged")
            self._by_name[t.name] = t
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CarveError(f"{self.paths[0]}: no general.architecture in the metadata; "
                             "is this a model file?")
        self.arch: str = arch

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        """Read the header of ``path``; any shard of a split set opens the whole set."""
        path = Path(path)
        paths = shard_paths(path)
        for p in paths if len(paths) > 1 else ():
            if not p.exists():
                raise CarveError(f"{path}: shard {p.name} of the split set is missing; put all "
                                 f"{len(paths)} shards in {p.parent}")
        headers = [Header(p, i) for i, p in enumerate(paths)]
        _check_split(headers)
        return cls(headers)

    def tensor(self, name: str) -> TensorInfo:
        try:
            return self._by_name[name]
        except KeyError:
            raise CarveError(f"{self.paths[0]}: no tensor named {name!r}") from None

    def tensor_data(self, info: TensorInfo) -> np.ndarray:
        """Read-only uint8 view (mmap) of exactly ``info.nbytes`` bytes of the tensor's data.

        A page of a file truncated after it was opened kills the process with SIGBUS when
        touched: loaders read with :meth:`read_into`, which turns that into a CarveError."""
        h = self._headers[info.shard]
        if h.mm is None:  # mapped on first use: opening and loading never map the file
            h.mm = mmap.mmap(h.fd, 0, access=mmap.ACCESS_READ)
        return np.frombuffer(h.mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def read_into(self, info: TensorInfo, start: int, out: memoryview) -> None:
        """Fill ``out`` with the tensor's bytes from ``start`` on, read (pread) from the file
        as it was opened; a file that shrank or changed since is a CarveError, not a crash."""
        h = self._headers[info.shard]
        n = out.nbytes
        if start < 0 or start + n > info.nbytes:
            raise ValueError(f"bytes {start}..{start + n} are outside tensor {info.name}")
        got = 0
        while got < n:
            k = os.preadv(h.fd, [out[got:]], info.offset + start + got)
            if k <= 0:
                break
            got += k
        if got < n:
            now = os.fstat(h.fd).st_size
            raise CarveError(f"{h.path}: the file is now {now} bytes, shorter than the "
                             f"{h.size} it had when opened (truncated or overwritten while "
                             f"loading tensor {info.name}); copy the file again and relaunch")

    def dup_fds(self) -> list[int]:
        """New descriptors (the caller closes them) of the files as this model opened them."""
        return [os.dup(h.fd) for h in self._headers]

    def close(self) -> None:
        """Unmap the files; views from tensor_data that are still alive keep theirs open."""
        for h in self._headers:
            try:
                if h.mm is not None:
                    h.mm.close()
            except BufferError:
                pass
            if h.fd >= 0:
                os.close(h.fd)
                h.fd = -1

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"GGUFModel({str(self.paths[0])!r}, arch={self.arch!r}, "
                f"{len(self.tensors)} tensors, {len(self.paths)} file(s))")


def _check_split(headers: list[Header]) -> None:
    n = len(headers)
    first = headers[0]
    count = first.metadata.get("split.count", 1 if n == 1 else None)
    if n == 1 and isinstance(count, int) and count > 1:
        raise CarveError(f"{first.path}: is shard 1 of a {count}-file split set but its name "
                         "does not say so; rename the shards NAME-0000K-of-0000N.gguf")
    if n > 1 and count != n:
        raise CarveError(f"{first.path}: split.count is {count!r} but the set has {n} files")
    for i, h in enumerate(headers):
        no = h.metadata.get("split.no", i)
        if no != i:
            raise CarveError(f"{h.path}: split.no says shard {no}, its name says shard {i}")
    total = first.metadata.get("split.tensors.count")
    have = sum(len(h.tensors) for h in headers)
    if n > 1 and total is not None and total != have:
        raise CarveError(f"{first.path}: split.tensors.count is {total} but the shards hold "
                         f"{have} tensors; a shard is from another model or damaged")

"""Open a GGUF model (one file or a gguf-split set) and read its header: metadata and tensor table.

Our own reader because gguf.GGUFReader builds a numpy record per field and takes seconds on a
150k-token vocabulary; this one walks the header once with struct over an mmap (nothing past
the tensor table is touched) and is held equal to GGUFReader in tests. Every way a header can
be broken becomes one CarveError line naming the file.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import numpy as np

from spec.errors import CarveError
from spec.quant_types import QUANT, type_name

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_STRING = 64 << 20  # chat templates are kilobytes; a longer string is a corrupt length
_MAX_NESTING = 8
_SHARD_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")

# metadata value type -> (struct char, size); 8 = string, 9 = array
_SCALAR = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
           6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
       10: "<u8", 11: "<i8", 12: "<f8"}
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_STRUCTS = {t: struct.Struct("<" + c).unpack_from for t, (c, _) in _SCALAR.items()}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str  # "blk.3.attn_q.weight"
    shape: tuple[int, ...]  # GGUF order: shape[0] = ne0 (innermost, contiguous)
    ggml_type: int
    shard: int  # index into GGUFModel.paths
    offset: int  # absolute byte offset of the data in that shard file
    nbytes: int
    _layer: int | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # parsed once: pricing asks every tensor's layer on each drag of a boundary
        layer = None
        if self.name.startswith("blk."):
            num = self.name[4:].split(".", 1)[0]
            if num.isdigit():
                layer = int(num)
        object.__setattr__(self, "_layer", layer)

    @property
    def layer(self) -> int | None:
        """N of "blk.N.", else None."""
        return self._layer

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Header:
    """One shard's parsed header."""

    def __init__(self, path: Path, shard: int) -> None:
        self.path = path
        try:
            with open(path, "rb") as f:
                self.size = f.seek(0, 2)
                if self.size < 24:
                    raise CarveError(f"{path}: not a GGUF file ({self.size} bytes, too small "
                                     "for a GGUF header)")
                self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
                # the file as opened: a later rename or delete of the path does not change
                # what read_into reads, and a truncation becomes a short read, not a SIGBUS
                self.fd = os.dup(f.fileno())
        except FileNotFoundError:
            raise CarveError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise CarveError(f"{path}: is a directory, not a GGUF file") from None
        except PermissionError:
            raise CarveError(f"{path}: permission denied; check the file's permissions") from None
        try:
            self._parse(shard)
        except struct.error:
            raise CarveError(f"{path}: truncated or corrupt GGUF header (it runs past the end "
                             f"of the {self.size}-byte file); re-download or re-copy it") from None
        except (UnicodeDecodeError, OverflowError, MemoryError, ValueError) as err:
            raise CarveError(f"{path}: corrupt GGUF header ({type(err).__name__}); "
                             "re-download or re-copy it") from None

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def _fail(self, what: str) -> CarveError:
        return CarveError(f"{self.path}: {what}; the file is damaged or not a GGUF model")

    # -- primitive reads -------------------------------------------------------------------
    def _str(self, pos: int) -> tuple[str, int]:
        (n,) = _U64(self.mm, pos)
        pos += 8
        if n > self.size - pos or n > MAX_STRING:
            raise self._fail(f"string of {n} bytes at byte {pos - 8} is absurd (the file "
                             f"holds {self.size} bytes)")
        return str(self.mm[pos : pos + n], "utf-8", "surrogateescape"), pos + n

    def _str_array(self, pos: int, n: int) -> tuple[list[str], int]:
        # The hot loop for 150k-token vocabularies: one unpack and one slice per string
        # (a numpy guess-and-verify variant was no faster: making 150k str objects dominates).
        # The bound check keeps a corrupt length from copying gigabytes of tensor data.
        mm, q, limit = self.mm, _U64, min(self.size, pos + n * (8 + MAX_STRING))
        out: list[str] = [""] * n
        for i in range(n):
            (ln,) = q(mm, pos)
            pos += 8
            end = pos + ln
            if ln > MAX_STRING or end > limit:
                raise self._fail(f"string of {ln} bytes at byte {pos - 8} in a string array "
                                 "is absurd")
            out[i] = str(mm[pos:end], "utf-8", "surrogateescape")
            pos = end
        return out, pos

    def _value(self, vtype: int, pos: int, key: str, depth: int = 0) -> tuple[Any, int]:
        if vtype in _STRUCTS:
            (v,) = _STRUCTS[vtype](self.mm, pos)
            return v, pos + _SCALAR[vtype][1]
        if vtype == 8:
            return self._str(pos)
        if vtype != 9:
            raise self._fail(f"metadata key {key!r} has unknown value type {vtype}")
        if depth >= _MAX_NESTING:
            raise self._fail(f"metadata key {key!r} nests arrays more than {_MAX_NESTING} deep")
        etype, n = struct.unpack_from("<IQ", self.mm, pos)
        pos += 12
        left = self.size - pos
        min_size = _SCALAR[etype][1] if etype in _SCALAR else 8 if etype == 8 else 12
        if etype not in _SCALAR and etype not in (8, 9):
            raise self._fail(f"metadata key {key!r} is an array of unknown value type {etype}")
        if n * min_size > left:
            raise self._fail(f"metadata key {key!r} claims an array of {n} values, more than "
                             "the file holds")
        if etype in _SCALAR:
            size = _SCALAR[etype][1]
            arr = np.frombuffer(self.mm, dtype=_NP[etype], count=n, offset=pos)
            values = arr.astype(bool).tolist() if etype == 7 else arr.tolist()
            return values, pos + n * size
        if etype == 8:
            return self._str_array(pos, n)
        # an array of arrays stores each element as a bare array value (elem type, count,
        # values) with no value-type tag in front, as gguf.GGUFReader reads it
        items = []
        for _ in range(n):
            item, pos = self._value(9, pos, key, depth + 1)
            items.append(item)
        return items, pos

    # -- header ----------------------------------------------------------------------------
    def _parse(self, shard: int) -> None:
        mm = self.mm
        if mm[:4] != MAGIC:
            raise CarveError(f"{self.path}: not a GGUF file (starts with {bytes(mm[:4])!r}, "
                             "not b'GGUF'); pick a .gguf model")
        (version,) = _U32(mm, 4)
        if version == 1:
            raise CarveError(f"{self.path}: GGUF version 1 is too old to read; convert it again "
                             "with a current llama.cpp")
        if version not in (2, 3):
            if version & 0xFFFF == 0 and (version >> 24) in (2, 3):
                raise CarveError(f"{self.path}: big-endian GGUF is not supported")
            raise CarveError(f"{self.path}: unknown GGUF version {version} (this build reads "
                             "versions 2 and 3); update Carve")
        n_tensors, n_kv = struct.unpack_from("<QQ", mm, 8)
        pos = 24
        if n_kv * 13 > self.size - pos:
            raise self._fail(f"header claims {n_kv} metadata entries, more than the "
                             f"{self.size}-byte file can hold (truncated or corrupt)")
        if n_tensors * 24 > self.size - pos:
            raise self._fail(f"header claims {n_tensors} tensors, more than the "
                             f"{self.size}-byte file can hold (truncated or corrupt)")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key, pos = self._str(pos)
            (vtype,) = _U32(mm, pos)
            value, pos = self._value(vtype, pos + 4, key)
            if key in meta:
                raise self._fail(f"duplicate metadata key {key!r}")
            meta[key] = value
        self.metadata = meta
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise self._fail(f"general.alignment {align!r} is not a power of two")
        self.alignment = align
        raw = []
        for _ in range(n_tensors):
            name, pos = self._str(pos)
            (n_dims,) = _U32(mm, pos)
            if n_dims > MAX_DIMS:
                raise self._fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            shape = struct.unpack_from(f"<{n_dims}Q", mm, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", mm, pos)
            pos += 12
            raw.append((name, shape, ggml_type, offset))
        data_start = pos + (-pos % align)
        self.tensors = [self._tensor(shard, data_start, *r) for r in raw]

    def _tensor(self, shard: int, data_start: int, name: str, shape: tuple[int, ...],
                ggml_type: int, offset: int) -> TensorInfo:
        q = QUANT.get(ggml_type)
        if q is None:
            raise CarveError(f"{self.path}: tensor {name!r} has unknown ggml type {ggml_type}; "
                             "the file needs a newer Carve")
        n = 1
        for d in shape:
            n *= d
            if n >= 1 << 62:
                raise self._fail(f"tensor {name!r} shape {list(shape)} overflows")
        if shape and shape[0] % q.block_size:
            raise self._fail(f"tensor {name!r} rows of {shape[0]} values are not whole "
                             f"{type_name(ggml_type)} blocks of {q.block_size}")
        nbytes = n // q.block_size * q.type_size
        if offset % self.alignment:
            raise self._fail(f"tensor {name!r} data offset {offset} is not aligned to "
                             f"{self.alignment}")
        start = data_start + offset
        if start + nbytes > self.size:
            raise CarveError(f"{self.path}: tensor {name!r} data ends at byte {start + nbytes}, "
                             f"beyond the end of the {self.size}-byte file (truncated download?)")
        return TensorInfo(name, tuple(shape), ggml_type, shard, start, nbytes)


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

    def __init__(self, headers: list[_Header]) -> None:
        self._headers = headers
        self.paths: tuple[Path, ...] = tuple(h.path for h in headers)
        self.metadata: dict[str, Any] = headers[0].metadata
        self.tensors: tuple[TensorInfo, ...] = tuple(t for h in headers for t in h.tensors)
        self.alignment: int = headers[0].alignment
        self.file_size: int = sum(h.size for h in headers)
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
        headers = [_Header(p, i) for i, p in enumerate(paths)]
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
        mm = self._headers[info.shard].mm
        return np.frombuffer(mm, dtype=np.uint8, count=info.nbytes, offset=info.offset)

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

    def close(self) -> None:
        """Unmap the files; views from tensor_data that are still alive keep theirs open."""
        for h in self._headers:
            try:
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


def _check_split(headers: list[_Header]) -> None:
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

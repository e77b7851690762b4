"""One GGUF file's header, parsed: metadata and tensor table (engine/gguf/reader.py opens a model,
one file or a gguf-split set, from these).

The header is walked once with struct over bytes read from the file (pread, the first 8 MiB,
more only where the header is longer: nothing past the tensor table is read, and a file cut
short while it is read is a short read, never a SIGBUS of a memory map). Every way a header can
be broken becomes one CarveError line naming the file. Each file's `FileStamp` (size, mtime, a
digest of the header) lets a plan notice that the file it was made for changed.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from spec.errors import CarveError
from spec.quant_types import QUANT, type_name

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4
MAX_STRING = 64 << 20  # chat templates are kilobytes; a longer string is a corrupt length
_MAX_NESTING = 8

# metadata value type -> (struct char, size); 8 = string, 9 = array
_SCALAR = {0: ("B", 1), 1: ("b", 1), 2: ("H", 2), 3: ("h", 2), 4: ("I", 4), 5: ("i", 4),
           6: ("f", 4), 7: ("?", 1), 10: ("Q", 8), 11: ("q", 8), 12: ("d", 8)}
_NP = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1",
       10: "<u8", 11: "<i8", 12: "<f8"}
_U32 = struct.Struct("<I").unpack_from
_U64 = struct.Struct("<Q").unpack_from
_STRUCTS = {t: struct.Struct("<" + c).unpack_from for t, (c, _) in _SCALAR.items()}
HEADER_READ = 8 << 20  # a header is read this much at a time (a 150k-token vocabulary: ~6 MiB)


class _More(Exception):
    """The header runs past the bytes read so far (to ``need``, where known): read more."""

    def __init__(self, need: int = 0) -> None:
        self.need = need


@dataclass(frozen=True, slots=True)
class FileStamp:
    """One model file as it was when read: what a Plan keeps to notice that the file at its
    path changed before a load (`engine.planning.plan.Plan.identity`)."""

    name: str  # the file's name (the plan keeps the path)
    size: int
    mtime_ns: int
    header_sha256: str  # of the header: magic, metadata and tensor table, what a plan prices

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "mtime_ns": self.mtime_ns,
                "header_sha256": self.header_sha256}

    @classmethod
    def from_json(cls, data: Any) -> FileStamp:
        return cls(str(data["name"]), int(data["size"]), int(data["mtime_ns"]),
                   str(data["header_sha256"]))


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


class Header:
    """One shard's parsed header."""

    def __init__(self, path: Path, shard: int) -> None:
        self.path = path
        self.mm: mmap.mmap | None = None  # mapped on the first tensor_data only
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                self.size, self.mtime_ns = st.st_size, st.st_mtime_ns
                if self.size < 24:
                    raise CarveError(f"{path}: not a GGUF file ({self.size} bytes, too small "
                                     "for a GGUF header)")
                # the file as opened: a later rename or delete of the path does not change
                # what read_into reads, and a truncation becomes a short read, not a SIGBUS
                self.fd = os.dup(f.fileno())
        except FileNotFoundError:
            raise CarveError(f"{path}: no such file") from None
        except IsADirectoryError:
            raise CarveError(f"{path}: is a directory, not a GGUF file") from None
        except PermissionError:
            raise CarveError(f"{path}: permission denied; check the file's permissions") from None
        self.buf = self._pread(0, min(self.size, HEADER_READ))
        try:
            end = self._parse(shard)
            digest = hashlib.sha256(memoryview(self.buf)[:end]).hexdigest()
            self.stamp = FileStamp(path.name, self.size, self.mtime_ns, digest)
        except struct.error:
            raise CarveError(f"{path}: truncated or corrupt GGUF header (it runs past the end "
                             f"of the {self.size}-byte file); re-download or re-copy it") from None
        except (UnicodeDecodeError, OverflowError, MemoryError, ValueError) as err:
            raise CarveError(f"{path}: corrupt GGUF header ({type(err).__name__}); "
                             "re-download or re-copy it") from None
        finally:
            self.buf = b""  # the header's bytes: parsed, no longer needed

    def __del__(self) -> None:
        if getattr(self, "fd", -1) >= 0:
            os.close(self.fd)
            self.fd = -1

    def _pread(self, start: int, n: int) -> bytes:
        """n bytes from ``start`` of the file as opened; a file that shrank is a CarveError."""
        parts, got = [], 0
        while got < n:
            b = os.pread(self.fd, n - got, start + got)
            if not b:
                now = os.fstat(self.fd).st_size
                raise CarveError(f"{self.path}: the file is now {now} bytes, shorter than the "
                                 f"{self.size} it had when opened (truncated or overwritten while "
                                 "its header was read); copy the file again and reopen it")
            parts.append(b)
            got += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _item(self, read: Any, pos: int) -> tuple[Any, int]:
        """``read(pos)`` (one metadata entry or tensor record), reading more of the file and
        trying again while the entry runs past the bytes read so far."""
        while True:
            try:
                return read(pos)
            except (_More, struct.error) as more:
                have = len(self.buf)
                if have >= self.size:
                    raise struct.error("past the end") from None  # the file ends inside it
                need = more.need if isinstance(more, _More) else 0
                want = min(self.size, max(2 * have, need + HEADER_READ))
                self.buf += self._pread(have, want - have)

    def _fail(self, what: str) -> CarveError:
        return CarveError(f"{self.path}: {what}; the file is damaged or not a GGUF model")

    # -- primitive reads -------------------------------------------------------------------
    def _str(self, pos: int) -> tuple[str, int]:
        (n,) = _U64(self.buf, pos)
        pos += 8
        if n > self.size - pos or n > MAX_STRING:
            raise self._fail(f"string of {n} bytes at byte {pos - 8} is absurd (the file "
                             f"holds {self.size} bytes)")
        if pos + n > len(self.buf):
            raise _More(pos + n)
        return str(self.buf[pos : pos + n], "utf-8", "surrogateescape"), pos + n

    def _str_array(self, pos: int, n: int) -> tuple[list[str], int]:
        # The hot loop for 150k-token vocabularies: one unpack and one slice per string
        # (a numpy guess-and-verify variant was no faster: making 150k str objects dominates).
        # The bound check keeps a corrupt length from copying gigabytes of tensor data.
        mm, q, limit = self.buf, _U64, min(self.size, pos + n * (8 + MAX_STRING))
        have = min(limit, len(mm))  # one comparison per string: in the file and read so far
        out: list[str] = [""] * n
        for i in range(n):
            (ln,) = q(mm, pos)
            pos += 8
            end = pos + ln
            if ln > MAX_STRING or end > have:
                if ln > MAX_STRING or end > limit:
                    raise self._fail(f"string of {ln} bytes at byte {pos - 8} in a string "
                                     "array is absurd")
                raise _More(end)
            out[i] = str(mm[pos:end], "utf-8", "surrogateescape")
            pos = end
        return out, pos

    def _value(self, vtype: int, pos: int, key: str, depth: int = 0) -> tuple[Any, int]:
        if vtype in _STRUCTS:
            (v,) = _STRUCTS[vtype](self.buf, pos)
            return v, pos + _SCALAR[vtype][1]
        if vtype == 8:
            return self._str(pos)
        if vtype != 9:
            raise self._fail(f"metadata key {key!r} has unknown value type {vtype}")
        if depth >= _MAX_NESTING:
            raise self._fail(f"metadata key {key!r} nests arrays more than {_MAX_NESTING} deep")
        etype, n = struct.unpack_from("<IQ", self.buf, pos)
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
            if pos + n * size > len(self.buf):
                raise _More(pos + n * size)
            arr = np.frombuffer(self.buf, dtype=_NP[etype], count=n, offset=pos)
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
    def _parse(self, shard: int) -> int:
        """Parse the header; the byte where its tensor table ends."""
        mm = self.buf
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

        def entry(pos: int) -> tuple[tuple[str, Any], int]:
            key, pos = self._str(pos)
            (vtype,) = _U32(self.buf, pos)
            value, pos = self._value(vtype, pos + 4, key)
            return (key, value), pos

        for _ in range(n_kv):
            (key, value), pos = self._item(entry, pos)
            if key in meta:
                raise self._fail(f"duplicate metadata key {key!r}")
            meta[key] = value
        self.metadata = meta
        align = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1):
            raise self._fail(f"general.alignment {align!r} is not a power of two")
        self.alignment = align
        raw = []

        def record(pos: int) -> tuple[tuple[str, tuple[int, ...], int, int], int]:
            name, pos = self._str(pos)
            (n_dims,) = _U32(self.buf, pos)
            if n_dims > MAX_DIMS:
                raise self._fail(f"tensor {name!r} has {n_dims} dimensions (at most {MAX_DIMS})")
            shape = struct.unpack_from(f"<{n_dims}Q", self.buf, pos + 4)
            pos += 4 + 8 * n_dims
            ggml_type, offset = struct.unpack_from("<IQ", self.buf, pos)
            return (name, shape, ggml_type, offset), pos + 12

        for _ in range(n_tensors):
            r, pos = self._item(record, pos)
            raw.append(r)
        data_start = pos + (-pos % align)
        self.tensors = [self._tensor(shard, data_start, *r) for r in raw]
        return pos

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

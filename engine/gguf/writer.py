"""A streaming GGUF v3 writer: header first, then tensor data pulled from a generator.

gguf.GGUFWriter holds every tensor in memory before writing; a 40 GB synthetic model cannot.
This writer computes every offset from the tensor table, writes the header, then streams each
tensor's bytes as the caller yields them. Split sets follow gguf-split: shard names
``stem-00001-of-0000N.gguf``, all metadata in the first shard, ``split.*`` keys in every shard.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from spec.errors import CarveError
from spec.quant_types import quant

# GGUF metadata value types (gguf.constants.GGUFValueType)
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_SCALAR = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f",
           BOOL: "<?", U64: "<Q", I64: "<q", F64: "<d"}
ALIGNMENT = 32

MetaItem = tuple[str, int, Any]  # key, value type, value; ARR values are (elem type, items)
TensorSpec = tuple[str, Sequence[int], int]  # name, GGUF dims (ne0 first), ggml type


def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _value(vtype: int, value: Any) -> bytes:
    if vtype == STR:
        return _str(value)
    if vtype == ARR:
        etype, items = value
        head = struct.pack("<IQ", etype, len(items))
        if etype == STR:
            return head + b"".join(_str(s) for s in items)
        if etype == ARR:
            return head + b"".join(_value(ARR, it) for it in items)
        return head + struct.pack(f"<{len(items)}{_SCALAR[etype][1]}", *items)
    return struct.pack(_SCALAR[vtype], value)


def encode_kv(key: str, vtype: int, value: Any) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + _value(vtype, value)


def _pad(n: int, align: int = ALIGNMENT) -> int:
    return (align - n % align) % align


def tensor_bytes(ggml_type: int, dims: Sequence[int]) -> int:
    q = quant(ggml_type)
    n = 1
    for d in dims:
        n *= d
    return n // q.block_size * q.type_size


def split_names(path: Path, n: int) -> list[Path]:
    """[path] for n == 1, else gguf-split's shard names next to ``path``."""
    if n < 1:
        raise CarveError(f"--split {n}: the number of shards must be 1 or more")
    if n == 1:
        return [path]
    stem = path.name.removesuffix(".gguf")
    return [path.with_name(f"{stem}-{i:05d}-of-{n:05d}.gguf") for i in range(1, n + 1)]


class GGUFSink:
    """Lay out one model over ``len(paths)`` shards and write it."""

    def __init__(self, meta: list[MetaItem], tensors: list[TensorSpec], paths: list[Path]):
        self.meta, self.tensors, self.paths = meta, tensors, paths
        n = len(paths)
        if n > len(tensors):
            raise CarveError(f"--split {n}: more shards than the model's {len(tensors)} tensors")
        sizes = [tensor_bytes(t, d) for _, d, t in tensors]
        # balance bytes over shards, one tensor at least in each
        total, groups, acc = sum(sizes), [[] for _ in range(n)], 0
        for i, size in enumerate(sizes):
            shard = min(n - 1, acc * n // max(total, 1))
            shard = max(shard, n - (len(tensors) - i))  # leave a tensor for every later shard
            groups[shard].append(i)
            acc += size
        self.groups, self.sizes = groups, sizes

    def _header(self, shard: int) -> bytes:
        n = len(self.paths)
        kvs = list(self.meta) if shard == 0 else []
        if n > 1:
            kvs += [("split.no", U16, shard), ("split.count", U16, n),
                    ("split.tensors.count", I32, len(self.tensors))]
        parts = [b"GGUF", struct.pack("<IQQ", 3, len(self.groups[shard]), len(kvs))]
        parts += [encode_kv(*kv) for kv in kvs]
        offset = 0
        for i in self.groups[shard]:
            name, dims, ggml_type = self.tensors[i]
            parts.append(_str(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims,
                                                   ggml_type, offset))
            offset += self.sizes[i] + _pad(self.sizes[i])
        head = b"".join(parts)
        return head + b"\0" * _pad(len(head))

    def write(self, payload: Callable[[str, int, int], Iterable[bytes | memoryview]]) -> None:
        """``payload(name, ggml_type, nbytes)`` yields exactly nbytes for each tensor."""
        for shard, path in enumerate(self.paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "wb", buffering=0) as f:
                f.write(self._header(shard))
                for i in self.groups[shard]:
                    name, _, ggml_type = self.tensors[i]
                    written = 0
                    for chunk in payload(name, ggml_type, self.sizes[i]):
                        written += f.write(chunk)
                    if written != self.sizes[i]:
                        raise AssertionError(f"{name}: payload gave {written} of {self.sizes[i]} B")
                    f.write(b"\0" * _pad(self.sizes[i]))

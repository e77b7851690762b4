"""A synthetic model's header without a file: what pricing and the split search read (paths,
metadata, tensor table), for planning a shape without writing its data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.gguf.reader import TensorInfo
from engine.synth.contents import metadata, tensor_table
from engine.synth.gen import tensor_types
from engine.synth.shapes import Shape
from spec.errors import CarveError
from spec.quant_types import tensor_nbytes


class HeaderModel:
    """A model's header without a file: what pricing reads (paths, metadata, tensors)."""

    def __init__(self, shape: Shape, mix: str | None = None, name: str = "synthetic.gguf") -> None:
        mix = mix or shape.mix
        self.paths = (Path(name),)
        self.metadata: dict[str, Any] = {
            k: (v[1] if isinstance(v, tuple) else v) for k, _, v in metadata(shape, mix)
        }
        self.arch = shape.arch
        self.alignment = 32
        types = tensor_types(shape, mix)
        tensors, off = [], 0
        for tname, dims in tensor_table(shape):
            n = 1
            for d in dims:
                n *= d
            nb = tensor_nbytes(types[tname], n)
            tensors.append(TensorInfo(tname, tuple(dims), types[tname], 0, off, nb))
            off += -(-nb // 32) * 32
        self.tensors = tuple(tensors)
        self.file_size = off

    def tensor(self, name: str) -> TensorInfo:
        for t in self.tensors:
            if t.name == name:
                return t
        raise CarveError(f"{self.paths[0]}: no tensor named {name!r}")

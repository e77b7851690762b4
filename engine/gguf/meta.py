"""Reading a GGUF's metadata and checking it against the file's tensors: typed ``{arch}.*``
keys whose errors name the file and key, and the consistency checks every architecture's
hyper-parameters go through (engine/gguf/hparams.py, hparams_moe.py)."""

from __future__ import annotations

import math
from typing import Any

from engine.gguf.reader import GGUFModel
from spec.errors import CarveError


class Meta:
    """Typed access to ``{arch}.*`` keys with errors that name the file and key."""

    def __init__(self, model: GGUFModel) -> None:
        self.md, self.arch, self.path = model.metadata, model.arch, model.paths[0]

    def _get(self, key: str, default: Any, kind: type, required: bool) -> Any:
        full = f"{self.arch}.{key}"
        if full not in self.md:
            if required:
                raise CarveError(f"{self.path}: metadata key {full} is missing; the file is "
                                 "incomplete or from an unsupported converter")
            return default
        v = self.md[full]
        if isinstance(v, list) and v and all(x == v[0] for x in v):
            v = v[0]  # a per-layer array with one value throughout is that value
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else \
            isinstance(v, int) and not isinstance(v, bool) if kind is int else isinstance(v, kind)
        if not ok:
            raise CarveError(f"{self.path}: metadata key {full} is {v!r}, expected one "
                             f"{kind.__name__}; per-layer values are not supported")
        return kind(v)

    def int_(self, key: str, default: int = 0, required: bool = False) -> int:
        return self._get(key, default, int, required)

    def float_(self, key: str, default: float = 0.0, required: bool = False) -> float:
        return self._get(key, default, float, required)

    def str_(self, key: str, default: str | None = None) -> str | None:
        return self._get(key, default, str, False)


def check_shapes(model: GGUFModel, expect: dict[str, tuple[int, ...]],
                  required: bool = True) -> None:
    # metadata that disagrees with the tensors would misprice every KV cache and buffer;
    # ``required`` False: a tensor the file lacks is not checked
    by_name = {t.name: t for t in model.tensors if t.name in expect}
    for name, shape in expect.items():
        t = by_name.get(name)
        if t is None and not required:
            continue
        if t is None:
            raise CarveError(f"{model.paths[0]}: tensor {name} is missing; the metadata "
                             "describes more layers or parts than the file holds")
        if t.shape != shape:
            raise CarveError(f"{model.paths[0]}: tensor {name} has shape {list(t.shape)} but "
                             f"the metadata implies {list(shape)}; the file is inconsistent")


_FLOAT32_MAX = 3.4028234663852886e38  # the engine computes in float32 at most: beyond is inf


def within(model: GGUFModel, key: str, value: float, ok: bool, rule: str) -> None:
    """A number the engine computes with must be finite and in its domain: a NaN base or a
    negative window would load, then give NaN logits or fail deep in a kernel."""
    if not (math.isfinite(value) and abs(value) <= _FLOAT32_MAX and ok):
        raise CarveError(f"{model.paths[0]}: {model.arch}.{key} is {value!r}; it must be {rule}")


def blocks_held(model: GGUFModel) -> int:
    """How many layers the file's tensors reach: one more than the highest ``blk.N.`` index."""
    top = -1
    for t in model.tensors:
        if t.name.startswith("blk."):
            index = t.name[4:].split(".", 1)[0]
            if index.isdigit():
                top = max(top, int(index))
    return top + 1


def check_layers_alike(model: GGUFModel, n_run: int) -> None:
    """Every run layer's tensor of a role has the shape the first layer holding that role
    gave it: the families here have no per-layer widths, and a later layer's transposed or
    resized matrix would otherwise load and fail mid-reply (or, on the GPU, read past it)."""
    first: dict[str, tuple[int, tuple[int, ...]]] = {}
    for t in model.tensors:
        if t.layer is None or not 0 <= t.layer < n_run:
            continue
        role = t.name.split(".", 2)[2]
        layer, shape = first.setdefault(role, (t.layer, t.shape))
        if t.shape != shape:
            raise CarveError(f"{model.paths[0]}: tensor {t.name} has shape {list(t.shape)} but "
                             f"blk.{layer}.{role} has {list(shape)}; the file is inconsistent")


def check_layers_complete(model: GGUFModel, n_run: int, n_dense: int) -> None:
    """Every run layer holds the attention and norm tensors layer 0 holds, and every dense one
    the FFN tensors of layer 0 (the experts are checked by `hparams_moe.read_moe`): a file missing one
    would load and fail at its first token."""
    roles: dict[int, set[str]] = {}
    for t in model.tensors:
        if t.layer is not None and 0 <= t.layer < n_run:
            roles.setdefault(t.layer, set()).add(t.name.split(".", 2)[2])
    first = roles.get(0, set())
    every = {r for r in first if r.startswith("attn_") or "norm" in r}
    dense = {r for r in first if r.startswith("ffn_") and "norm" not in r} if n_dense else set()
    for i in range(n_run):
        want = every | (dense if i < n_dense else set())
        missing = sorted(want - roles.get(i, set()))
        if missing:
            raise CarveError(f"{model.paths[0]}: tensor blk.{i}.{missing[0]} is missing (layer 0 "
                             "has it); the file is incomplete")


def tensor_shapes(model: GGUFModel) -> dict[str, tuple[int, ...]]:
    return {t.name: tuple(t.shape) for t in model.tensors}

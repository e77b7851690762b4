"""`default_plan`: the one way a Plan is built from what a person asked for. `carve chat`,
`carve plan` and the window all call it, so a setting left out gets the same value everywhere:
the context from `rules.default_ctx`, activations from `rules.act_dtype_for`, and boundaries
from the split search when none are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.hardware.devices import DeviceSpec
from engine.planning.carve import model_index
from engine.planning.plan import Plan
from engine.planning.rules import (
    CACHE_RESERVE,
    PREFILL_CHUNK,
    KvType,
    act_dtype_for,
    default_ctx,
)
from engine.planning.split import auto_split


def default_plan(
    model: Any,
    devices: Sequence[DeviceSpec],
    *,
    split: Sequence[int] | None = None,
    ctx: int | None = None,
    kv_type: str = KvType.F16,
    prefill_chunk: int = PREFILL_CHUNK,
    cache_reserve: int = CACHE_RESERVE,
    arena: str = "packed",
    logits_rows: int = 1,
    prefer: str = "auto",
    model_path: str | None = None,
) -> Plan:
    """A Plan for `model` (an open GGUF) on `devices`. `split` None: one device runs every
    layer; of several, `engine.planning.split.auto_split` picks the devices and boundaries
    (`prefer` as there: "auto" keeps a model that fits on one device on one).
    `ctx` None: the default context for this model. `logits_rows` is capped at the prefill
    chunk (perplexity asks for a row per position of a chunk)."""
    devices = tuple(devices)
    path = model_path or str(model.paths[0])
    if ctx is None:
        ctx = default_ctx(model_index(model).hp.n_ctx_train)
    settings: dict[str, Any] = {
        "ctx": ctx,
        "kv_type": kv_type,
        "prefill_chunk": prefill_chunk,
        "cache_reserve": cache_reserve,
        "arena": arena,
        "act_dtype": act_dtype_for(devices),
        "logits_rows": min(logits_rows, prefill_chunk),
    }
    if split is None and len(devices) == 1:  # nothing to search: the one device runs it all
        split = (0, model_index(model).n_layer)
    if split is None:
        return auto_split(model, devices, prefer=prefer, model_path=path, **settings)
    return Plan(path, devices, tuple(split), **settings)

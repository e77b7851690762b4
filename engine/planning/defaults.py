"""`default_plan`: the one way a Plan is built from what a person asked for. `carve chat`,
`carve plan` and the window all call it, so a setting left out gets the same value everywhere:
the context from `rules.default_ctx`, activations from `rules.act_dtype_for`, boundaries
from the split search when none are given, and for a mixture-of-experts model that does not
fit in VRAM, the placement of experts in host memory that keeps the most layers' experts in
VRAM (`place_experts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from engine.hardware.devices import DeviceSpec
from engine.planning.carve import is_expert, model_index
from engine.planning.plan import Plan
from engine.planning.rules import (
    CACHE_RESERVE,
    PREFILL_CHUNK,
    KvType,
    act_dtype_for,
    default_ctx,
)
from engine.planning.split import auto_split
from engine.planning.stage import StageKey, fits, host_bytes, stage_key, stage_need


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
    experts_resident: Sequence[int] | None = None,
    expert_slots: Sequence[int] = (),
    host: DeviceSpec | None = None,
    host_compute: str = "auto",
) -> Plan:
    """A Plan for `model` (an open GGUF) on `devices`. `split` None: one device runs every
    layer; of several, `engine.planning.split.auto_split` picks the devices and boundaries
    (`prefer` as there: "auto" keeps a model that fits on one device on one).
    `ctx` None: the default context for this model. `logits_rows` is capped at the prefill
    chunk (perplexity asks for a row per position of a chunk). `experts_resident` None: every
    MoE layer's experts in VRAM when that fits, else `place_experts`; `host`: the host memory
    pinned experts are priced against (None: this machine's, read when priced);
    `host_compute` "auto": `auto_host_compute` once the experts are placed."""
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
        "host": host,
        "host_compute": "gpu" if host_compute == "auto" else host_compute,
    }
    if split is None and len(devices) == 1:  # nothing to search: the one device runs it all
        split = (0, model_index(model).n_layer)
    if split is None:
        plan = auto_split(model, devices, prefer=prefer, model_path=path, **settings)
    else:
        plan = Plan(path, devices, tuple(split), **settings)
    plan = replace(plan, identity=tuple(getattr(model, "stamps", ())))  # checked at load
    slots = tuple(expert_slots)
    if len(slots) == 1:  # one count: every device of the plan
        slots *= len(plan.devices)
    if slots:
        plan = replace(plan, expert_slots=slots)
    if experts_resident is not None:
        plan = replace(plan, experts_resident=tuple(experts_resident))
    else:
        plan = place_experts(plan, model)
    return auto_host_compute(plan, model) if host_compute == "auto" else plan


def auto_host_compute(plan: Plan, model: Any) -> Plan:
    """Where Auto runs a placed plan's host experts: "both" (decode split between the CPU and
    the GPU, the CPU's share timed at load: none where the CPU is too slow to help) where
    this machine runs the CPU's native expert kernel and it reads every host layer's experts
    from the file's bytes, so that "both" prices exactly what "gpu" does; else (no host
    layer, expert-cache slots, which feed the GPU, or a layer the kernel does not read)
    "gpu". Measured on an H100 host, Qwen3-30B-A3B at 11 GiB: "both" 88-91 t/s, "gpu" 71."""
    from engine.hardware import native
    from engine.planning.stage import host_cut, native_covers

    if any(plan.expert_slots) or plan.devices[0].is_cpu:
        return replace(plan, host_compute="gpu")
    idx = model_index(model)
    hosts = [i for s in range(len(plan.devices)) for k in [stage_key(plan, s)]
             for i in idx.moe_layers(host_cut(idx, k), k.hi)]
    covered = bool(hosts) and native.available() and all(
        native_covers(idx, [r for r in idx.layer_requests[i] if is_expert(r[0])])
        for i in hosts)
    return replace(plan, host_compute="both" if covered else "gpu")


def place_experts(plan: Plan, model: Any) -> Plan:
    """`plan` as it is when every stage fits with all its experts in VRAM (or the model has
    none); else, per GPU that does not fit, the most of its MoE layers' experts it can keep in
    VRAM and still leave the cache reserve free (else: fit at all), the others in pinned host
    memory, as long as host RAM takes them all. A stage that does not fit even with every
    expert in host memory keeps them all (the bill then says what overflows)."""
    idx = model_index(model)
    if plan.devices[0].is_cpu or not any(idx.expert_slot):
        return plan
    from engine.planning.capability import gpu_why_not

    if gpu_why_not(plan, idx.hp) is not None:  # the torch engine keeps experts in VRAM
        return plan
    keys = [stage_key(plan, i) for i in range(len(plan.devices))]
    if all(fits(idx, k) for k in keys):
        return plan
    from engine.planning.price import host_memory

    host = host_memory(plan)
    room = host.free - host.reserve
    counts = []
    for k in keys:
        moe = len(idx.moe_layers(k.lo, k.hi))
        best = moe
        if not fits(idx, k):
            for keep in (k.cache_reserve, 0):
                r = _most_resident(idx, k, moe, keep)
                if r is not None:
                    best = r
                    break
        counts.append(best)
        room -= host_bytes(idx, replace(k, resident=best))
    if room < 0:  # host RAM cannot take them: leave the plan as asked, the bill says why
        return plan
    return replace(plan, experts_resident=tuple(counts))


def resident_without_reserve(model: Any, plan: Plan, i: int) -> int:
    """How many of GPU ``i``'s MoE layers could keep their experts in VRAM if the plan kept
    no cache reserve free, where the reserve is what limits the count it keeps now (the most
    that leave the reserve free, as Auto keeps); else the count it keeps now. What the reserve
    costs a stage whose experts overflow into host memory."""
    idx = model_index(model)
    k = stage_key(plan, i)
    moe = len(idx.moe_layers(k.lo, k.hi))
    now = min(plan.resident(i), moe)
    if now == moe or now != _most_resident(idx, k, moe, k.cache_reserve):
        return now
    return max(now, _most_resident(idx, k, moe, 0) or 0)


def _most_resident(idx: Any, k: StageKey, moe: int, keep: int) -> int | None:
    """The most of the stage's ``moe`` MoE layers that keep their experts in VRAM with
    ``keep`` bytes left free; None when even none does (the need grows with the count)."""

    def ok(r: int) -> bool:
        return stage_need(idx, replace(k, resident=r)) + keep <= k.device.free - k.device.reserve

    if not ok(0):
        return None
    lo, hi = 0, moe
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo

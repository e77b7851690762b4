"""price(plan, model) -> Layout: every byte the engine will allocate, per device, by pure arithmetic.

Terms per stage, in the order the engine allocates them (DESIGN.md "The one rule"):
weights of its layers (the carve) · globals · KV cache · activation buffers · dequant cache,
plus the runtime overhead (calibration) and the allocator's rounding (arena mode).

The pipeline: what each stage needs (`carve`, `buffers`, gathered per stage by `stage`) -> how
it is arranged in memory (`arena`, `layout`) -> here, the dequant cache from what is left and
the verdict (`rules.Verdict`) -> `advice` for a stage that does not fit. Nothing below calls up.

Pricing runs while a user drags a boundary, so everything that depends only on the model is
computed once per model (`model_index`), and stages are cached by their inputs: moving one
boundary re-prices only the two stages beside it.
"""

from __future__ import annotations

from typing import Any

from engine.hardware.calibration import overhead_for
from engine.planning import capability
from engine.planning.advice import advise
from engine.planning.arena import align_up, reserved_bytes, round_block, segment_size
from engine.planning.carve import ModelIndex, model_index
from engine.planning.host import HostLayout
from engine.planning.layout import TERMS, Arena, DeviceLayout, Layout, LazyArenas, human
from engine.planning.plan import Plan
from engine.planning.rules import MIB, ArenaKind, Verdict, parse_arena
from engine.planning.stage import (
    ModelCache,
    StageKey,
    allocations,
    arenas,
    host_bytes,
    host_terms,
    scratch_elements,
    stage_key,
)
from spec.errors import CarveError
from spec.runners import Runner

# priced stages: the window re-prices the same stages as a boundary is dragged
_STAGES = ModelCache(512)


def _gemm_elements(t: Any) -> int:
    """Scratch elements a matrix left out of the cache needs: a layer matrix runs prefill GEMMs
    from the scratch; the head does so only for multi-row logits, which `scratch_elements` prices."""
    return t.n_elements if t.layer is not None else 0


def _in_range(idx: ModelIndex, k: StageKey) -> list[tuple[int, Any, int]]:
    return [c for c in idx.cacheable if k.lo <= c[0] < k.hi]


def price_stage(idx: ModelIndex, k: StageKey) -> DeviceLayout:
    """One device's share: its carve, KV, buffers, then the dequant cache from what is left."""
    overhead, source = overhead_for(k.device)  # in the key: a new calibration re-prices
    cache_key = (idx.token, k, overhead)
    hit = _STAGES.get(cache_key)
    if hit is not None:
        return hit
    dev, mode, gpu = k.device, parse_arena(k.arena), not k.device.is_cpu
    avail = dev.free - dev.reserve
    dq0: list[int] | int = 0 if mode.kind == ArenaKind.PACKED else []
    allocs, _ = allocations(idx, k, mode, scratch_elements(idx, k), dq0)
    budget = avail - overhead - reserved_bytes(allocs, gpu) - k.cache_reserve
    slack = 2 * MIB if gpu else 0  # the cache's own rounding to the allocator's 2 MiB grain
    everything = idx.cache_aligned_prefix[k.hi] - idx.cache_aligned_prefix[k.lo]
    all_in = mode.kind == ArenaKind.PACKED and everything + slack <= budget
    chosen: list[Any] | None = None  # None: every cacheable matrix of the stage (packed fast path)
    skipped = 0
    if not all_in:
        chosen, used = [], 0
        for _, t, nb in _in_range(idx, k) if budget > slack else ():
            cost = align_up(nb)
            if gpu and mode.kind == ArenaKind.PER_TENSOR:  # upper bound: a segment of its own
                cost = segment_size(round_block(cost))
            if used + cost + slack <= budget:
                chosen.append(t)
                used += cost
            else:
                skipped = max(skipped, _gemm_elements(t))
        if budget <= slack:
            skipped = -1  # nothing cached: the scratch serves every matrix
    while True:  # exact check; drop the least-benefit matrix if the rounding overshoots
        scratch = (
            scratch_elements(idx, k)
            if skipped < 0
            else scratch_elements(idx, k, "uncacheable", skipped)
        )
        dq = everything if chosen is None else [t.n_elements * 2 for t in chosen]
        allocs, terms = allocations(idx, k, mode, scratch, dq)
        allocated = reserved_bytes(allocs, gpu)
        if chosen == [] or allocated + overhead + k.cache_reserve <= avail:
            break
        if chosen is None:  # the fast path's guess overshot: fall back to the explicit list
            chosen = [c[1] for c in _in_range(idx, k)]
        dropped = chosen.pop()
        skipped = max(skipped, _gemm_elements(dropped))
    terms["dequant_cache"] = (
        (idx.cache_prefix[k.hi] - idx.cache_prefix[k.lo])
        if chosen is None
        else sum(t.n_elements * 2 for t in chosen)
    )
    terms["overhead"] = overhead
    terms["rounding"] = allocated - sum(terms[p] for p in TERMS)
    terms.update(host_terms(idx, k))  # pinned host memory: outside the device's total
    total = allocated + overhead
    headroom = avail - total
    final = chosen

    def build() -> list[Arena]:
        return arenas(
            idx, k, mode, scratch, [c[1] for c in _in_range(idx, k)] if final is None else final
        )

    out = DeviceLayout(
        dev,
        (k.lo, k.hi),
        k.first,
        k.last,
        LazyArenas(build),
        terms,
        allocated,
        total,
        headroom,
        Verdict.of(headroom),
        "",
        source,
        host_bytes(idx, k),
    )
    _STAGES.put(cache_key, out)
    return out


def _check(plan: Plan, idx: ModelIndex) -> None:
    name = getattr(idx.model, "paths", [plan.model])[0]
    if plan.split[-1] != idx.n_layer:
        raise CarveError(
            f"--split: the last boundary must be the layer count of {name} ({idx.n_layer}), "
            f"got {plan.split[-1]}"
        )
    limit = idx.hp.n_ctx_train
    if limit and plan.ctx > limit:
        raise CarveError(
            f"--ctx: {plan.ctx} is above the {limit} tokens {name} was trained for; use --ctx {limit} or less"
        )


def open_model(path: str) -> Any:
    from engine.gguf.reader import GGUFModel

    return GGUFModel.open(path)


def price(plan: Plan, model: Any = None, runner: Runner | None = None) -> Layout:
    """Every allocation of `plan`, per device, with a verdict and advice for what does not fit,
    and "does not run here" with the reason where `runner` (default: the one that will run the
    plan, `capability.runner_for`) has no kernel for a tensor the device holds."""
    model = model if model is not None else open_model(plan.model)
    plan.check_identity(getattr(model, "stamps", ()))  # the file the plan was made for, still
    idx = model_index(model)
    _check(plan, idx)
    stages = [price_stage(idx, stage_key(plan, i)) for i in range(len(plan.devices))]
    host = None
    if any(s.host for s in stages):
        host = host_layout(host_memory(plan), [s.host for s in stages])
    if any(s.verdict == Verdict.DOES_NOT_FIT for s in stages):
        stages = advise(plan, idx, stages, host_memory(plan))
    return Layout(
        plan,
        tuple(capability.check(plan, idx, stages, runner)),
        idx.n_skipped_layers,
        sum(t.nbytes for t in idx.skipped),
        host,
    )


def host_layout(device: Any, stages: list[int]) -> HostLayout:
    """The verdict on pinning ``stages`` bytes (per stage) in ``device``'s memory (the host),
    with the sentence that names host RAM as the bottleneck when it does not fit."""
    pinned = sum(stages)
    avail = device.free - device.reserve
    headroom = avail - pinned
    verdict = Verdict.of(headroom)
    advice = ""
    if verdict == Verdict.DOES_NOT_FIT:
        advice = (f"host RAM: over by {human(-headroom)}: {human(pinned)} of experts and "
                  f"buffers pinned in host memory do not fit in {human(avail)} available; keep "
                  "more layers' experts in VRAM (--experts-resident), add a GPU or free memory")
    return HostLayout(device, tuple(stages), headroom, verdict, advice)


def host_memory(plan: Plan) -> Any:
    """The host memory pinned experts are priced against: the plan's (a stated size, or what
    was available when it was made), else this machine's MemAvailable now."""
    if plan.host is not None:
        return plan.host
    from engine.hardware.devices import cpu_spec

    return cpu_spec()

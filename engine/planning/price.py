"""price(plan, model) -> Layout: every byte the engine will allocate, per device, by pure arithmetic.

Terms per stage, in the order the engine allocates them (DESIGN.md "The one rule"):
weights of its layers (the carve) · globals · KV cache · activation buffers · dequant cache,
plus the runtime overhead (calibration) and the allocator's rounding (arena mode).

Pricing runs while a user drags a boundary, so everything that depends only on the model is
computed once per model (`model_index`), and stages are cached by their inputs: moving one
boundary re-prices only the two stages beside it.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.hardware.calibration import overhead_for
from engine.hardware.devices import DeviceSpec
from engine.planning.arena import (
    ArenaMode,
    Request,
    align_up,
    allocation_sizes,
    arrange,
    parse_arena,
    reserved_bytes,
    round_block,
    segment_size,
)
from engine.planning.buffers import DTYPE_BYTES, activation_buffers
from engine.planning.carve import (  # noqa: F401  (carve, TIGHT: re-exported for the loader and the CLI)
    MIB,
    TIGHT,
    ModelIndex,
    _globals,
    _prefix,
    _request,
    carve,
    model_index,
)
from engine.planning.layout import PURPOSES, Arena, DeviceLayout, Layout, LazyArenas
from engine.planning.plan import Plan
from spec.errors import CarveError


def kv_requests(hp: Any, lo: int, hi: int, ctx: int, kv_type: str) -> list[Request]:
    out: list[Request] = []
    kvh, hd, hdv = hp.n_head_kv, hp.head_dim, hp.head_dim_v
    for layer in range(lo, hi):
        cells = hp.kv_cells(layer, ctx)
        if kv_type == "f16":
            out.append((f"kv.{layer}.k", cells * kvh * hd * 2, "f16", (cells, kvh, hd)))
            out.append((f"kv.{layer}.v", cells * kvh * hdv * 2, "f16", (cells, kvh, hdv)))
        else:  # q8_0: each cell's row of n_head_kv*head_dim values in 34-byte blocks of 32
            for part, width in (("k", kvh * hd), ("v", kvh * hdv)):
                if width % 32:
                    raise CarveError(
                        f"--kv q8_0: a KV row of {width} values is not a multiple of 32; use --kv f16"
                    )
                nb = cells * width // 32 * 34
                out.append((f"kv.{layer}.{part}", nb, "uint8", (nb,)))
    return out


@dataclass(frozen=True, slots=True)
class StageKey:
    lo: int
    hi: int
    first: bool
    last: bool
    device: DeviceSpec
    ctx: int
    kv_type: str
    chunk: int
    cache_reserve: int
    arena: str
    act_dtype: str
    logits_rows: int


_STAGES: OrderedDict[tuple[int, StageKey], DeviceLayout] = OrderedDict()


def _stage_key(plan: Plan, i: int, **over: Any) -> StageKey:
    kw: dict[str, Any] = {
        "lo": plan.split[i],
        "hi": plan.split[i + 1],
        "first": i == 0,
        "last": i == len(plan.devices) - 1,
        "device": plan.devices[i],
        "ctx": plan.ctx,
        "kv_type": plan.kv_type,
        "chunk": plan.prefill_chunk,
        "cache_reserve": plan.cache_reserve,
        "arena": plan.arena,
        "act_dtype": plan.act_dtype,
        "logits_rows": plan.logits_rows,
    }
    kw.update(over)
    return StageKey(**kw)


_ACT_TYPE = {"f32": 0, "f16": 1, "bf16": 30}


def _scratch(idx: ModelIndex, k: StageKey, which: str = "all", skipped: int = 0) -> int:
    """Elements of the largest matrix the stage dequantizes on the fly for a prefill GEMM
    (-> buf.dequant): of every matrix ("all"), or of those outside the dequant cache
    ("uncacheable" plus `skipped`, the largest cacheable one the cache left out)."""
    act = _ACT_TYPE[k.act_dtype]
    best = max(max(idx.gemm_max[act, which][k.lo : k.hi], default=0), skipped)
    if k.last and k.logits_rows > 1:  # logits for every row: the output matrix runs as a GEMM
        for t in idx.last_globals:
            if len(t.shape) >= 2 and t.ggml_type != act:
                best = max(best, t.n_elements)
    return best


_MEMO: dict[tuple[Any, ...], Any] = {}


def _memo(key: tuple[Any, ...], make: Any) -> Any:
    v = _MEMO.get(key)
    if v is None:
        v = _MEMO[key] = make()
        if len(_MEMO) > 4096:
            _MEMO.pop(next(iter(_MEMO)))
    return v


def _kv_table(
    idx: ModelIndex, ctx: int, kv_type: str
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(raw prefix, aligned prefix, per-layer span sizes) of the KV cache at this ctx."""

    def make() -> Any:
        sizes = [
            tuple(r[1] for r in kv_requests(idx.hp, i, i + 1, ctx, kv_type))
            for i in range(idx.n_layer)
        ]
        return (
            _prefix([sum(s) for s in sizes]),
            _prefix([sum(align_up(n) for n in s) for s in sizes]),
            tuple(sizes),
        )

    return _memo((idx.token, "kv", ctx, kv_type), make)


def _buffer_specs(idx: ModelIndex, k: StageKey, scratch: int) -> list[Any]:
    rows = k.logits_rows if k.last else 0
    return _memo(
        (idx.token, "buf", k.chunk, k.act_dtype, rows, scratch),
        lambda: activation_buffers(idx.hp, k.chunk, k.act_dtype, rows, scratch),
    )


def _buffer_sizes(idx: ModelIndex, k: StageKey, scratch: int) -> list[int]:
    rows = k.logits_rows if k.last else 0
    return _memo(
        (idx.token, "bufsize", k.chunk, k.act_dtype, rows, scratch),
        lambda: [b.nbytes for b in _buffer_specs(idx, k, scratch)],
    )


def _sizes(
    idx: ModelIndex, k: StageKey, mode: ArenaMode, scratch: int, dq: list[int] | int
) -> tuple[list[int], dict[str, int]]:
    """(allocation sizes in engine order, requested bytes per purpose) without building spans.
    `dq`: the dequant cache's span sizes, or (packed only) their aligned total."""
    glob = _memo(
        (idx.token, "glob", k.first, k.last),
        lambda: [t.nbytes for t in _globals(idx, k.first, k.last)],
    )
    kv_raw, kv_al, kv_sizes = _kv_table(idx, k.ctx, k.kv_type)
    bufs = _buffer_sizes(idx, k, scratch)
    terms = {
        "weights": idx.layer_raw_prefix[k.hi] - idx.layer_raw_prefix[k.lo],
        "globals": sum(glob),
        "kv": kv_raw[k.hi] - kv_raw[k.lo],
        "buffers": sum(bufs),
    }
    if mode.kind == "packed":
        dq_al = dq if isinstance(dq, int) else sum(align_up(n) for n in dq)
        allocs = [
            idx.layer_prefix[k.hi] - idx.layer_prefix[k.lo],
            sum(align_up(n) for n in glob),
            kv_al[k.hi] - kv_al[k.lo],
            sum(align_up(n) for n in bufs),
            dq_al,
        ]
        return [a for a in allocs if a], terms
    assert isinstance(dq, list)
    allocs = allocation_sizes(mode, [n for i in range(k.lo, k.hi) for n in idx.layer_sizes[i]])
    allocs += allocation_sizes(mode, glob)
    allocs += allocation_sizes(mode, [n for i in range(k.lo, k.hi) for n in kv_sizes[i]])
    allocs += allocation_sizes(mode, bufs)
    return allocs + allocation_sizes(mode, dq), terms


def _arenas(
    idx: ModelIndex, k: StageKey, mode: ArenaMode, scratch: int, chosen: list[Any]
) -> list[Arena]:
    """The stage's arenas with every span, in allocation order (what `_sizes` counted)."""
    # bf16 unless activations are f16: CPU matrix-vector products run ~10x slower in f16
    dq_dtype = "f16" if k.act_dtype == "f16" else "bf16"
    out = arrange(
        mode, "weights", "weights", [r for i in range(k.lo, k.hi) for r in idx.layer_requests[i]]
    )
    out += arrange(
        mode, "globals", "globals", [_request(t) for t in _globals(idx, k.first, k.last)]
    )
    out += arrange(mode, "kv", "kv", kv_requests(idx.hp, k.lo, k.hi, k.ctx, k.kv_type))
    out += arrange(
        mode,
        "buffers",
        "buffers",
        [(f"buf.{b.name}", b.nbytes, b.dtype, b.shape) for b in _buffer_specs(idx, k, scratch)],
    )
    return out + arrange(
        mode, "dequant_cache", "dequant_cache", [_dq_request(t, dq_dtype) for t in chosen]
    )


def _gemm_elements(t: Any) -> int:
    """Scratch elements a matrix left out of the cache needs: a layer matrix runs prefill GEMMs
    from the scratch; the head does so only for multi-row logits, which `_scratch` prices."""
    return t.n_elements if t.layer is not None else 0


def _dq_request(t: Any, dtype: str) -> Request:
    rows, cols = t.n_elements // t.shape[0], t.shape[0]
    return (f"dq.{t.name}", rows * cols * DTYPE_BYTES[dtype], dtype, (rows, cols))


def _in_range(idx: ModelIndex, k: StageKey) -> list[tuple[int, Any, int]]:
    return [c for c in idx.cacheable if k.lo <= c[0] < k.hi]


def price_stage(idx: ModelIndex, k: StageKey) -> DeviceLayout:
    """One device's share: its carve, KV, buffers, then the dequant cache from what is left."""
    overhead, source = overhead_for(k.device)  # in the key: a new calibration re-prices
    cache_key = (idx.token, k, overhead)
    hit = _STAGES.get(cache_key)
    if hit is not None:
        _STAGES.move_to_end(cache_key)
        return hit
    dev, mode, gpu = k.device, parse_arena(k.arena), not k.device.is_cpu
    avail = dev.free - dev.reserve
    allocs, _ = _sizes(idx, k, mode, _scratch(idx, k), [] if mode.kind != "packed" else 0)
    budget = avail - overhead - reserved_bytes(allocs, gpu) - k.cache_reserve
    slack = 2 * MIB if gpu else 0  # the cache's own rounding to the allocator's 2 MiB grain
    everything = idx.cache_aligned_prefix[k.hi] - idx.cache_aligned_prefix[k.lo]
    all_in = mode.kind == "packed" and everything + slack <= budget
    chosen: list[Any] | None = None  # None: every cacheable matrix of the stage (packed fast path)
    skipped = 0
    if not all_in:
        chosen, used = [], 0
        for _, t, nb in _in_range(idx, k) if budget > slack else ():
            cost = align_up(nb)
            if gpu and mode.kind == "per-tensor":  # upper bound: a segment of its own
                cost = segment_size(round_block(cost))
            if used + cost + slack <= budget:
                chosen.append(t)
                used += cost
            else:
                skipped = max(skipped, _gemm_elements(t))
        if budget <= slack:
            skipped = -1  # nothing cached: the scratch serves every matrix
    while True:  # exact check; drop the least-benefit matrix if the rounding overshoots
        scratch = _scratch(idx, k) if skipped < 0 else _scratch(idx, k, "uncacheable", skipped)
        dq = everything if chosen is None else [t.n_elements * 2 for t in chosen]
        allocs, terms = _sizes(idx, k, mode, scratch, dq)
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
    terms["rounding"] = allocated - sum(terms[p] for p in PURPOSES)
    total = allocated + overhead
    headroom = avail - total
    verdict = "does not fit" if headroom < 0 else "tight" if headroom < TIGHT else "fits"
    final = chosen

    def build() -> list[Arena]:
        return _arenas(
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
        verdict,
        "",
        source,
    )
    _STAGES[cache_key] = out
    while len(_STAGES) > 512:
        _STAGES.popitem(last=False)
    return out


def stage_need(idx: ModelIndex, k: StageKey) -> int:
    """Bytes the stage needs without the elastic dequant cache: weights, globals, KV, buffers,
    rounding and overhead. The split search and the advice compare it with free - reserve."""
    mode = parse_arena(k.arena)
    allocs, _ = _sizes(idx, k, mode, _scratch(idx, k), [] if mode.kind != "packed" else 0)
    return reserved_bytes(allocs, not k.device.is_cpu) + overhead_for(k.device)[0]


def fits(idx: ModelIndex, k: StageKey) -> bool:
    return stage_need(idx, k) <= k.device.free - k.device.reserve


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


def price(plan: Plan, model: Any = None) -> Layout:
    """Every allocation of `plan`, per device, with a verdict and advice for what does not fit."""
    model = model if model is not None else open_model(plan.model)
    idx = model_index(model)
    _check(plan, idx)
    stages = [price_stage(idx, _stage_key(plan, i)) for i in range(len(plan.devices))]
    if any(s.verdict == "does not fit" for s in stages):
        from engine.planning.advice import advise  # advice re-prices through this module

        stages = advise(plan, idx, stages)
    return Layout(plan, tuple(stages))

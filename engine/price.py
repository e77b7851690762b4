"""price(plan, model) -> Layout: every byte the engine will allocate, per device, by pure arithmetic.

Terms per stage, in the order the engine allocates them (DESIGN.md "The one rule"):
weights of its layers (the carve) · globals · KV cache · activation buffers · dequant cache,
plus the runtime overhead (calibration) and the allocator's rounding (arena mode).

Pricing runs while a user drags a boundary, so everything that depends only on the model is
computed once per model (`model_index`), and stages are cached by their inputs: moving one
boundary re-prices only the two stages beside it.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any

from engine.arena import (
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
from engine.buffers import DTYPE_BYTES, activation_buffers
from engine.calibration import overhead_for
from engine.devices import DeviceSpec
from engine.errors import CarveError
from engine.layout import PURPOSES, Arena, DeviceLayout, Layout, LazyArenas, human
from engine.plan import Plan
from engine.quant_types import type_name

MIB = 1 << 20
TIGHT = 512 * MIB  # headroom below this is "tight": a desktop, a second process or a CUDA
# graph pool can take that much; 5 % of an 80 GB card (4 GB) would call good plans tight.
NOT_QUANTIZED = {0: "f32", 1: "f16", 30: "bf16"}  # ggml ids whose data is already a float dtype
# relative cost of dequantizing one element, by ggml id: what a dequant-cache byte saves
_DEQUANT_COST = {
    2: 1.0,
    3: 1.0,
    6: 1.2,
    7: 1.2,
    8: 0.8,
    10: 1.6,
    11: 1.7,
    12: 1.5,
    13: 1.6,
    14: 1.6,
}
ROLE_GLOBALS_FIRST = ("token_embd.weight",)
ROLE_GLOBALS_LAST = ("output_norm.weight", "output.weight")


@dataclass(frozen=True, slots=True)
class ModelIndex:
    """What pricing needs from a model, computed once: per-layer tensor lists and prefix sums,
    so a stage's weights cost two lookups however many tensors it holds."""

    token: int  # unique per index, never reused (unlike id()): the key of every cache below
    model: Any
    hp: Any
    n_layer: int
    layer_tensors: tuple[tuple[Any, ...], ...]  # per layer, file order
    layer_requests: tuple[tuple[Request, ...], ...]
    layer_sizes: tuple[tuple[int, ...], ...]  # nbytes per tensor, per layer
    layer_prefix: tuple[int, ...]  # aligned weight bytes of layers [0, i)
    layer_raw_prefix: tuple[int, ...]  # exact weight bytes of layers [0, i)
    first_globals: tuple[Any, ...]  # token_embd
    last_globals: tuple[Any, ...]  # output_norm, output (or the tied token_embd copy)
    shared: tuple[Any, ...]  # other non-layer tensors (rope_freqs...): every stage needs them
    cacheable: tuple[tuple[int, Any, int], ...]  # (layer, tensor, f16 bytes), best benefit first
    cache_prefix: tuple[int, ...]  # f16 bytes of layers [0, i)'s cacheable matrices
    cache_aligned_prefix: tuple[int, ...]
    # act ggml id -> per layer: elements of the largest matrix needing a dequant for a GEMM,
    # of all matrices ("all") and of those the dequant cache cannot hold ("uncacheable")
    gemm_max: dict[tuple[int, str], tuple[int, ...]]


def _request(t: Any) -> Request:
    # raw GGUF bytes; shape in GGUF order (ne0 first), dtype the GGUF type name
    return (t.name, t.nbytes, type_name(t.ggml_type), tuple(t.shape))


def _prefix(values: list[int]) -> tuple[int, ...]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


_INDEX: OrderedDict[int, ModelIndex] = OrderedDict()
_TOKENS = itertools.count()


def model_index(model: Any) -> ModelIndex:
    idx = _INDEX.get(id(model))
    if idx is not None and idx.model is model:
        return idx
    from engine.hparams import HParams

    hp = HParams.from_model(model)
    n = hp.n_layer
    per: list[list[Any]] = [[] for _ in range(n)]
    by_name = {}
    for t in model.tensors:
        layer = t.layer
        if layer is None:
            by_name[t.name] = t
        elif 0 <= layer < n:
            per[layer].append(t)
        else:
            raise CarveError(f"{model.paths[0]}: tensor {t.name} is outside the model's {n} layers")
    first = [t for name, t in by_name.items() if name in ROLE_GLOBALS_FIRST]
    shared = [
        t for name, t in by_name.items() if name not in ROLE_GLOBALS_FIRST + ROLE_GLOBALS_LAST
    ]
    last = [by_name[name] for name in ROLE_GLOBALS_LAST if name in by_name]
    if "output.weight" not in by_name and "token_embd.weight" in by_name:
        last.append(by_name["token_embd.weight"])  # tied: the last stage keeps its own copy
    # The output head is the largest matrix of a decode step: it may take a cache copy too. It is
    # filed under the last layer, which only the last stage (the one holding the head) runs.
    head = by_name.get("output.weight", by_name.get("token_embd.weight"))
    heads = [(n - 1, head)] if head is not None and n > 0 else []
    cacheable = sorted(
        (
            (i, t, t.n_elements * 2)
            for i, t in [(i, t) for i, ts in enumerate(per) for t in ts] + heads
            if len(t.shape) >= 2 and t.ggml_type not in NOT_QUANTIZED
        ),
        key=lambda it: (
            -_DEQUANT_COST.get(it[1].ggml_type, 2.0),
            -it[1].n_elements,
            it[0],
            it[1].name,
        ),
    )
    per_cache = [0] * n
    per_cache_al = [0] * n
    for i, _, nb in cacheable:
        per_cache[i] += nb
        per_cache_al[i] += align_up(nb)
    gemm_max = {}
    for act in (0, 1, 30):
        mats = [[t for t in ts if len(t.shape) >= 2 and t.ggml_type != act] for ts in per]
        gemm_max[act, "all"] = tuple(max((t.n_elements for t in m), default=0) for m in mats)
        gemm_max[act, "uncacheable"] = tuple(
            max((t.n_elements for t in m if t.ggml_type in NOT_QUANTIZED), default=0) for m in mats
        )
    idx = ModelIndex(
        next(_TOKENS),
        model,
        hp,
        n,
        tuple(tuple(ts) for ts in per),
        tuple(tuple(_request(t) for t in ts) for ts in per),
        tuple(tuple(t.nbytes for t in ts) for ts in per),
        _prefix([sum(align_up(t.nbytes) for t in ts) for ts in per]),
        _prefix([sum(t.nbytes for t in ts) for ts in per]),
        tuple(first),
        tuple(last),
        tuple(shared),
        tuple(cacheable),
        _prefix(per_cache),
        _prefix(per_cache_al),
        gemm_max,
    )
    _INDEX[id(model)] = idx
    while len(_INDEX) > 8:
        _INDEX.popitem(last=False)
    return idx


def carve(model: Any, lo: int, hi: int, first: bool, last: bool) -> list[Any]:
    """The tensors a stage running layers [lo, hi) holds, in the order its Layout places them:
    its layers' tensors (file order), then globals: token_embd (first stage), tensors every
    stage needs (rope_freqs...), output_norm and output (last stage; with tied embeddings the
    last stage holds token_embd itself, once if it is also the first stage)."""
    idx = model_index(model)
    out = [t for layer in range(lo, hi) for t in idx.layer_tensors[layer]]
    return out + _globals(idx, first, last)


def _globals(idx: ModelIndex, first: bool, last: bool) -> list[Any]:
    out = list(idx.first_globals) if first else []
    out += idx.shared
    if last:
        out += [t for t in idx.last_globals if not (first and t in idx.first_globals)]
    return out


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
    from engine.gguf_file import GGUFModel

    return GGUFModel.open(path)


def price(plan: Plan, model: Any = None) -> Layout:
    """Every allocation of `plan`, per device, with a verdict and advice for what does not fit."""
    model = model if model is not None else open_model(plan.model)
    idx = model_index(model)
    _check(plan, idx)
    stages = [price_stage(idx, _stage_key(plan, i)) for i in range(len(plan.devices))]
    if any(s.verdict == "does not fit" for s in stages):
        stages = advise(plan, idx, stages)
    return Layout(plan, tuple(stages))


# The term named as overflowing is the one that crosses the free memory when terms are added in
# this order: what the model and runtime impose first, the KV cache (sized by --ctx/--kv, the
# knobs a user turns) last — so "KV cache does not fit" means a smaller context would help.
_ORDER = ("overhead", "weights", "globals", "buffers", "rounding", "kv")
_LABEL = {
    "overhead": "the runtime overhead",
    "weights": "weights",
    "globals": "globals",
    "kv": "KV cache",
    "buffers": "activation buffers",
    "rounding": "arena rounding",
}


def advise(plan: Plan, idx: ModelIndex, stages: list[DeviceLayout]) -> list[DeviceLayout]:
    """For each stage that does not fit: the term that overflows and the changes that fit it."""
    out = []
    for i, s in enumerate(stages):
        if s.verdict != "does not fit":
            out.append(s)
            continue
        k = _stage_key(plan, i)
        dev = k.device
        avail = dev.free - dev.reserve
        run = 0
        term = _ORDER[-1]
        for term in _ORDER:
            run += s.terms[term]
            if run > avail:
                break
        tips = []
        if k.ctx > 256 and fits(idx, replace(k, ctx=256)):
            lo_c, hi_c = 1, (k.ctx - 1) // 256  # in units of 256 tokens
            while lo_c < hi_c:
                mid = (lo_c + hi_c + 1) // 2
                lo_c, hi_c = (
                    (mid, hi_c) if fits(idx, replace(k, ctx=mid * 256)) else (lo_c, mid - 1)
                )
            tips.append(f"--ctx {lo_c * 256}")
        if k.kv_type == "f16" and fits(idx, replace(k, kv_type="q8_0")):
            tips.append("--kv q8_0")
        move = _boundary_move(plan, idx, i)
        if move:
            tips.append(move)
        what = f"{_LABEL[term]} ({human(s.terms[term])})"
        advice = f"over by {human(-s.headroom)}: {what} does not fit in {human(avail)} free"
        advice += (
            "; fits with " + ", or ".join(tips)
            if tips
            else "; no single change fits it: add a GPU, use a smaller quant or a larger card"
        )
        out.append(replace(s, advice=advice))
    return out


def _boundary_move(plan: Plan, idx: ModelIndex, i: int) -> str:
    """The smallest shift of one of stage i's boundaries that makes it and the neighbour fit."""
    lo, hi = plan.split[i], plan.split[i + 1]
    n = len(plan.devices)
    for k in range(1, hi - lo):
        if i > 0:  # the previous device takes layers [lo, lo + k)
            a = _stage_key(plan, i - 1, hi=lo + k)
            b = _stage_key(plan, i, lo=lo + k)
            if fits(idx, a) and fits(idx, b):
                return (
                    f"--split boundary {i} moved +{k} ({lo} -> {lo + k}: "
                    f"{plan.devices[i - 1].label} takes {k} layer{'s' * (k > 1)})"
                )
        if i < n - 1:  # the next device takes layers [hi - k, hi)
            a = _stage_key(plan, i, hi=hi - k)
            b = _stage_key(plan, i + 1, lo=hi - k)
            if fits(idx, a) and fits(idx, b):
                return (
                    f"--split boundary {i + 1} moved -{k} ({hi} -> {hi - k}: "
                    f"{plan.devices[i + 1].label} takes {k} layer{'s' * (k > 1)})"
                )
    return ""

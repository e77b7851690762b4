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
from dataclasses import dataclass, replace
from typing import Any

from engine.arena import (
    ArenaMode,
    Request,
    align_up,
    arrange,
    device_bytes,
    parse_arena,
    round_block,
    segment_size,
)
from engine.buffers import DTYPE_BYTES, activation_buffers
from engine.calibration import overhead_for
from engine.devices import DeviceSpec
from engine.errors import CarveError
from engine.layout import Arena, DeviceLayout, Layout, human
from engine.plan import Plan
from engine.quant_types import type_name

MIB = 1 << 20
TIGHT = 512 * MIB  # headroom below this is "tight": a desktop, a second process or a CUDA
# graph pool can take that much; 5 % of an 80 GB card (4 GB) would call good plans tight.
NOT_QUANTIZED = {0: "f32", 1: "f16", 30: "bf16"}  # ggml ids whose data is already a float dtype
# relative cost of dequantizing one element, by ggml id: what a dequant-cache byte saves
_DEQUANT_COST = {2: 1.0, 3: 1.0, 6: 1.2, 7: 1.2, 8: 0.8, 10: 1.6, 11: 1.7, 12: 1.5, 13: 1.6, 14: 1.6}
ROLE_GLOBALS_FIRST = ("token_embd.weight",)
ROLE_GLOBALS_LAST = ("output_norm.weight", "output.weight")


@dataclass(frozen=True, slots=True)
class ModelIndex:
    """What pricing needs from a model, computed once."""

    model: Any
    hp: Any
    n_layer: int
    layer_tensors: tuple[tuple[Any, ...], ...]  # per layer, file order
    layer_requests: tuple[tuple[Request, ...], ...]
    layer_prefix: tuple[int, ...]  # aligned weight bytes of layers [0, i)
    first_globals: tuple[Any, ...]  # token_embd
    last_globals: tuple[Any, ...]  # output_norm, output (or the tied token_embd copy)
    shared: tuple[Any, ...]  # other non-layer tensors (rope_freqs...): every stage needs them
    cacheable: tuple[tuple[int, Any], ...]  # (layer, tensor) in benefit order, best first
    matrices: tuple[tuple[int, Any], ...]  # (layer, tensor) 2-D blk weights


def _request(t: Any) -> Request:
    # raw GGUF bytes; shape in GGUF order (ne0 first), dtype the GGUF type name
    return (t.name, t.nbytes, type_name(t.ggml_type), tuple(t.shape))


_INDEX: OrderedDict[int, ModelIndex] = OrderedDict()


def model_index(model: Any) -> ModelIndex:
    idx = _INDEX.get(id(model))
    if idx is not None and idx.model is model:
        return idx
    from engine.hparams import HParams

    hp = HParams.from_model(model)
    n = hp.n_layer
    per: list[list[Any]] = [[] for _ in range(n)]
    first, last, shared = [], [], []
    by_name = {}
    for t in model.tensors:
        layer = t.layer
        if layer is not None:
            if not 0 <= layer < n:
                raise CarveError(f"{model.paths[0]}: tensor {t.name} is outside the model's {n} layers")
            per[layer].append(t)
        else:
            by_name[t.name] = t
    for name, t in by_name.items():
        if name in ROLE_GLOBALS_FIRST:
            first.append(t)
        elif name not in ROLE_GLOBALS_LAST:
            shared.append(t)
    last = [by_name[n_] for n_ in ROLE_GLOBALS_LAST if n_ in by_name]
    if "output.weight" not in by_name and "token_embd.weight" in by_name:
        last.append(by_name["token_embd.weight"])  # tied: the last stage keeps its own copy
    prefix = [0]
    for ts in per:
        prefix.append(prefix[-1] + sum(align_up(t.nbytes) for t in ts))
    matrices = [(i, t) for i, ts in enumerate(per) for t in ts if len(t.shape) >= 2]
    cacheable = sorted(
        ((i, t) for i, t in matrices if t.ggml_type not in NOT_QUANTIZED),
        key=lambda it: (-_DEQUANT_COST.get(it[1].ggml_type, 2.0), -it[1].n_elements, it[0], it[1].name),
    )
    idx = ModelIndex(model, hp, n, tuple(tuple(ts) for ts in per),
                     tuple(tuple(_request(t) for t in ts) for ts in per), tuple(prefix),
                     tuple(first), tuple(last), tuple(shared), tuple(cacheable), tuple(matrices))
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
                    raise CarveError(f"--kv q8_0: a KV row of {width} values is not a multiple of 32; use --kv f16")
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
        "lo": plan.split[i], "hi": plan.split[i + 1], "first": i == 0,
        "last": i == len(plan.devices) - 1, "device": plan.devices[i], "ctx": plan.ctx,
        "kv_type": plan.kv_type, "chunk": plan.prefill_chunk, "cache_reserve": plan.cache_reserve,
        "arena": plan.arena, "act_dtype": plan.act_dtype, "logits_rows": plan.logits_rows,
    }
    kw.update(over)
    return StageKey(**kw)


def _gemm_elements(idx: ModelIndex, k: StageKey, cached: set[str]) -> int:
    """Largest matrix this stage dequantizes on the fly in prefill (-> buf.dequant)."""
    act_type = {"f32": 0, "f16": 1, "bf16": 30}[k.act_dtype]
    best = 0
    for layer in range(k.lo, k.hi):
        for t in idx.layer_tensors[layer]:
            if len(t.shape) >= 2 and t.ggml_type != act_type and t.name not in cached:
                best = max(best, t.n_elements)
    if k.last and k.logits_rows > 1:  # logits for every row: the output matrix runs as a GEMM
        for t in idx.last_globals:
            if len(t.shape) >= 2 and t.ggml_type != act_type:
                best = max(best, t.n_elements)
    return best


def _fixed_arenas(idx: ModelIndex, k: StageKey, mode: ArenaMode, scratch: int,
                  weights_spans: bool = True) -> list[Arena]:
    """Every arena of the stage but the dequant cache, in allocation order. Without
    `weights_spans` (packed only) the weights arena is a span-less stand-in of the right size."""
    hp = idx.hp
    if weights_spans:
        out = arrange(mode, "weights", "weights", [r for L in range(k.lo, k.hi) for r in idx.layer_requests[L]])
    else:
        out = [Arena("weights", "weights", idx.layer_prefix[k.hi] - idx.layer_prefix[k.lo], ())]
    out += arrange(mode, "globals", "globals", [_request(t) for t in _globals(idx, k.first, k.last)])
    out += arrange(mode, "kv", "kv", kv_requests(hp, k.lo, k.hi, k.ctx, k.kv_type))
    bufs = activation_buffers(hp, k.chunk, k.act_dtype, k.logits_rows if k.last else 0, scratch)
    out += arrange(mode, "buffers", "buffers", [(f"buf.{b.name}", b.nbytes, b.dtype, b.shape) for b in bufs])
    return out


def _dq_request(t: Any, dtype: str) -> Request:
    rows, cols = t.n_elements // t.shape[0], t.shape[0]
    return (f"dq.{t.name}", rows * cols * DTYPE_BYTES[dtype], dtype, (rows, cols))


def price_stage(idx: ModelIndex, k: StageKey) -> DeviceLayout:
    cache_key = (id(idx), k)
    hit = _STAGES.get(cache_key)
    if hit is not None:
        _STAGES.move_to_end(cache_key)
        return hit
    dev, mode, gpu = k.device, parse_arena(k.arena), not k.device.is_cpu
    overhead, source = overhead_for(dev)
    avail = dev.free - dev.reserve
    dq_dtype = "bf16" if k.act_dtype == "bf16" else "f16"
    fixed = _fixed_arenas(idx, k, mode, _gemm_elements(idx, k, set()))
    fixed_bytes = device_bytes(fixed, gpu)
    budget = avail - overhead - fixed_bytes - k.cache_reserve
    chosen: list[Any] = []
    if budget > 0:
        slack = 2 * MIB if gpu else 0  # the cache arena's own rounding to the allocator's grain
        used = 0
        for layer, t in idx.cacheable:
            if k.lo <= layer < k.hi:
                cost = align_up(t.n_elements * 2)
                if gpu and mode.kind == "per-tensor":  # upper bound: its own segment
                    cost = segment_size(round_block(cost))
                if used + cost + slack <= budget:
                    chosen.append(t)
                    used += cost
    while True:  # exact check of the choice; drop the smallest-benefit item if rounding overshoots
        names = {t.name for t in chosen}
        arenas = _fixed_arenas(idx, k, mode, _gemm_elements(idx, k, names)) if chosen else fixed
        arenas += arrange(mode, "dequant_cache", "dequant_cache", [_dq_request(t, dq_dtype) for t in chosen])
        allocated = device_bytes(arenas, gpu)
        if not chosen or allocated + overhead + k.cache_reserve <= avail:
            break
        chosen.pop()
    terms = dict.fromkeys(("weights", "globals", "kv", "buffers", "dequant_cache"), 0)
    for a in arenas:
        terms[a.purpose] += sum(s.nbytes for s in a.spans)
    terms["overhead"] = overhead
    terms["rounding"] = allocated - sum(terms[p] for p in ("weights", "globals", "kv", "buffers", "dequant_cache"))
    total = allocated + overhead
    headroom = avail - total
    verdict = "does not fit" if headroom < 0 else "tight" if headroom < TIGHT else "fits"
    out = DeviceLayout(dev, (k.lo, k.hi), k.first, k.last, tuple(arenas), terms, allocated, total,
                       headroom, verdict, "", source)
    _STAGES[cache_key] = out
    while len(_STAGES) > 512:
        _STAGES.popitem(last=False)
    return out


def stage_need(idx: ModelIndex, k: StageKey) -> int:
    """Bytes the stage needs without the elastic dequant cache: weights, globals, KV, buffers,
    rounding and overhead. The split search and the advice compare it with free - reserve."""
    mode = parse_arena(k.arena)
    arenas = _fixed_arenas(idx, k, mode, _gemm_elements(idx, k, set()), mode.kind != "packed")
    return device_bytes(arenas, not k.device.is_cpu) + overhead_for(k.device)[0]


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
        raise CarveError(f"--ctx: {plan.ctx} is above the {limit} tokens {name} was trained for; use --ctx {limit} or less")


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


_ORDER = ("overhead", "weights", "globals", "kv", "buffers", "rounding")  # as the engine fills a device


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
                lo_c, hi_c = (mid, hi_c) if fits(idx, replace(k, ctx=mid * 256)) else (lo_c, mid - 1)
            tips.append(f"--ctx {lo_c * 256}")
        if k.kv_type == "f16" and fits(idx, replace(k, kv_type="q8_0")):
            tips.append("--kv q8_0")
        move = _boundary_move(plan, idx, i)
        if move:
            tips.append(move)
        what = f"{term} ({human(s.terms[term])})" if term != "overhead" else "the runtime overhead"
        advice = f"over by {human(-s.headroom)}: {what} does not fit in {human(avail)} free"
        advice += "; fits with " + ", or ".join(tips) if tips else \
            "; no single change fits it: add a GPU, use a smaller quant or a larger card"
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
                return (f"--split boundary {i} moved +{k} ({lo} -> {lo + k}: "
                        f"{plan.devices[i - 1].label} takes {k} layer{'s' * (k > 1)})")
        if i < n - 1:  # the next device takes layers [hi - k, hi)
            a = _stage_key(plan, i, hi=hi - k)
            b = _stage_key(plan, i + 1, lo=hi - k)
            if fits(idx, a) and fits(idx, b):
                return (f"--split boundary {i + 1} moved -{k} ({hi} -> {hi - k}: "
                        f"{plan.devices[i + 1].label} takes {k} layer{'s' * (k > 1)})")
    return ""

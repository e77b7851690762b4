"""One stage of a plan: the inputs that decide its price (`StageKey`), what it needs (the
carve's weights and globals, the KV cache, the activation buffers, the dequant cache) and how
those needs become allocations in the plan's arena mode.

Pricing (`engine.planning.price`) chooses the dequant cache and gives the verdict; the split
search and the advice ask `stage_need` / `fits` about stages that are not in any plan yet.
Everything that depends only on the model and a few settings is memoised, so re-pricing while a
user drags a boundary is arithmetic on prefix sums.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.hardware import native
from engine.hardware.calibration import overhead_for
from engine.hardware.devices import DeviceSpec
from engine.planning.arena import (
    Request,
    align_up,
    allocation_sizes,
    arrange,
    packed,
    reserved_bytes,
)
from engine.planning.buffers import DTYPE_BYTES, activation_buffers
from engine.planning.carve import ModelIndex, _globals, _prefix, _request, is_expert
from engine.planning.host import CPU_PREFIX, cpu_bytes, host_moe_buffers, tensor_cpu_layout
from engine.planning.layout import Arena
from engine.planning.plan import ALL_RESIDENT, Plan
from engine.planning.rules import ArenaKind, ArenaMode, KvType, parse_arena
from spec.errors import CarveError
from spec.quant_types import type_id


def kv_requests(hp: Any, lo: int, hi: int, ctx: int, kv_type: KvType) -> list[Request]:
    """The KV cache spans of layers [lo, hi): ``kv.{layer}.k`` and ``kv.{layer}.v``, or only
    ``.k`` where the values are the keys' leading dims (MLA's latent row, HParams.kv_rows)."""
    out: list[Request] = []
    keys, values = hp.kv_rows()
    parts = [("k", *keys)] + ([("v", *values)] if values is not None else [])
    for layer in range(lo, hi):
        cells = hp.kv_cells(layer, ctx)
        if kv_type == KvType.F16:
            for part, kvh, d in parts:
                out.append((f"kv.{layer}.{part}", cells * kvh * d * 2, "f16", (cells, kvh, d)))
        else:  # q8_0: each cell's row of heads x dims values in 34-byte blocks of 32
            for part, width in ((p, kvh * d) for p, kvh, d in parts):
                if width % 32:
                    raise CarveError(
                        f"--kv q8_0: a KV row of {width} values is not a multiple of 32; use --kv f16"
                    )
                nb = cells * width // 32 * 34
                out.append((f"kv.{layer}.{part}", nb, "uint8", (nb,)))
    return out


def kv_q8_0_fits(hp: Any) -> bool:
    """Whether every KV cache row is whole q8_0 blocks of 32 (else --kv q8_0 is refused)."""
    return all(v is None or v[0] * v[1] % 32 == 0 for v in hp.kv_rows())


@dataclass(frozen=True, slots=True)
class StageKey:
    lo: int
    hi: int
    first: bool
    last: bool
    device: DeviceSpec
    ctx: int
    kv_type: KvType
    chunk: int
    cache_reserve: int
    arena: str
    act_dtype: str
    logits_rows: int
    resident: int = ALL_RESIDENT  # MoE layers whose experts stay in VRAM (the stage's first)
    slots: int = 0  # VRAM expert-cache slots
    host_compute: str = "gpu"  # where host layers' experts run (Plan.host_compute)
    # host_compute "both": this machine runs the CPU's native expert kernel
    # (engine.hardware.native), so a host layer it covers keeps no CPU layout
    native: bool = False


def stage_key(plan: Plan, i: int, **over: Any) -> StageKey:
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
        "resident": plan.resident(i),
        "slots": plan.slots(i),
        "host_compute": plan.host_compute,
        "native": plan.host_compute == "both" and native.available(),
    }
    kw.update(over)
    return StageKey(**kw)


_ACT_TYPE = {"f32": 0, "f16": 1, "bf16": 30}


def scratch_elements(idx: ModelIndex, k: StageKey, which: str = "all", skipped: int = 0) -> int:
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


class ModelCache:
    """Entries keyed by (model index token, ...), least recently used out past ``size``, and
    only for the last ``models`` tokens: a model opened again gets a new token (every load
    opens its model anew), so an older token's entries can never be hit again and would only
    hold memory (an engine loading over and over grew by them until the table was full)."""

    def __init__(self, size: int, models: int = 4) -> None:
        self.size, self.models = size, models
        self.entries: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
        self.tokens: OrderedDict[int, None] = OrderedDict()

    def get(self, key: tuple[Any, ...]) -> Any:
        v = self.entries.get(key)
        if v is not None:
            self.entries.move_to_end(key)
        return v

    def put(self, key: tuple[Any, ...], value: Any) -> None:
        self.entries[key] = value
        self.tokens[key[0]] = None
        self.tokens.move_to_end(key[0])
        if len(self.tokens) > self.models:
            gone = set()
            while len(self.tokens) > self.models:
                gone.add(self.tokens.popitem(last=False)[0])
            for k in [k for k in self.entries if k[0] in gone]:
                del self.entries[k]
        while len(self.entries) > self.size:
            self.entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self.entries)

    def clear(self) -> None:
        self.entries.clear()
        self.tokens.clear()

    def pop(self, key: tuple[Any, ...], default: Any = None) -> Any:
        return self.entries.pop(key, default)


_MEMO = ModelCache(4096)


def _memo(key: tuple[Any, ...], make: Any) -> Any:
    v = _MEMO.get(key)
    if v is None:
        v = make()
        _MEMO.put(key, v)
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


def host_cut(idx: ModelIndex, k: StageKey) -> int:
    """The stage's first layer whose experts live in host memory (k.hi: none do). The CPU
    holds everything in its RAM already: no host placement there."""
    return k.hi if k.device.is_cpu else idx.host_cut(k.lo, k.hi, k.resident)


def decode_pcie_bytes(idx: ModelIndex, k: StageKey) -> int:
    """Bytes of experts one decode token reads over PCIe on this stage: the n_expert_used
    routed experts of each host layer, weights and biases (host_compute "gpu"; an upper bound
    with cache slots, whose hits read nothing, and with "both", whose CPU share, timed at load,
    reads none); 0 where the CPU computes them all (only the rows cross then)."""
    if k.host_compute == "cpu" or k.device.is_cpu:
        return 0
    hp = idx.hp
    raw = idx.expert_raw_prefix
    return sum((raw[i + 1] - raw[i]) // hp.n_expert * hp.n_expert_used
               for i in idx.moe_layers(host_cut(idx, k), k.hi))


def slot_bytes(idx: ModelIndex, k: StageKey) -> int:
    """One expert-cache slot: the stage's largest expert (gate, up and down of one layer)."""
    return max(idx.expert_slot[k.lo : k.hi], default=0)


def stream_bytes(idx: ModelIndex, k: StageKey) -> int:
    """The staging span through which a stage whose host layers' experts run on the GPU copies
    them in: the largest host layer's expert tensors, each 256-byte aligned; 0 when none."""
    if k.host_compute == "cpu":
        return 0
    cut = host_cut(idx, k)
    # the expert tensors with their biases (gpt-oss), each aligned as the Stream places them
    return max((idx.expert_prefix[i + 1] - idx.expert_prefix[i] for i in range(cut, k.hi)),
               default=0)


def _cache_requests(idx: ModelIndex, k: StageKey) -> list[Request]:
    """The expert-cache arena's spans: the host layers' staging span, then the slots."""
    out: list[Request] = []
    stream = stream_bytes(idx, k)
    if stream:
        out.append(("expert_stream", stream, "uint8", (stream,)))
    if k.slots:  # the slots side by side, slot_bytes each
        nb = k.slots * slot_bytes(idx, k)
        out.append(("expert_cache", nb, "uint8", (k.slots, nb // k.slots)))
    return out


def _host_buffer_specs(idx: ModelIndex, k: StageKey) -> list[Any]:
    return _memo(
        (idx.token, "hostbuf", k.chunk, k.act_dtype),
        lambda: host_moe_buffers(idx.hp, k.chunk, k.act_dtype),
    )


def native_covers(idx: ModelIndex, reqs: list[Request]) -> bool:
    """Whether the CPU's native kernel (engine.hardware.native) multiplies the layer whose
    expert tensors are ``reqs`` straight from the file's bytes: gate, up and down of its
    types and sizes, the model's activation (gpt-oss's clamp and biases too)."""
    weights = {name.split(".")[-2]: (type_id(dt), shape) for name, _, dt, shape in reqs
               if name.endswith(".weight")}
    parts = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
    if sorted(weights) != sorted(parts):
        return False
    hp = idx.hp
    return native.supported(tuple(weights[n][0] for n in parts), hp.act, hp.n_embd,
                            weights[parts[0]][1][1])


def host_expert_requests(idx: ModelIndex, k: StageKey) -> list[Request]:
    """The host layers' expert spans of a stage, in file order: where the GPU computes them
    (host_compute "gpu"), the file's bytes (what the GPU's kernels read); where the CPU does
    ("cpu"), each in its CPU layout (`host.cpu_bytes`; the file's bytes where there is none);
    "both": the file's bytes, and beside each that has a CPU layout a span "cpu.<name>",
    unless the CPU's native kernel reads the layer's file bytes itself (k.native,
    `native_covers`)."""
    cut = host_cut(idx, k)

    def build() -> list[Request]:
        out = []
        for i in range(cut, k.hi):
            reqs = [r for r in idx.layer_requests[i] if is_expert(r[0])]
            layouts = [tensor_cpu_layout(name, type_id(dt), shape) for name, _, dt, shape in reqs]
            # "both" keeps CPU copies of a layer only when every expert matrix has a layout
            # (the runner sends a layer with any other to the GPU for decode too) and the
            # native kernel does not cover it
            both = k.host_compute == "both" and all(
                lay != "file" for (name, *_), lay in zip(reqs, layouts, strict=True)
                if name.endswith(".weight")) and not (k.native and native_covers(idx, reqs))
            for (name, nb, dt, shape), lay in zip(reqs, layouts, strict=True):
                cpu = cpu_bytes(name, type_id(dt), shape, nb)
                out.append((name, cpu if k.host_compute == "cpu" else nb, dt, shape))
                if both and lay != "file":
                    out.append((CPU_PREFIX + name, cpu, dt, shape))
        return out

    return _memo((idx.token, "hostreq", cut, k.hi, k.host_compute, k.native), build)


def host_terms(idx: ModelIndex, k: StageKey) -> dict[str, int]:
    """Pinned host bytes of the stage, by term: the experts of its host layers
    (`host_expert_requests`), and (when it has any) the transfer buffers its CPU compute runs
    on; {} otherwise."""
    if host_cut(idx, k) >= k.hi:
        return {}
    return {
        "host_experts": sum(r[1] for r in host_expert_requests(idx, k)),
        "host_buffers": sum(b.nbytes for b in _host_buffer_specs(idx, k)),
    }


def host_bytes(idx: ModelIndex, k: StageKey) -> int:
    """What the stage pins in host memory: its host arenas (each one allocation, 256-byte
    aligned spans, like a packed GPU arena)."""
    if host_cut(idx, k) >= k.hi:
        return 0
    bufs = sum(align_up(b.nbytes) for b in _host_buffer_specs(idx, k))
    return sum(align_up(r[1]) for r in host_expert_requests(idx, k)) + bufs


def _host_layer_sizes(idx: ModelIndex, i: int) -> list[int]:
    """Layer i's tensor sizes without its experts (a layer whose experts live in host memory)."""
    return [n for t, n in zip(idx.layer_tensors[i], idx.layer_sizes[i]) if not is_expert(t.name)]


def allocations(
    idx: ModelIndex, k: StageKey, mode: ArenaMode, scratch: int, dq: list[int] | int
) -> tuple[list[int], dict[str, int]]:
    """(allocation sizes in engine order, requested bytes per purpose) without building spans.
    `dq`: the dequant cache's span sizes, or (packed only) their aligned total. Experts of
    host layers are not in the GPU's weights arena (`host_terms` bills them)."""
    glob = _memo(
        (idx.token, "glob", k.first, k.last),
        lambda: [t.nbytes for t in _globals(idx, k.first, k.last)],
    )
    kv_raw, kv_al, kv_sizes = _kv_table(idx, k.ctx, k.kv_type)
    bufs = _buffer_sizes(idx, k, scratch)
    experts = idx.expert_raw_prefix[k.hi] - idx.expert_raw_prefix[k.lo]
    cut = host_cut(idx, k)
    on_host = idx.expert_raw_prefix[k.hi] - idx.expert_raw_prefix[cut]
    cache = sum(r[1] for r in _cache_requests(idx, k))  # multiples of 256 bytes each
    terms = {
        # the weights arena holds both; the bill shows the routed experts beside the dense rest
        "weights": idx.layer_raw_prefix[k.hi] - idx.layer_raw_prefix[k.lo] - experts,
        "experts": experts - on_host,
        "globals": sum(glob),
        "kv": kv_raw[k.hi] - kv_raw[k.lo],
        "buffers": sum(bufs),
        "expert_cache": cache,
    }
    if mode.kind == ArenaKind.PACKED:
        dq_al = dq if isinstance(dq, int) else sum(align_up(n) for n in dq)
        allocs = [
            idx.layer_prefix[k.hi] - idx.layer_prefix[k.lo]
            - (idx.expert_prefix[k.hi] - idx.expert_prefix[cut]),
            sum(align_up(n) for n in glob),
            kv_al[k.hi] - kv_al[k.lo],
            sum(align_up(n) for n in bufs),
            cache,
            dq_al,
        ]
        return [a for a in allocs if a], terms
    assert isinstance(dq, list)
    weights = [n for i in range(k.lo, cut) for n in idx.layer_sizes[i]]
    weights += [n for i in range(cut, k.hi) for n in _host_layer_sizes(idx, i)]
    allocs = allocation_sizes(mode, weights)
    allocs += allocation_sizes(mode, glob)
    allocs += allocation_sizes(mode, [n for i in range(k.lo, k.hi) for n in kv_sizes[i]])
    allocs += allocation_sizes(mode, bufs)
    allocs += allocation_sizes(mode, [r[1] for r in _cache_requests(idx, k)])
    return allocs + allocation_sizes(mode, dq), terms


def arenas(
    idx: ModelIndex, k: StageKey, mode: ArenaMode, scratch: int, chosen: list[Any]
) -> list[Arena]:
    """The stage's arenas with every span, in allocation order (what `allocations` counted)."""
    # the dequant cache in bf16 unless activations are f16 (whether f16 or bf16 products run
    # faster on a CPU depends on the CPU: f16 won 1.7-2.6x on a Zen 4, lost ~10x on an older
    # Xeon; cpu_experts.half_dtype times it for host experts)
    dq_dtype = "f16" if k.act_dtype == "f16" else "bf16"
    cut = host_cut(idx, k)
    on_gpu = [r for i in range(k.lo, cut) for r in idx.layer_requests[i]]
    on_gpu += [r for i in range(cut, k.hi) for r in idx.layer_requests[i] if not is_expert(r[0])]
    out = arrange(mode, "weights", "weights", on_gpu)
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
    out += arrange(mode, "expert_cache", "expert_cache", _cache_requests(idx, k))
    out += arrange(
        mode, "dequant_cache", "dequant_cache", [dq_request(t, dq_dtype) for t in chosen]
    )
    return out + host_arenas(idx, k)


def host_arenas(idx: ModelIndex, k: StageKey) -> list[Arena]:
    """The stage's pinned host arenas (purposes in layout.HOST_PURPOSES): its host layers'
    experts (`host_expert_requests`), then the CPU compute's transfer buffers (`hbuf.<name>`).
    Each is one allocation whatever the GPU's arena mode."""
    cut = host_cut(idx, k)
    if cut >= k.hi:
        return []
    experts = host_expert_requests(idx, k)
    bufs = [(f"hbuf.{b.name}", b.nbytes, b.dtype, b.shape) for b in _host_buffer_specs(idx, k)]
    return [a for a in (packed("host_experts", "host_experts", experts),
                        packed("host_buffers", "host_buffers", bufs)) if a is not None]


def dq_request(t: Any, dtype: str) -> Request:
    rows, cols = t.n_elements // t.shape[0], t.shape[0]
    return (f"dq.{t.name}", rows * cols * DTYPE_BYTES[dtype], dtype, (rows, cols))


def stage_need(idx: ModelIndex, k: StageKey) -> int:
    """Bytes the stage needs without the elastic dequant cache: weights, globals, KV, buffers,
    rounding and overhead. The split search and the advice compare it with free - reserve."""
    mode = parse_arena(k.arena)
    dq: list[int] | int = 0 if mode.kind == ArenaKind.PACKED else []
    allocs, _ = allocations(idx, k, mode, scratch_elements(idx, k), dq)
    return reserved_bytes(allocs, not k.device.is_cpu) + overhead_for(k.device)[0]


def fits(idx: ModelIndex, k: StageKey) -> bool:
    return stage_need(idx, k) <= k.device.free - k.device.reserve

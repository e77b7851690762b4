"""The carve: which tensors a stage holds, and the per-model index pricing is built on.

A stage running layers [lo, hi) holds exactly the tensors `blk.N.*` with lo <= N < hi, plus
`token_embd` on the first stage and `output_norm` + `output` on the last (a tied model's last
stage keeps its own copy of `token_embd`). A MoE layer's expert tensors (`*_exps.*`) are its
tensors like any other, so a stage holds only its own layers' experts; they are billed as their
own term. Layers a file declares but the model does not run (GLM's next-token-prediction layer:
`blk.N.*` for N >= n_layer_run) are neither priced nor loaded; the index keeps their count and
bytes for the bill. `model_index` computes everything about a model that pricing needs once
(per-layer byte sums as prefix sums, the cacheable matrices), so re-pricing while a user drags
a boundary is arithmetic on those sums.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from engine.planning.arena import Request, align_up
from spec.errors import CarveError
from spec.quant_types import type_name

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


def is_expert(name: str) -> bool:
    """A routed-expert tensor (`blk.N.ffn_{gate,up,down}_exps.weight|bias`): stacked over the
    experts (last GGUF dimension), of which a token reads n_expert_used."""
    return "_exps." in name


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
    expert_raw_prefix: tuple[int, ...] = (0,)  # exact expert-tensor bytes of layers [0, i)
    skipped: tuple[Any, ...] = ()  # tensors of declared layers the model does not run (NextN)
    n_skipped_layers: int = 0
    expert_prefix: tuple[int, ...] = (0,)  # aligned expert-tensor bytes of layers [0, i)
    moe_prefix: tuple[int, ...] = (0,)  # MoE layers (layers holding experts) among [0, i)
    # per layer: bytes of one expert slot, its gate, up and down slices (and biases) each
    # 256-byte aligned; 0 for a dense layer
    expert_slot: tuple[int, ...] = ()

    def moe_layers(self, lo: int, hi: int) -> list[int]:
        """The layers of [lo, hi) that hold routed experts, in order."""
        return [i for i in range(lo, hi) if self.expert_slot[i]]

    def host_cut(self, lo: int, hi: int, resident: int) -> int:
        """The first layer of [lo, hi) whose experts live in host memory when the stage keeps
        ``resident`` MoE layers' experts in VRAM (its first ones); hi when it keeps them all."""
        moe = self.moe_layers(lo, hi)
        return moe[resident] if resident < len(moe) else hi


def _request(t: Any) -> Request:
    # raw GGUF bytes; shape in GGUF order (ne0 first), dtype the GGUF type name
    return (t.name, t.nbytes, type_name(t.ggml_type), tuple(t.shape))


def _prefix(values: list[int]) -> tuple[int, ...]:
    out = [0]
    for v in values:
        out.append(out[-1] + v)
    return tuple(out)


# Where a model object takes no attributes, its index waits here (the last few only). A
# GGUFModel keeps its own index (`_carve_index`): the two refer to each other and are freed
# together once nobody holds the model, so an unloaded model's file mapping and header go with it
# (a table of the last models here kept up to 8 of them mapped after their sessions closed).
_INDEX: OrderedDict[int, ModelIndex] = OrderedDict()
_TOKENS = itertools.count()
_ATTR = "_carve_index"


def model_index(model: Any) -> ModelIndex:
    idx = getattr(model, _ATTR, None) or _INDEX.get(id(model))
    if idx is not None and idx.model is model:
        return idx
    from engine.gguf.hparams import HParams

    hp = HParams.from_model(model)
    n = getattr(hp, "n_layer_run", 0) or hp.n_layer  # the layers the model runs
    per: list[list[Any]] = [[] for _ in range(n)]
    by_name = {}
    skipped = []
    for t in model.tensors:
        layer = t.layer
        if layer is None:
            by_name[t.name] = t
        elif 0 <= layer < n:
            per[layer].append(t)
        elif n <= layer < hp.n_layer:
            skipped.append(t)  # declared, never run: neither priced nor loaded
        else:
            raise CarveError(f"{model.paths[0]}: tensor {t.name} is outside the model's "
                             f"{hp.n_layer} layers")
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
            # experts get no cache copy (bf16 copies would be ~4x the file's largest term):
            # the GPU's grouped GEMM reads their GGUF bytes, the CPU engine dequantizes one
            # routed expert at a time into the scratch
            if len(t.shape) >= 2 and t.ggml_type not in NOT_QUANTIZED and not is_expert(t.name)
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
        gemm_max[act, "all"] = tuple(max((_gemm_elements(t) for t in m), default=0) for m in mats)
        gemm_max[act, "uncacheable"] = tuple(
            max(
                (_gemm_elements(t) for t in m if t.ggml_type in NOT_QUANTIZED or is_expert(t.name)),
                default=0,
            )
            for m in mats
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
        _prefix([sum(t.nbytes for t in ts if is_expert(t.name)) for ts in per]),
        tuple(skipped),
        hp.n_layer - n,
        _prefix([sum(align_up(t.nbytes) for t in ts if is_expert(t.name)) for ts in per]),
        _prefix([int(any(is_expert(t.name) for t in ts)) for ts in per]),
        tuple(_slot_bytes(ts, getattr(hp, "n_expert", 0)) for ts in per),
    )
    try:
        setattr(model, _ATTR, idx)
    except (AttributeError, TypeError):
        _INDEX[id(model)] = idx
        while len(_INDEX) > 8:
            _INDEX.popitem(last=False)
    return idx


def _slot_bytes(tensors: Any, n_expert: int) -> int:
    """One expert's gate, up and down slices (and their biases), each 256-byte aligned: what
    one slot of the VRAM expert cache holds for this layer."""
    return sum(align_up(t.nbytes // n_expert) for t in tensors if is_expert(t.name))


def _gemm_elements(t: Any) -> int:
    """Elements a prefill GEMM on `t` dequantizes at once: the matrix, or one expert's slice
    of a stacked expert tensor."""
    return t.n_elements // t.shape[-1] if is_expert(t.name) else t.n_elements


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


def parameter_counts(model: Any, hp: Any) -> tuple[int, int]:
    """(parameters the model runs, parameters a token reads): the second counts n_expert_used
    of every n_expert routed experts (shared experts and everything else in full). Layers the
    file declares but the model does not run are in neither."""
    run = getattr(hp, "n_layer_run", 0) or hp.n_layer
    total = active = 0
    share = hp.n_expert_used / hp.n_expert if getattr(hp, "n_expert", 0) else 1.0
    for t in model.tensors:
        if t.layer is not None and t.layer >= run:
            continue
        total += t.n_elements
        active += round(t.n_elements * share) if is_expert(t.name) else t.n_elements
    return total, active

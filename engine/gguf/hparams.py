"""Architecture hyper-parameters from GGUF metadata, read with llama.cpp's keys and defaults.

Everything downstream (pricing, buffers, the runtime) reads these fields instead of metadata, so
an architecture's quirks (gemma3's sliding-window layers, scaled embeddings, sandwich norms)
are decided here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.gguf.reader import GGUFModel
from spec.errors import CarveError

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3")
_ROPE_STYLE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox"}
# gemma3: every 6th layer (i+1) % 6 == 0 attends globally, the rest use the window
# (llama.cpp src/llama-model.cpp: hparams.set_swa_pattern(6) for LLM_ARCH_GEMMA3)
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_ROPE_BASE_SWA = 10000.0
_GEMMA3_DEFAULT_WINDOW = 512


@dataclass(frozen=True, slots=True)
class HParams:
    arch: str  # "llama" | "qwen2" | "qwen3" | "gemma3"
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int  # key/query head dim
    head_dim_v: int
    n_ff: int
    n_vocab: int
    n_ctx_train: int
    rms_eps: float
    rope_base: float
    rope_base_swa: float  # gemma3 local layers use 10000
    rope_style: str  # "normal" (llama: adjacent pairs) | "neox" (halves)
    rope_scaling: str | None
    rope_scale: float
    sliding_window: int  # 0 = none
    swa_layers: tuple[bool, ...]  # per layer: does it use the sliding window
    tied_embeddings: bool  # no output.weight in the file
    qk_norm: bool
    sandwich_norm: bool
    embed_scale: float
    act: str  # "silu" | "gelu"
    attn_scale: float  # multiplier of q·k

    @staticmethod
    def from_model(model: GGUFModel) -> HParams:
        return _read(model)

    def kv_cells(self, layer: int, ctx: int) -> int:
        """KV cache cells layer ``layer`` needs for a context of ``ctx`` tokens."""
        if self.swa_layers[layer] and self.sliding_window:
            return min(ctx, self.sliding_window)
        return ctx


class _Meta:
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


def _swa_layers(meta: _Meta, n_layer: int) -> tuple[bool, ...]:
    pattern = meta.md.get(f"{meta.arch}.attention.sliding_window_pattern", _GEMMA3_SWA_PATTERN)
    if isinstance(pattern, list):
        if len(pattern) != n_layer:
            raise CarveError(f"{meta.path}: {meta.arch}.attention.sliding_window_pattern has "
                             f"{len(pattern)} entries for {n_layer} layers")
        return tuple(bool(x) for x in pattern)
    if not isinstance(pattern, int) or isinstance(pattern, bool) or pattern < 1:
        raise CarveError(f"{meta.path}: {meta.arch}.attention.sliding_window_pattern "
                         f"{pattern!r} is not a layer period")
    return tuple((i + 1) % pattern != 0 for i in range(n_layer))


def _check_shapes(model: GGUFModel, expect: dict[str, tuple[int, ...]]) -> None:
    # metadata that disagrees with the tensors would misprice every KV cache and buffer
    by_name = {t.name: t for t in model.tensors if t.name in expect}
    for name, shape in expect.items():
        t = by_name.get(name)
        if t is None:
            raise CarveError(f"{model.paths[0]}: tensor {name} is missing; the metadata "
                             "describes more layers or parts than the file holds")
        if t.shape != shape:
            raise CarveError(f"{model.paths[0]}: tensor {name} has shape {list(t.shape)} but "
                             f"the metadata implies {list(shape)}; the file is inconsistent")


def _read(model: GGUFModel) -> HParams:
    arch = model.arch
    if arch not in SUPPORTED:
        raise CarveError(f"{model.paths[0]}: unsupported architecture {arch!r}; Carve runs "
                         f"{', '.join(SUPPORTED)}")
    m = _Meta(model)
    n_layer = m.int_("block_count", required=True)
    n_embd = m.int_("embedding_length", required=True)
    n_head = m.int_("attention.head_count", required=True)
    n_head_kv = m.int_("attention.head_count_kv", n_head)
    n_ff = m.int_("feed_forward_length", required=True)
    if min(n_layer, n_embd, n_head, n_head_kv, n_ff) <= 0 or n_head % n_head_kv:
        raise CarveError(f"{model.paths[0]}: impossible shape ({n_layer} layers, {n_embd} "
                         f"hidden, {n_head} heads, {n_head_kv} KV heads, FFN {n_ff})")
    head_dim = m.int_("attention.key_length", n_embd // n_head)
    head_dim_v = m.int_("attention.value_length", head_dim)

    embd = next((t for t in model.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise CarveError(f"{model.paths[0]}: no token_embd.weight matrix; not a complete model")
    n_vocab = embd.shape[1]
    tied = not any(t.name == "output.weight" for t in model.tensors)
    _check_shapes(model, {
        "token_embd.weight": (n_embd, n_vocab),
        "blk.0.attn_q.weight": (n_embd, n_head * head_dim),
        "blk.0.attn_k.weight": (n_embd, n_head_kv * head_dim),
        "blk.0.attn_v.weight": (n_embd, n_head_kv * head_dim_v),
        "blk.0.ffn_up.weight": (n_embd, n_ff),
        f"blk.{n_layer - 1}.ffn_down.weight": (n_ff, n_embd),
    })

    rope_base = m.float_("rope.freq_base", 10000.0)
    scaling = m.str_("rope.scaling.type")
    scale = m.float_("rope.scaling.factor", 0.0)
    if not scale:
        linear = m.float_("rope.scale_linear", 0.0)  # pre-2024 converters
        if linear:
            scaling, scale = scaling or "linear", linear
    if scaling == "none":
        scaling = None

    gemma = arch == "gemma3"
    window = m.int_("attention.sliding_window", _GEMMA3_DEFAULT_WINDOW if gemma else 0)
    swa = _swa_layers(m, n_layer) if gemma and window else (False,) * n_layer
    query_pre = m.float_("attention.query_pre_attn_scalar", 0.0)
    if query_pre:
        default_scale = query_pre**-0.5
    elif gemma and n_layer == 62:
        # Gemma 3 27B: query_pre_attn_scalar = n_embd / n_head = 168, not head_dim; the GGUF
        # does not carry it, so llama.cpp keys it on the model size (62 layers) as we do
        default_scale = (n_embd / n_head) ** -0.5
    else:
        default_scale = head_dim**-0.5
    attn_scale = m.float_("attention.scale", default_scale)

    return HParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff, n_vocab=n_vocab,
        n_ctx_train=m.int_("context_length", 0, required=True),
        rms_eps=m.float_("attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5),
        rope_base=rope_base,
        rope_base_swa=_GEMMA3_ROPE_BASE_SWA if gemma else rope_base,
        rope_style=_ROPE_STYLE[arch], rope_scaling=scaling, rope_scale=scale or 1.0,
        sliding_window=window if gemma else 0, swa_layers=swa, tied_embeddings=tied,
        qk_norm=arch in ("qwen3", "gemma3"), sandwich_norm=gemma,
        embed_scale=math.sqrt(n_embd) if gemma else 1.0, act="gelu" if gemma else "silu",
        attn_scale=attn_scale,
    )

"""Architecture hyper-parameters from GGUF metadata, read with llama.cpp's keys and defaults.

Everything downstream (pricing, buffers, the runtime) reads these fields instead of metadata, so
an architecture's quirks (gemma3's sliding-window layers, scaled embeddings, sandwich norms)
are decided here once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from engine.gguf.hparams_moe import LEAD_SHARED, mla_shapes, read_mla, read_moe
from engine.gguf.meta import (
    Meta,
    blocks_held,
    check_layers_alike,
    check_layers_complete,
    check_shapes,
    within,
)
from engine.gguf.reader import GGUFModel
from spec.errors import CarveError
from spec.quant_types import BF16, F16, F32, type_name

SUPPORTED = ("llama", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "gpt-oss", "glm4moe",
             "deepseek2", "minimax-m2", "dots1", "ernie4_5-moe")
MOE_ARCHS = ("qwen3moe", "gpt-oss", "glm4moe", "deepseek2", "minimax-m2", "dots1",
             "ernie4_5-moe")
# architectures whose files may route through experts: llama with {arch}.expert_count > 0 is
# Mixtral's (llama.cpp builds it as llama's block with a softmax-routed, renormalised MoE FFN)
_MAYBE_MOE = ("llama",)
_ROPE_STYLE = {"llama": "normal", "qwen2": "neox", "qwen3": "neox", "gemma3": "neox",
               "phi3": "neox", "qwen3moe": "neox", "gpt-oss": "neox", "glm4moe": "neox",
               "deepseek2": "normal", "minimax-m2": "neox", "dots1": "neox",
               "ernie4_5-moe": "normal"}
# per-pair RoPE frequency factors: llama-3.1's, and LongRoPE's two sets (phi3: the long ones for
# contexts beyond the original)
ROPE_FACTORS = "rope_freqs.weight"
ROPE_LONG, ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
FACTOR_TENSORS = (ROPE_FACTORS, ROPE_LONG, ROPE_SHORT)
# gpt-oss's clamped SwiGLU limit and sliding-window period (llama.cpp hard-codes both:
# swiglu_oai(limit = 7.0), set_swa_pattern(2) = even layers use the window)
_GPT_OSS_SWIGLU_LIMIT = 7.0
_GPT_OSS_SWA_PATTERN = 2
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
    # --- mixture of experts (all zero / off for dense models) ---
    n_expert: int = 0  # routed experts per MoE layer
    n_expert_used: int = 0  # experts each token is routed to (top-k)
    n_ff_exp: int = 0  # one routed expert's FFN width
    n_expert_shared: int = 0  # shared experts beside the routed ones (glm4moe: 1)
    n_ff_shexp: int = 0  # the shared-expert FFN width, as its tensors hold it (all shared ones)
    n_layer_dense_lead: int = 0  # leading layers with a dense FFN (glm4moe)
    # "softmax": softmax over all experts, then top-k (qwen3moe); "softmax_topk": top-k on the
    # logits, softmax over the chosen k (gpt-oss); "sigmoid": top-k of sigmoid + exp_probs_b,
    # weights the plain sigmoid values (glm4moe)
    expert_gating: str = ""
    expert_weights_norm: bool = False  # chosen weights divided by their sum
    expert_weights_scale: float = 1.0  # chosen weights multiplied by it (glm4moe routed scaling)
    n_layer_run: int = 0  # layers the model runs; 0 = n_layer (glm4moe's NextN layers are not)
    rope_dim: int = 0  # leading dims of each head RoPE rotates; 0 = head_dim (glm4moe: half)
    swiglu_limit: float = 0.0  # gpt-oss clamped SwiGLU (gate <= limit, |up| <= limit); 0 = off
    attn_sinks: bool = False  # per-head sink logit in the softmax denominator (gpt-oss)
    # YaRN (rope_scaling == "yarn", factor rope_scale): {arch}.rope.scaling.*
    rope_scaling_orig_ctx: int = 0  # original_context_length
    rope_yarn_beta_fast: float = 32.0
    rope_yarn_beta_slow: float = 1.0
    # round the YaRN ramp's ends to whole dims (llama.cpp does for every model; gpt-oss's own
    # config says truncate = false, as its reference implementation and transformers run it)
    rope_yarn_truncate: bool = True
    # the file's per-pair RoPE frequency factors (rope_freqs.weight, [rope_dim/2]: llama-3.1
    # and later), dividing the global layers' frequencies
    rope_factors: bool = False
    # LongRoPE (rope_scaling == "longrope", phi3): rope_factors_long / _short by the context
    # (long beyond rope_scaling_orig_ctx, as llama.cpp chooses), cos and sin times this factor
    rope_attn_factor: float = 1.0
    # phi3's fused matrices: q, k and v as the rows of one attn_qkv; gate and up as the two
    # halves of ffn_up's rows (gate first)
    fused_qkv: bool = False
    fused_gate_up: bool = False
    # the q/k RMSNorms over each token's whole projected q and k (minimax-m2: weights of
    # n_head * head_dim and n_head_kv * head_dim), before the heads are split; else per head
    qk_norm_whole: bool = False
    # DeepSeek's multi-head latent attention (deepseek2, kv_lora_rank > 0): each token's keys
    # and values are one latent row of kv_lora_rank values (RMS-normed) plus rope_dim rotated
    # key dims shared by every head; the KV cache holds that row, and each head's key and value
    # are its products with attn_k_b / attn_v_b (or the legacy attn_kv_b's rows). head_dim is
    # the query/key head (nope + rope dims), head_dim_v the value head.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # > 0: q = attn_q_b(norm(attn_q_a x)); 0: one attn_q
    mla_legacy: bool = False  # one attn_kv_b [n_head (nope + v), kv_lora] (pre-2025 files)
    # group-limited routing (DeepSeek-V3): only experts in the n_group_used groups of
    # n_expert / n_expert_groups with the best sums of their top two selection scores
    n_expert_groups: int = 0
    n_group_used: int = 0
    # YaRN's mscale_all_dim (deepseek2: rope.scaling.yarn_log_multiplier / 0.1): the attention
    # scale is multiplied by (1 + 0.1 mscale_all_dim ln factor)^2 and cos/sin are not scaled
    rope_yarn_log_mul: float = 0.0
    # attention temperature (deepseek2 files of Mistral Large 3): each token's query times
    # 1 + attn_temp_scale ln(floor(pos / attn_temp_length) + 1), as llama.cpp scales it
    attn_temp_scale: float = 0.0
    attn_temp_length: int = 0

    def __post_init__(self) -> None:
        if not self.n_layer_run:
            object.__setattr__(self, "n_layer_run", self.n_layer)
        if not self.rope_dim:
            object.__setattr__(self, "rope_dim", self.head_dim)

    def is_moe_layer(self, i: int) -> bool:
        """Does layer ``i`` route through experts (else it has a dense FFN)."""
        return self.n_expert > 0 and i >= self.n_layer_dense_lead

    @staticmethod
    def from_model(model: GGUFModel) -> HParams:
        return _read(model)

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    def kv_rows(self) -> tuple[tuple[int, int], tuple[int, int] | None]:
        """What one KV cache cell holds per layer: keys (heads, dims) and values (heads, dims),
        or None where the values are the keys' leading kv_lora_rank dims (MLA's latent row)."""
        if self.mla:
            return (1, self.kv_lora_rank + self.rope_dim), None
        return (self.n_head_kv, self.head_dim), (self.n_head_kv, self.head_dim_v)

    def kv_cells(self, layer: int, ctx: int) -> int:
        """KV cache cells layer ``layer`` needs for a context of ``ctx`` tokens."""
        if self.swa_layers[layer] and self.sliding_window:
            return min(ctx, self.sliding_window)
        return ctx


def _swa_layers(meta: Meta, n_layer: int) -> tuple[bool, ...]:
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


def rope_per_pair(hp: Any) -> bool:
    """Whether the global layers' RoPE takes a frequency per rotated pair (YaRN's, LongRoPE's,
    or llama-3.1's rope_freqs factors applied) rather than the base and a linear scale: the
    GPU stage writes them once into buf.rope_freqs, which pricing reserves."""
    return (getattr(hp, "rope_scaling", None) in ("yarn", "longrope")
            or bool(getattr(hp, "rope_factors", False)))


def _read(model: GGUFModel) -> HParams:
    arch = model.arch
    if arch not in SUPPORTED:
        raise CarveError(f"{model.paths[0]}: unsupported architecture {arch!r}; Carve runs "
                         f"{', '.join(SUPPORTED)}")
    m = Meta(model)
    n_layer = m.int_("block_count", required=True)
    n_embd = m.int_("embedding_length", required=True)
    n_head = m.int_("attention.head_count", required=True)
    n_head_kv = m.int_("attention.head_count_kv", n_head)
    n_ff = m.int_("feed_forward_length", required=True)
    if min(n_layer, n_embd, n_head, n_head_kv, n_ff) <= 0 or n_head % n_head_kv:
        raise CarveError(f"{model.paths[0]}: impossible shape ({n_layer} layers, {n_embd} "
                         f"hidden, {n_head} heads, {n_head_kv} KV heads, FFN {n_ff})")
    held = blocks_held(model)
    # next-token-prediction layers (GLM, DeepSeek-V3): declared in block_count, never run
    nextn = m.int_("nextn_predict_layers", 0) if arch in LEAD_SHARED else 0
    if not 0 <= nextn < n_layer:
        raise CarveError(f"{model.paths[0]}: {arch}.nextn_predict_layers {nextn} leaves no "
                         f"layer to run of {n_layer}")
    # before anything is sized per layer (a count of 2**60 is one field); a GLM file may leave
    # out the layers it does not run
    if n_layer - nextn > held:
        raise CarveError(f"{model.paths[0]}: {arch}.block_count is {n_layer} but the file "
                         f"holds tensors of {held} layers; the file is inconsistent")
    head_dim = m.int_("attention.key_length", n_embd // n_head)
    head_dim_v = m.int_("attention.value_length", head_dim)
    mla = read_mla(model, m) if arch == "deepseek2" else {}
    if mla and not mla["mla_legacy"]:  # key/value_length are the latent row's; these the heads'
        head_dim = m.int_("attention.key_length_mla", required=True)
        head_dim_v = m.int_("attention.value_length_mla", required=True)

    embd = next((t for t in model.tensors if t.name == "token_embd.weight"), None)
    if embd is None or len(embd.shape) != 2:
        raise CarveError(f"{model.paths[0]}: no token_embd.weight matrix; not a complete model")
    n_vocab = embd.shape[1]
    tied = not any(t.name == "output.weight" for t in model.tensors)
    routed = arch in MOE_ARCHS or (arch in _MAYBE_MOE and m.int_("expert_count", 0) > 0)
    moe = read_moe(model, m, n_layer - nextn, n_embd) if routed else {}
    n_run = moe.get("n_layer_run", n_layer)
    n_dense = min(n_run, moe.get("n_layer_dense_lead", n_run))  # layers 0 .. n_dense-1
    by_name = {t.name: t for t in model.tensors}
    fused_qkv = "blk.0.attn_qkv.weight" in by_name
    fused_gate_up = arch == "phi3" and bool(n_dense) and "blk.0.ffn_gate.weight" not in by_name
    expect = {"token_embd.weight": (n_embd, n_vocab)}
    if mla:
        expect.update(mla_shapes(m, mla, n_embd, n_head, head_dim, head_dim_v))
    elif fused_qkv:
        expect["blk.0.attn_qkv.weight"] = (n_embd, (n_head + n_head_kv) * head_dim
                                           + n_head_kv * head_dim_v)
    else:
        expect["blk.0.attn_q.weight"] = (n_embd, n_head * head_dim)
        expect["blk.0.attn_k.weight"] = (n_embd, n_head_kv * head_dim)
        expect["blk.0.attn_v.weight"] = (n_embd, n_head_kv * head_dim_v)
    if n_dense:
        expect["blk.0.ffn_up.weight"] = (n_embd, (2 if fused_gate_up else 1) * n_ff)
        expect[f"blk.{n_dense - 1}.ffn_down.weight"] = (n_ff, n_embd)
    check_shapes(model, expect)
    optional = {  # where the file has them
        "blk.0.attn_output.weight": (n_head * head_dim_v, n_embd),
        "blk.0.attn_norm.weight": (n_embd,),
        "output.weight": (n_embd, n_vocab),
        "output_norm.weight": (n_embd,),
    }
    if n_dense:
        optional["blk.0.ffn_gate.weight"] = (n_embd, n_ff)
    check_shapes(model, optional, required=False)
    check_layers_alike(model, n_run)
    check_layers_complete(model, n_run, n_dense)

    gemma, oss = arch == "gemma3", arch == "gpt-oss"
    n_ctx_train = m.int_("context_length", 0, required=True)
    within(model, "context_length", n_ctx_train, n_ctx_train >= 0, "a token count")
    rope_base = m.float_("rope.freq_base", 10000.0)
    within(model, "rope.freq_base", rope_base, rope_base > 1, "a number above 1")
    rms_eps = m.float_("attention.layer_norm_rms_epsilon", 1e-6 if gemma else 1e-5)
    within(model, "attention.layer_norm_rms_epsilon", rms_eps, 0 <= rms_eps < 1,
            "at least 0 and below 1")
    scaling = m.str_("rope.scaling.type")
    scale = m.float_("rope.scaling.factor", 0.0)
    within(model, "rope.scaling.factor", scale, scale >= 0, "above 0 (or absent)")
    if not scale:
        linear = m.float_("rope.scale_linear", 0.0)  # pre-2024 converters
        within(model, "rope.scale_linear", linear, linear >= 0, "above 0 (or absent)")
        if linear:
            scaling, scale = scaling or "linear", linear
    if scaling == "none":
        scaling = None

    window = m.int_("attention.sliding_window", _GEMMA3_DEFAULT_WINDOW if gemma else 0)
    within(model, "attention.sliding_window", window, window >= 0, "a token count")
    if gemma and window:
        swa = _swa_layers(m, n_layer)
    elif oss and window:
        swa = tuple(i % _GPT_OSS_SWA_PATTERN == 0 for i in range(n_layer))
    else:
        swa = (False,) * n_layer
    rope_dim = m.int_("rope.dimension_count", head_dim)
    if rope_dim <= 0 or rope_dim > head_dim or rope_dim % 2:
        raise CarveError(f"{model.paths[0]}: {arch}.rope.dimension_count {rope_dim} does not fit "
                         f"a head of {head_dim}; it must be even and at most the head dim")
    if scaling == "yarn":
        if arch == "deepseek2":  # the converter writes 0.1 mscale_all_dim (llama.cpp undoes it)
            log_mul = m.float_("rope.scaling.yarn_log_multiplier", 0.0)
            within(model, "rope.scaling.yarn_log_multiplier", log_mul, log_mul >= 0,
                    "at least 0 (or absent)")
            moe["rope_yarn_log_mul"] = log_mul / 0.1
        moe["rope_scaling_orig_ctx"] = m.int_("rope.scaling.original_context_length", 0)
        moe["rope_yarn_beta_fast"] = m.float_("rope.scaling.yarn_beta_fast", 32.0)
        moe["rope_yarn_beta_slow"] = m.float_("rope.scaling.yarn_beta_slow", 1.0)
        for beta in ("fast", "slow"):
            v = moe[f"rope_yarn_beta_{beta}"]
            within(model, f"rope.scaling.yarn_beta_{beta}", v, v > 0, "above 0")
        moe["rope_yarn_truncate"] = not oss
        if moe["rope_scaling_orig_ctx"] <= 0 or scale <= 1.0:
            raise CarveError(f"{model.paths[0]}: YaRN RoPE needs {arch}.rope.scaling.factor > 1 "
                             f"and {arch}.rope.scaling.original_context_length; the file lacks one")
    for name in FACTOR_TENSORS:
        t = by_name.get(name)
        if t is None:
            continue
        if t.shape != (rope_dim // 2,):
            raise CarveError(f"{model.paths[0]}: tensor {name} has shape {list(t.shape)} but a "
                             f"head rotates {rope_dim // 2} pairs ({arch}.rope.dimension_count "
                             f"{rope_dim}); the file is inconsistent")
        if t.ggml_type not in (F32, F16, BF16):
            raise CarveError(f"{model.paths[0]}: tensor {name} is {type_name(t.ggml_type)}; "
                             "RoPE factors are read as F32, F16 or BF16 (re-convert the file)")
    factors = by_name.get(ROPE_FACTORS)
    if (ROPE_LONG in by_name) != (ROPE_SHORT in by_name):
        missing = ROPE_SHORT if ROPE_LONG in by_name else ROPE_LONG
        raise CarveError(f"{model.paths[0]}: tensor {missing} is missing; LongRoPE needs both "
                         "factor sets (the file is incomplete)")
    if ROPE_LONG in by_name and factors is None and scaling in (None, "longrope", "su"):
        scaling = "longrope"
        moe["rope_scaling_orig_ctx"] = m.int_("rope.scaling.original_context_length", 0)
        moe["rope_attn_factor"] = m.float_("rope.scaling.attn_factor", 1.0)
        within(model, "rope.scaling.attn_factor", moe["rope_attn_factor"],
                moe["rope_attn_factor"] > 0, "above 0")
        if moe["rope_scaling_orig_ctx"] <= 0:
            raise CarveError(f"{model.paths[0]}: LongRoPE needs "
                             f"{arch}.rope.scaling.original_context_length (the context its "
                             "short factors serve); the file lacks it")
    qk_norm = arch in ("qwen3", "gemma3", "qwen3moe", "minimax-m2", "dots1") or (
        arch == "glm4moe" and any(t.name == "blk.0.attn_q_norm.weight" for t in model.tensors))
    qk_whole = arch == "minimax-m2"
    if qk_norm:  # per head, or (minimax-m2) over the whole projections
        check_shapes(model, {
            "blk.0.attn_q_norm.weight": (n_head * head_dim,) if qk_whole else (head_dim,),
            "blk.0.attn_k_norm.weight": (n_head_kv * head_dim,) if qk_whole else (head_dim,)})
    query_pre = m.float_("attention.query_pre_attn_scalar", 0.0)
    within(model, "attention.query_pre_attn_scalar", query_pre, query_pre >= 0,
            "above 0 (or absent)")
    if query_pre:
        default_scale = query_pre**-0.5
    elif gemma and n_layer == 62:
        # Gemma 3 27B: query_pre_attn_scalar = n_embd / n_head = 168, not head_dim; the GGUF
        # does not carry it, so llama.cpp keys it on the model size (62 layers) as we do
        default_scale = (n_embd / n_head) ** -0.5
    else:
        default_scale = head_dim**-0.5
    if mla and scaling == "yarn":
        # llama.cpp's deepseek2 graph: q·k times mscale^2, mscale = (cos/sin's YaRN factor) *
        # (1 + 0.1 mscale_all_dim ln factor); transformers' yarn_apply_mscale agrees when the
        # file has mscale_all_dim, as every DeepSeek file does
        log_mul = moe.get("rope_yarn_log_mul", 0.0)
        rope_mult = 1.0 if log_mul else 0.1 * math.log(scale) + 1.0
        default_scale *= (rope_mult * (1 + 0.1 * log_mul * math.log(scale))) ** 2
    attn_scale = m.float_("attention.scale", default_scale)
    within(model, "attention.scale", attn_scale, attn_scale > 0, "above 0")

    return HParams(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
        head_dim=head_dim, head_dim_v=head_dim_v, n_ff=n_ff, n_vocab=n_vocab,
        n_ctx_train=n_ctx_train, rms_eps=rms_eps,
        rope_base=rope_base,
        rope_base_swa=_GEMMA3_ROPE_BASE_SWA if gemma else rope_base,
        rope_style=_ROPE_STYLE[arch], rope_scaling=scaling, rope_scale=scale or 1.0,
        sliding_window=window if gemma or oss else 0, swa_layers=swa, tied_embeddings=tied,
        qk_norm=qk_norm, sandwich_norm=gemma,
        embed_scale=math.sqrt(n_embd) if gemma else 1.0, act="gelu" if gemma else "silu",
        attn_scale=attn_scale, rope_dim=rope_dim,
        swiglu_limit=_GPT_OSS_SWIGLU_LIMIT if oss else 0.0, attn_sinks=oss,
        rope_factors=factors is not None, fused_qkv=fused_qkv, fused_gate_up=fused_gate_up,
        qk_norm_whole=qk_whole, **mla, **moe,
    )



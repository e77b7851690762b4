"""The mixture-of-experts and latent-attention fields of a GGUF's hyper-parameters, read with
llama.cpp's keys and defaults and checked against every run layer's router, expert and
latent-attention tensors (engine/gguf/hparams.py builds HParams from them)."""

from __future__ import annotations

from typing import Any

from engine.gguf.meta import Meta, tensor_shapes, within
from engine.gguf.reader import GGUFModel
from spec.errors import CarveError

# {arch}.expert_gating_func values (gguf ExpertGatingFuncType); gpt-oss has no key: llama.cpp
# always takes the softmax over the chosen k logits for it
_GATING = {1: "softmax", 2: "sigmoid"}
# deepseek2 files without the key are DeepSeek-V2/V2.5's: softmax (as llama.cpp defaults them)
_GATING_DEFAULT = {"qwen3moe": "softmax", "glm4moe": "sigmoid", "llama": "softmax",
                   "deepseek2": "softmax", "minimax-m2": "sigmoid", "dots1": "sigmoid",
                   "ernie4_5-moe": "softmax"}
# architectures with leading dense layers, shared experts and file-set weight norm and scale
LEAD_SHARED = ("glm4moe", "deepseek2", "dots1", "ernie4_5-moe")


def read_moe(model: GGUFModel, m: Meta, n_run: int, n_embd: int) -> dict[str, Any]:
    """The expert fields of a MoE architecture (``n_run``: the layers the model runs), checked
    against every run layer's router and expert tensors (GGUF shapes: router [n_embd,
    n_expert], gate/up experts [n_embd, n_ff_exp, n_expert], down experts [n_ff_exp, n_embd,
    n_expert])."""
    path, arch = model.paths[0], model.arch
    n_expert = m.int_("expert_count", required=True)
    n_used = m.int_("expert_used_count", required=True)
    if n_expert <= 0:
        raise CarveError(f"{path}: {arch}.expert_count is {n_expert}; a mixture-of-experts "
                         "model needs at least one expert")
    if not 0 < n_used <= n_expert:
        raise CarveError(f"{path}: {arch}.expert_used_count is {n_used} but the file has "
                         f"{n_expert} experts ({arch}.expert_count); it must be 1..{n_expert}")
    lead = m.int_("leading_dense_block_count", 0) if arch in LEAD_SHARED else 0
    step = m.int_("interleave_moe_layer_step", 1)
    if step != 1:  # ERNIE-4.5's published files route every layer after the dense ones
        raise CarveError(f"{path}: {arch}.interleave_moe_layer_step is {step}; Carve runs models "
                         "whose every layer after the leading dense ones routes through experts")
    if not 0 <= lead < n_run:
        raise CarveError(f"{path}: {arch}.leading_dense_block_count {lead} leaves no expert "
                         f"layer of {n_run}")
    shapes = tensor_shapes(model)
    gate0 = shapes.get(f"blk.{lead}.ffn_gate_exps.weight")
    n_ff_exp = m.int_("expert_feed_forward_length", gate0[1] if gate0 and len(gate0) == 3 else 0)
    n_shared = m.int_("expert_shared_count", 0) if arch in LEAD_SHARED else 0
    within(model, "expert_shared_count", n_shared, n_shared >= 0, "a count")
    shexp = shapes.get(f"blk.{lead}.ffn_gate_shexp.weight")
    n_ff_shexp = shexp[1] if n_shared and shexp and len(shexp) == 2 else 0
    if n_shared and not n_ff_shexp:
        raise CarveError(f"{path}: tensor blk.{lead}.ffn_gate_shexp.weight is missing; "
                         f"{arch}.expert_shared_count says {n_shared} shared experts")
    if f"{arch}.expert_feed_forward_length" in m.md:
        within(model, "expert_feed_forward_length", n_ff_exp, n_ff_exp > 0, "a width above 0")
    if n_ff_exp <= 0:
        raise CarveError(f"{path}: tensor blk.{lead}.ffn_gate_exps.weight is missing and "
                         f"{arch}.expert_feed_forward_length is not set; not a complete model")
    for i in range(lead, n_run):
        p = f"blk.{i}."
        router = shapes.get(p + "ffn_gate_inp.weight")
        if router is None:
            raise CarveError(f"{path}: tensor {p}ffn_gate_inp.weight (the expert router of "
                             f"layer {i}) is missing; the file is incomplete")
        want = {
            p + "ffn_gate_inp.weight": (n_embd, n_expert),
            p + "ffn_gate_exps.weight": (n_embd, n_ff_exp, n_expert),
            p + "ffn_up_exps.weight": (n_embd, n_ff_exp, n_expert),
            p + "ffn_down_exps.weight": (n_ff_exp, n_embd, n_expert),
        }
        for vec in ("exp_probs_b.bias", "ffn_gate_inp.bias"):  # where the file has them
            if p + vec in shapes:  # the selection bias (glm4moe, DeepSeek-V3), gpt-oss's router's
                want[p + vec] = (n_expert,)
        if n_shared:
            want[p + "ffn_gate_shexp.weight"] = (n_embd, n_ff_shexp)
            want[p + "ffn_up_shexp.weight"] = (n_embd, n_ff_shexp)
            want[p + "ffn_down_shexp.weight"] = (n_ff_shexp, n_embd)
        for name, shape in want.items():
            got = shapes.get(name)
            if got is None and "_exps." in name and name.replace("_exps.", ".0.") in shapes:
                raise CarveError(f"{path}: layer {i} stores each expert as a tensor of its own "
                                 f"({name.replace('_exps.', '.0.')}...), as converters did "
                                 "before 2024; Carve reads the experts stacked in one tensor "
                                 f"({name}): re-convert the model with a current llama.cpp")
            if got is None:
                raise CarveError(f"{path}: tensor {name} is missing; layer {i} routes through "
                                 "experts and needs it")
            if got != shape:
                if len(got) == len(shape) and got[-1] != shape[-1] and "exps" in name:
                    raise CarveError(f"{path}: tensor {name} holds {got[-1]} experts but "
                                     f"{arch}.expert_count says {n_expert}; the file is "
                                     "inconsistent")
                raise CarveError(f"{path}: tensor {name} has shape {list(got)} but the "
                                 f"metadata implies {list(shape)}; the file is inconsistent")
    if arch == "gpt-oss":
        gating = "softmax_topk"
    else:
        code = m.int_("expert_gating_func", 0)
        if code and code not in _GATING:
            raise CarveError(f"{path}: {arch}.expert_gating_func {code} is not one the engine "
                             f"runs ({', '.join(f'{k} = {v}' for k, v in _GATING.items())})")
        default = _GATING_DEFAULT[arch]
        if arch == "deepseek2" and not code and m.int_("block_count") in (47, 48) and (
                shapes.get("token_embd.weight", (0, 0))[1] == 154880):
            default = "sigmoid"  # GLM-4.7 Lite's files, as llama.cpp tells them apart
        gating = _GATING.get(code, default)
    # qwen3moe, Mixtral (llama) and minimax-m2 renormalise their top-k weights whatever the
    # file says (llama.cpp's graphs do)
    norm = True if arch in ("qwen3moe", "llama", "minimax-m2", "ernie4_5-moe") else (
        arch in LEAD_SHARED and bool(m.md.get(f"{arch}.expert_weights_norm", False)))
    # (ernie4_5-moe: llama.cpp's graph never scales its weights)
    weights_scale = (m.float_("expert_weights_scale", 1.0)
                     if arch in (*LEAD_SHARED, "minimax-m2") and arch != "ernie4_5-moe" else 1.0)
    within(model, "expert_weights_scale", weights_scale, weights_scale > 0, "above 0")
    groups, groups_used = (read_groups(m, n_expert, n_used) if arch == "deepseek2"
                           else (0, 0))
    return dict(
        n_expert_groups=groups, n_group_used=groups_used,
        n_expert=n_expert, n_expert_used=n_used, n_ff_exp=n_ff_exp, n_expert_shared=n_shared,
        n_ff_shexp=n_ff_shexp, n_layer_dense_lead=lead, expert_gating=gating,
        expert_weights_norm=norm,
        expert_weights_scale=weights_scale,
        n_layer_run=n_run,
    )


def read_mla(model: GGUFModel, m: Meta) -> dict[str, Any]:
    """deepseek2's latent-attention fields, and which of the converter's two layouts the file
    has: attn_k_b / attn_v_b per head (llama.cpp since 2025) or one attn_kv_b (before)."""
    path = model.paths[0]
    kv_lora = m.int_("attention.kv_lora_rank", required=True)
    q_lora = m.int_("attention.q_lora_rank", 0)
    for key, v in (("attention.kv_lora_rank", kv_lora), ("attention.q_lora_rank", q_lora)):
        if v < 0 or (key == "attention.kv_lora_rank" and v == 0):
            raise CarveError(f"{path}: {m.arch}.{key} is {v}; it must be a rank above 0")
    names = {t.name for t in model.tensors}
    split = "blk.0.attn_k_b.weight" in names
    if not split and "blk.0.attn_kv_b.weight" not in names:
        raise CarveError(f"{path}: tensor blk.0.attn_k_b.weight is missing (nor is there a "
                         "blk.0.attn_kv_b.weight); the file's latent attention is incomplete")
    if split and f"{m.arch}.attention.key_length_mla" not in m.md:
        raise CarveError(f"{path}: metadata key {m.arch}.attention.key_length_mla is missing; "
                         "a file with attn_k_b tensors needs it (re-convert the model)")
    temp = m.float_("attention.temperature_scale", 0.0)
    length = m.int_("attention.temperature_length", 0) if temp else 0
    within(model, "attention.temperature_scale", temp, temp >= 0, "at least 0 (or absent)")
    if temp and length <= 0:
        raise CarveError(f"{path}: {m.arch}.attention.temperature_scale is set but "
                         f"{m.arch}.attention.temperature_length is {length}; the attention "
                         "temperature needs a length above 0 (re-convert the model)")
    return dict(kv_lora_rank=kv_lora, q_lora_rank=q_lora, mla_legacy=not split,
                attn_temp_scale=temp, attn_temp_length=length)


def mla_shapes(m: Meta, mla: dict[str, Any], n_embd: int, n_head: int, head_dim: int,
                head_dim_v: int) -> dict[str, tuple[int, ...]]:
    """Layer 0's latent-attention tensors as the metadata implies them (GGUF dims)."""
    kv_lora, q_lora = mla["kv_lora_rank"], mla["q_lora_rank"]
    rope = m.int_("rope.dimension_count", 0)
    nope = head_dim - rope
    if rope <= 0 or nope <= 0 or rope % 2 or head_dim_v <= 0:
        raise CarveError(f"{m.path}: {m.arch} heads of {head_dim} key dims ({rope} rotated, "
                         f"{m.arch}.rope.dimension_count) and {head_dim_v} value dims are not a "
                         "latent-attention shape; the file is inconsistent")
    out = {"blk.0.attn_kv_a_mqa.weight": (n_embd, kv_lora + rope),
           "blk.0.attn_kv_a_norm.weight": (kv_lora,)}
    if q_lora:
        out["blk.0.attn_q_a.weight"] = (n_embd, q_lora)
        out["blk.0.attn_q_a_norm.weight"] = (q_lora,)
        out["blk.0.attn_q_b.weight"] = (q_lora, n_head * head_dim)
    else:
        out["blk.0.attn_q.weight"] = (n_embd, n_head * head_dim)
    if mla["mla_legacy"]:
        out["blk.0.attn_kv_b.weight"] = (kv_lora, n_head * (nope + head_dim_v))
    else:
        out["blk.0.attn_k_b.weight"] = (nope, kv_lora, n_head)
        out["blk.0.attn_v_b.weight"] = (kv_lora, head_dim_v, n_head)
    return out


def read_groups(m: Meta, n_expert: int, n_used: int) -> tuple[int, int]:
    """(expert groups, groups each token may use) where the file limits routing to groups,
    else (0, 0)."""
    groups = m.int_("expert_group_count", 0)
    used = m.int_("expert_group_used_count", 0)
    if groups <= 1:
        return 0, 0
    if n_expert % groups or not 0 < used <= groups or n_used > used * (n_expert // groups):
        raise CarveError(f"{m.path}: {m.arch}.expert_group_count {groups} with "
                         f"expert_group_used_count {used} cannot route {n_used} of {n_expert} "
                         "experts (the groups must divide the experts and hold the chosen ones)")
    return (0, 0) if used == groups else (groups, used)

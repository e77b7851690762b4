"""Tiny random models: the mixture-of-experts families (qwen3moe, gpt-oss, glm4moe, Mixtral,
DeepSeek-V2 and -V3, MiniMax-M2, dots.llm1, ERNIE-4.5 MoE) and a dense llama-3.1 (its RoPE
factors): a transformers model built from a config, and the same weights written to a GGUF with
llama.cpp's tensor names, metadata keys and (llama files) q/k row order.

DeepSeek ("deepseek2": V2-Lite's shape, "deepseek3": V3's; GGUF arch deepseek2 for both) is
written as llama.cpp's convert_hf_to_gguf.py DeepseekV2Model does, in either of its layouts:
"mla" (the converter since April 2025: kv_b_proj split per head into attn_k_b, transposed, and
attn_v_b; one KV head of kv_lora + rope) or "legacy" (before: one attn_kv_b, n_head KV heads).

MiniMax-M2 ("minimax-m2") is written as the converter's MiniMaxM2Model over the generic TextModel:
q/k RMSNorms over the whole projected q and k (attn_q_norm [n_head * head_dim], attn_k_norm
[n_kv * head_dim]), RoPE on the first rotary_dim of each head's dims, halves rotated (neox: no
q/k row permutation), sigmoid routing with a selection bias (exp_probs_b), renormalised top-k.

dots.llm1 ("dots1") is written as the converter's Dots1Model (over Qwen2MoeModel): qwen3's
attention (per-head attn_q_norm / attn_k_norm, no biases, RoPE on whole heads by halves: no q/k
row permutation), the first first_k_dense_replace layers a dense FFN, the rest MoE with a router,
a selection bias (exp_probs_b), stacked experts and shared experts (ffn_*_shexp, as one MLP of
n_shared_experts * moe_intermediate_size); sigmoid routing, the chosen weights normalised and
scaled by routed_scaling_factor.

ERNIE-4.5 MoE ("ernie4_5-moe") is written as the converter's Ernie4_5MoeModel (over
Ernie4_5Model and TextModel): llama-style attention (no biases, no q/k norms; RoPE on whole heads
by adjacent pairs, llama.cpp's "normal" rope, which transformers' interleaved rotate_half is:
no q/k row permutation), the first moe_layer_start_index layers a dense FFN, the rest MoE with a
router, a selection bias (moe_statics.e_score_correction_bias, [1, n_expert] in transformers,
exp_probs_b [n_expert] in the file), stacked experts and shared experts (ffn_*_shexp, one MLP of
moe_num_shared_experts * moe_intermediate_size); softmax routing, the bias only for the choice,
the chosen softmax values normalised, no scale.

Quantized files round-trip the weights through ``gguf.quants`` and load the dequantized values
back into the transformers model, so the reference runs exactly the weights the file holds.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from engine.gguf.writer import ARR, BOOL, F32, I32, STR, U32, GGUFSink, MetaItem
from engine.synth.contents import CHATML, llama3_factors, vocab

N_VOCAB = 512  # the synthetic byte-level vocabulary needs ~300 tokens
COMMON = dict(vocab_size=N_VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, max_position_embeddings=4096, rms_norm_eps=1e-6,
              tie_word_embeddings=False)
GGUF_ARCH = {"qwen3moe": "qwen3moe", "gpt-oss": "gpt-oss", "glm4moe": "glm4moe", "mixtral": "llama",
             "llama3": "llama", "phi3": "phi3", "deepseek2": "deepseek2", "deepseek3": "deepseek2",
             "minimax-m2": "minimax-m2", "dots1": "dots1", "ernie4_5-moe": "ernie4_5-moe"}
DEEPSEEK_ARCHS = ("deepseek2", "deepseek3")
LAYOUTS = ("mla", "legacy")  # deepseek2 files: the converter's current layout, and its old one
LLAMA_ARCHS = ("mixtral", "llama3")  # llama files: q/k rows permuted, llama.* keys
# phi3: LongRoPE over an original context of 32 (heads of 16, 12 dims rotated: 6 pairs)
PHI3_ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
             "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
             "long_factor": [1.5, 2.5, 4.0, 6.0, 9.0, 13.0]}
# llama3: llama-3.1's RoPE over an original context of 64 (so that, with a base of 10,000 and
# heads of 32, 2 pairs keep their frequency, 11 are divided by 8 and 3 lie between)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
# DeepSeek: multi-head latent attention (every quantized row a multiple of 32 long: attn_k_b's rows
# are qk_nope_head_dim, attn_v_b's kv_lora_rank), 3 layers (the first dense), 8 routed experts
DEEPSEEK_COMMON = dict(vocab_size=N_VOCAB, hidden_size=64, num_attention_heads=4,
                       num_key_value_heads=4, max_position_embeddings=256, rms_norm_eps=1e-6,
                       tie_word_embeddings=False, num_hidden_layers=3, intermediate_size=96,
                       moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                       first_k_dense_replace=1, kv_lora_rank=64, qk_nope_head_dim=32,
                       qk_rope_head_dim=16, v_head_dim=32)
# YaRN over an original context of 64, factor 4 (V3: mscale = mscale_all_dim = 1; V2-Lite: 0.707)
DEEPSEEK3_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                  "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                  "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK2_ROPE = {**DEEPSEEK3_ROPE, "mscale": 0.707, "mscale_all_dim": 0.707}
# MiniMax-M2: partial RoPE as the released config.json says it (rotary_dim, which the converter
# writes as rope.dimension_count; transformers turns it into partial_rotary_factor 16 / 32)
MINIMAX_ROTARY_DIM = 16
# config.json's scoring_func (transformers' configs have no such field): the gating function
DEEPSEEK_SCORING = {"deepseek2": "softmax", "deepseek3": "sigmoid"}


def permute(w: np.ndarray, n_head: int, back: bool = False) -> np.ndarray:
    """llama's q/k rows as the converter writes them: transformers rotates the halves of a head,
    llama.cpp's llama graph adjacent pairs, so each head's rows are interleaved (``back``: the
    inverse)."""
    half = w.shape[0] // n_head // 2
    if back:
        return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_model(arch: str, seed: int = 0) -> torch.nn.Module:
    """A tiny transformers model of ``arch`` with random weights large enough to route
    decisively (norm weights around 1, biases and sinks of order 1)."""
    import transformers as tf

    if arch == "qwen3moe":
        cfg = tf.Qwen3MoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=96,
                                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                                norm_topk_prob=True, rope_theta=1e6)
        cls = tf.Qwen3MoeForCausalLM
    elif arch == "gpt-oss":
        cfg = tf.GptOssConfig(**COMMON, num_hidden_layers=2, intermediate_size=32,
                              num_local_experts=8, num_experts_per_tok=2, sliding_window=16)
        cls = tf.GptOssForCausalLM
    elif arch == "llama3":  # dense
        cfg = tf.LlamaConfig(**COMMON, num_hidden_layers=2, intermediate_size=96,
                             rope_parameters=dict(LLAMA3_ROPE))
        cls = tf.LlamaForCausalLM
    elif arch == "phi3":  # dense, fused q/k/v and gate/up, LongRoPE on 3/4 of each head
        cfg = tf.Phi3Config(**{k: v for k, v in COMMON.items()
                               if k not in ("head_dim", "max_position_embeddings")},
                            num_hidden_layers=2, intermediate_size=96, pad_token_id=0,
                            max_position_embeddings=256, original_max_position_embeddings=32,
                            partial_rotary_factor=0.75, rope_parameters=dict(PHI3_ROPE))
        cls = tf.Phi3ForCausalLM
    elif arch == "mixtral":
        cfg = tf.MixtralConfig(**COMMON, num_hidden_layers=2, intermediate_size=32,
                               num_local_experts=8, num_experts_per_tok=2)
        cls = tf.MixtralForCausalLM
    elif arch == "deepseek3":  # q through a low-rank q_a/q_b, sigmoid + bias, group-limited top-k
        cfg = tf.DeepseekV3Config(**DEEPSEEK_COMMON, q_lora_rank=64, n_shared_experts=1, n_group=4,
                                  topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
                                  rope_interleave=True, num_mtp_layers=0,
                                  rope_parameters=dict(DEEPSEEK3_ROPE))
        cls = tf.DeepseekV3ForCausalLM
    elif arch == "deepseek2":  # V2-Lite: plain q_proj, softmax greedy top-k, 2 shared experts
        cfg = tf.DeepseekV2Config(**DEEPSEEK_COMMON, q_lora_rank=None, n_shared_experts=2,
                                  n_group=1, topk_group=1, topk_method="greedy",
                                  norm_topk_prob=False, routed_scaling_factor=1.0,
                                  rope_parameters=dict(DEEPSEEK2_ROPE))
        cls = tf.DeepseekV2ForCausalLM
    elif arch == "minimax-m2":  # whole-vector q/k norms, partial RoPE, sigmoid + selection bias
        cfg = tf.MiniMaxM2Config(**COMMON, num_hidden_layers=2, intermediate_size=32,
                                 num_local_experts=8, num_experts_per_tok=2,
                                 rotary_dim=MINIMAX_ROTARY_DIM,
                                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                                 bos_token_id=N_VOCAB - 3, eos_token_id=N_VOCAB - 1)
        cls = tf.MiniMaxM2ForCausalLM
    elif arch == "dots1":  # qwen3's attention, a dense first layer, sigmoid MoE + shared expert
        cfg = tf.Dots1Config(**COMMON, num_hidden_layers=3, intermediate_size=96,
                             moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
                             n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                             topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                             sliding_window=None,
                             rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                             bos_token_id=N_VOCAB - 3, eos_token_id=N_VOCAB - 1)
        cls = tf.Dots1ForCausalLM
    elif arch == "ernie4_5-moe":  # a dense first layer, softmax MoE + selection bias + shared
        cfg = tf.Ernie4_5_MoeConfig(**COMMON, num_hidden_layers=3, intermediate_size=96,
                                    moe_intermediate_size=32, moe_num_experts=8, moe_k=2,
                                    moe_num_shared_experts=1, moe_layer_start_index=1,
                                    moe_layer_interval=1, use_bias=False,
                                    rope_parameters={"rope_type": "default",
                                                     "rope_theta": 10000.0},
                                    bos_token_id=N_VOCAB - 3, eos_token_id=N_VOCAB - 1)
        cls = tf.Ernie4_5_MoeForCausalLM
    elif arch == "glm4moe":
        cfg = tf.Glm4MoeConfig(**COMMON, num_hidden_layers=3, intermediate_size=96,
                               moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
                               num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                               topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                               attention_bias=True, use_qk_norm=False,
                               partial_rotary_factor=0.5, num_nextn_predict_layers=1)
        cls = tf.Glm4MoeForCausalLM
    else:
        raise ValueError(arch)
    cfg._attn_implementation = "eager"  # gpt-oss's sinks run in its eager attention
    torch.manual_seed(seed)
    m = cls(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.1 * r)
            elif arch == "ernie4_5-moe" and name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * r)  # a parameter here; softmax scores of 8 experts ~ 0.125
            elif p.ndim == 1 or name.endswith("_bias"):  # biases, sinks
                p.copy_(0.5 * r)
            elif arch == "llama3" and ("q_proj" in name or "k_proj" in name):
                p.copy_(0.3 * r)  # peaked attention: a wrong rotation shows in the logits
            elif arch in DEEPSEEK_ARCHS and any(
                    k in name for k in ("q_proj", "q_b_proj", "kv_a_proj_with_mqa")):
                p.copy_(0.3 * r)  # likewise (kv_a's rows past kv_lora are the shared rope key)
            else:
                p.copy_(0.08 * r)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                # sigmoid scores lie in (0, 1)
                scale = 0.1 if arch in ("deepseek3", "minimax-m2", "dots1") else 0.5
                b.copy_(scale * torch.randn(b.shape, generator=g))
    return m


def _gguf_tensors(arch: str, m: torch.nn.Module, layout: str = "mla") -> dict[str, np.ndarray]:
    """GGUF name -> float32 array in torch order ([rows, cols], experts [E, rows, cols])."""
    sd = {k: v.detach().float().numpy() for k, v in m.state_dict().items()}
    cfg = m.config
    if arch == "phi3":
        return _phi3_tensors(sd, cfg)
    if arch in DEEPSEEK_ARCHS:
        return _deepseek2_tensors(sd, cfg, layout)
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "output_norm.weight": sd["model.norm.weight"], "output.weight": sd["lm_head.weight"]}
    ffn_norm = ("ffn_norm" if arch in ("qwen3moe", "minimax-m2", "dots1", "ernie4_5-moe",
                                       *LLAMA_ARCHS)
                else "post_attention_norm")
    if arch == "llama3":  # the converter's factors (engine.synth.contents.llama3_factors)
        r = LLAMA3_ROPE
        out["rope_freqs.weight"] = np.asarray(llama3_factors(
            cfg.head_dim, r["rope_theta"], r["factor"], r["low_freq_factor"],
            r["high_freq_factor"], r["original_max_position_embeddings"]), np.float32)
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[h + "input_layernorm.weight"]
        out[b + ffn_norm + ".weight"] = sd[h + "post_attention_layernorm.weight"]
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            for kind in ("weight", "bias"):
                key = f"{h}self_attn.{theirs}_proj.{kind}"
                if key in sd:
                    out[f"{b}attn_{ours}.{kind}"] = sd[key]
        if arch in LLAMA_ARCHS:
            out[b + "attn_q.weight"] = permute(out[b + "attn_q.weight"], cfg.num_attention_heads)
            out[b + "attn_k.weight"] = permute(out[b + "attn_k.weight"], cfg.num_key_value_heads)
        for n in ("q", "k"):
            if f"{h}self_attn.{n}_norm.weight" in sd:
                out[f"{b}attn_{n}_norm.weight"] = sd[f"{h}self_attn.{n}_norm.weight"]
        if h + "self_attn.sinks" in sd:
            out[b + "attn_sinks.weight"] = sd[h + "self_attn.sinks"]
        if h + "mlp.gate_proj.weight" in sd:  # a dense layer
            for n in ("gate", "up", "down"):
                out[f"{b}ffn_{n}.weight"] = sd[f"{h}mlp.{n}_proj.weight"]
            continue
        if arch == "gpt-oss":
            gu, gub = sd[h + "mlp.experts.gate_up_proj"], sd[h + "mlp.experts.gate_up_proj_bias"]
            # [E, n_embd, 2 n_ff] with gate and up interleaved along the last axis
            out[b + "ffn_gate_exps.weight"] = gu[..., ::2].transpose(0, 2, 1).copy()
            out[b + "ffn_up_exps.weight"] = gu[..., 1::2].transpose(0, 2, 1).copy()
            out[b + "ffn_down_exps.weight"] = sd[h + "mlp.experts.down_proj"].transpose(0, 2, 1).copy()
            out[b + "ffn_gate_exps.bias"] = gub[..., ::2].copy()
            out[b + "ffn_up_exps.bias"] = gub[..., 1::2].copy()
            out[b + "ffn_down_exps.bias"] = sd[h + "mlp.experts.down_proj_bias"]
            out[b + "ffn_gate_inp.weight"] = sd[h + "mlp.router.weight"]
            out[b + "ffn_gate_inp.bias"] = sd[h + "mlp.router.bias"]
            continue
        gu = sd[h + "mlp.experts.gate_up_proj"]  # [E, 2 n_ff, n_embd]: gate rows, then up
        half = gu.shape[1] // 2
        out[b + "ffn_gate_exps.weight"] = gu[:, :half].copy()
        out[b + "ffn_up_exps.weight"] = gu[:, half:].copy()
        out[b + "ffn_down_exps.weight"] = sd[h + "mlp.experts.down_proj"]
        out[b + "ffn_gate_inp.weight"] = sd[h + "mlp.gate.weight"]
        for key in ("mlp.gate.e_score_correction_bias", "mlp.e_score_correction_bias",  # minimax
                    "mlp.gate.moe_statics.e_score_correction_bias"):  # ernie: [1, n_expert]
            if h + key in sd:
                out[b + "exp_probs_b.bias"] = sd[h + key].reshape(-1)
        for n in ("gate", "up", "down"):
            key = f"{h}mlp.shared_experts.{n}_proj.weight"
            if key in sd:
                out[f"{b}ffn_{n}_shexp.weight"] = sd[key]
    return out


def _phi3_tensors(sd: dict[str, np.ndarray], cfg) -> dict[str, np.ndarray]:
    # phi3's converter keeps the fused matrices: qkv_proj -> attn_qkv, gate_up_proj -> ffn_up
    out = {"token_embd.weight": sd["model.embed_tokens.weight"],
           "rope_factors_long.weight": np.asarray(PHI3_ROPE["long_factor"], np.float32),
           "rope_factors_short.weight": np.asarray(PHI3_ROPE["short_factor"], np.float32)}
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        out[b + "attn_norm.weight"] = sd[h + "input_layernorm.weight"]
        out[b + "attn_qkv.weight"] = sd[h + "self_attn.qkv_proj.weight"]
        out[b + "attn_output.weight"] = sd[h + "self_attn.o_proj.weight"]
        out[b + "ffn_norm.weight"] = sd[h + "post_attention_layernorm.weight"]
        out[b + "ffn_up.weight"] = sd[h + "mlp.gate_up_proj.weight"]
        out[b + "ffn_down.weight"] = sd[h + "mlp.down_proj.weight"]
    out["output_norm.weight"] = sd["model.norm.weight"]
    out["output.weight"] = sd["lm_head.weight"]
    return out


def split_kv_b(kv_b: np.ndarray, n_head: int, nope: int) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj.weight [n_head (nope + v), kv_lora] as the "mla" converter splits it: (k_b
    [n_head, kv_lora, nope] (each head's block transposed), v_b [n_head, v, kv_lora])."""
    kv = kv_b.reshape(n_head, -1, kv_b.shape[-1])
    return kv[:, :nope].transpose(0, 2, 1).copy(), kv[:, nope:].copy()


def join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """The inverse of ``split_kv_b``: kv_b_proj.weight [n_head (nope + v), kv_lora]."""
    kv = np.concatenate((k_b.transpose(0, 2, 1), v_b), axis=1)
    return kv.reshape(-1, kv.shape[-1])


def _deepseek2_tensors(sd: dict[str, np.ndarray], cfg, layout: str) -> dict[str, np.ndarray]:
    """As the converter's DeepseekV2Model writes them: no q/k row permutation (DeepSeek's rotary
    dims already lie in adjacent pairs, which llama.cpp's NORM rope rotates)."""
    out = {"token_embd.weight": sd["model.embed_tokens.weight"]}
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        a = h + "self_attn."
        out[b + "attn_norm.weight"] = sd[h + "input_layernorm.weight"]
        if cfg.q_lora_rank is None:
            out[b + "attn_q.weight"] = sd[a + "q_proj.weight"]
        else:
            out[b + "attn_q_a.weight"] = sd[a + "q_a_proj.weight"]
            out[b + "attn_q_a_norm.weight"] = sd[a + "q_a_layernorm.weight"]
            out[b + "attn_q_b.weight"] = sd[a + "q_b_proj.weight"]
        out[b + "attn_kv_a_mqa.weight"] = sd[a + "kv_a_proj_with_mqa.weight"]
        out[b + "attn_kv_a_norm.weight"] = sd[a + "kv_a_layernorm.weight"]
        if layout == "legacy":
            out[b + "attn_kv_b.weight"] = sd[a + "kv_b_proj.weight"]
        else:
            out[b + "attn_k_b.weight"], out[b + "attn_v_b.weight"] = split_kv_b(
                sd[a + "kv_b_proj.weight"], cfg.num_attention_heads, cfg.qk_nope_head_dim)
        out[b + "attn_output.weight"] = sd[a + "o_proj.weight"]
        out[b + "ffn_norm.weight"] = sd[h + "post_attention_layernorm.weight"]
        if h + "mlp.gate_proj.weight" in sd:  # a dense layer
            for n in ("gate", "up", "down"):
                out[f"{b}ffn_{n}.weight"] = sd[f"{h}mlp.{n}_proj.weight"]
            continue
        out[b + "ffn_gate_inp.weight"] = sd[h + "mlp.gate.weight"]
        if h + "mlp.gate.e_score_correction_bias" in sd:
            out[b + "exp_probs_b.bias"] = sd[h + "mlp.gate.e_score_correction_bias"]
        gu = sd[h + "mlp.experts.gate_up_proj"]  # [E, 2 n_ff, n_embd]: gate rows, then up
        half = gu.shape[1] // 2
        out[b + "ffn_gate_exps.weight"] = gu[:, :half].copy()
        out[b + "ffn_up_exps.weight"] = gu[:, half:].copy()
        out[b + "ffn_down_exps.weight"] = sd[h + "mlp.experts.down_proj"]
        for n in ("gate", "up", "down"):
            out[f"{b}ffn_{n}_shexp.weight"] = sd[f"{h}mlp.shared_experts.{n}_proj.weight"]
    out["output_norm.weight"] = sd["model.norm.weight"]
    out["output.weight"] = sd["lm_head.weight"]
    return out


def _deepseek2_metadata(arch: str, c, layout: str) -> list[MetaItem]:
    """The converter's keys, in its order: TextModel's generic ones (num_key_value_heads forced
    to 1 by the "mla" converter; the YaRN keys present in the rope parameters; the group counts
    and the gating function whenever config.json has n_group / scoring_func), then
    DeepseekV2Model's (expert_weights_norm only when true, as the converter writes it)."""
    a, rp = "deepseek2", c.rope_parameters
    nope, rope, v = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    mla = layout == "mla"
    meta: list[MetaItem] = [
        ("general.architecture", STR, a),
        (f"{a}.block_count", U32, c.num_hidden_layers),
        (f"{a}.context_length", U32, c.max_position_embeddings),
        (f"{a}.embedding_length", U32, c.hidden_size),
        (f"{a}.feed_forward_length", U32, c.intermediate_size),
        (f"{a}.attention.head_count", U32, c.num_attention_heads),
        (f"{a}.attention.head_count_kv", U32, 1 if mla else c.num_key_value_heads),
        (f"{a}.rope.scaling.type", STR, "yarn"),
        (f"{a}.rope.scaling.factor", F32, rp["factor"]),
        (f"{a}.rope.scaling.original_context_length", U32, rp["original_max_position_embeddings"]),
    ]
    for k in ("beta_fast", "beta_slow"):
        if rp.get(k) is not None:
            meta.append((f"{a}.rope.scaling.yarn_{k}", F32, float(rp[k])))
    meta += [(f"{a}.rope.freq_base", F32, float(rp["rope_theta"])),
             (f"{a}.attention.layer_norm_rms_epsilon", F32, c.rms_norm_eps),
             (f"{a}.expert_used_count", U32, c.num_experts_per_tok)]
    if c.n_group is not None:
        meta += [(f"{a}.expert_group_count", U32, c.n_group),
                 (f"{a}.expert_group_used_count", U32, c.topk_group)]
    meta += [(f"{a}.expert_gating_func", U32, {"softmax": 1, "sigmoid": 2}[DEEPSEEK_SCORING[arch]]),
             (f"{a}.leading_dense_block_count", U32, c.first_k_dense_replace),
             (f"{a}.vocab_size", U32, c.vocab_size)]
    if c.q_lora_rank is not None:
        meta.append((f"{a}.attention.q_lora_rank", U32, c.q_lora_rank))
    meta.append((f"{a}.attention.kv_lora_rank", U32, c.kv_lora_rank))
    if mla:  # MQA over the latent: one KV head of kv_lora + rope, decompressed per head
        meta += [(f"{a}.attention.key_length", U32, c.kv_lora_rank + rope),
                 (f"{a}.attention.value_length", U32, c.kv_lora_rank),
                 (f"{a}.attention.key_length_mla", U32, nope + rope),
                 (f"{a}.attention.value_length_mla", U32, v)]
    else:
        meta += [(f"{a}.attention.key_length", U32, nope + rope),
                 (f"{a}.attention.value_length", U32, v)]
    meta += [(f"{a}.expert_feed_forward_length", U32, c.moe_intermediate_size),
             (f"{a}.expert_count", U32, c.n_routed_experts),
             (f"{a}.expert_shared_count", U32, c.n_shared_experts),
             (f"{a}.expert_weights_scale", F32, float(c.routed_scaling_factor))]
    if c.norm_topk_prob:
        meta.append((f"{a}.expert_weights_norm", BOOL, True))
    meta.append((f"{a}.rope.dimension_count", U32, rope))
    if rp.get("mscale_all_dim") is not None:  # the converter's 0.1 * mscale_all_dim
        meta.append((f"{a}.rope.scaling.yarn_log_multiplier", F32, 0.1 * rp["mscale_all_dim"]))
    return meta


def _text_model_keys(a: str, c, n_expert: int) -> list[MetaItem]:
    """The converter's generic TextModel keys, in its order, up to the expert counts."""
    return [
        ("general.architecture", STR, a),
        (f"{a}.block_count", U32, c.num_hidden_layers),
        (f"{a}.context_length", U32, c.max_position_embeddings),
        (f"{a}.embedding_length", U32, c.hidden_size),
        (f"{a}.feed_forward_length", U32, c.intermediate_size),
        (f"{a}.attention.head_count", U32, c.num_attention_heads),
        (f"{a}.attention.head_count_kv", U32, c.num_key_value_heads),
        (f"{a}.rope.freq_base", F32, float(c.rope_parameters["rope_theta"])),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, c.rms_norm_eps),
        (f"{a}.expert_count", U32, n_expert),
        (f"{a}.expert_used_count", U32, c.num_experts_per_tok),
    ]


def _minimax_m2_metadata(c) -> list[MetaItem]:
    """The converter's keys, in its order: TextModel's generic ones (no rope scaling keys for a
    "default" rope; the gating function from config.json's scoring_func "sigmoid"), then
    MiniMaxM2Model's expert_feed_forward_length (intermediate_size: every layer is MoE) and
    rope.dimension_count (rotary_dim). vocab_size, which MiniMaxM2Model itself does not write, is
    added last (llama.cpp reads it when present)."""
    a = "minimax-m2"
    return _text_model_keys(a, c, c.num_local_experts) + [
        (f"{a}.expert_gating_func", U32, 2),  # sigmoid
        (f"{a}.attention.key_length", U32, c.head_dim),
        (f"{a}.attention.value_length", U32, c.head_dim),
        (f"{a}.expert_feed_forward_length", U32, c.intermediate_size),
        (f"{a}.rope.dimension_count", U32, c.rotary_dim),
        (f"{a}.vocab_size", U32, c.vocab_size),  # as the deepseek2 files have it (optional)
    ]


def _dots1_metadata(c) -> list[MetaItem]:
    """The converter's keys, in its order: TextModel's generic ones (no rope scaling keys for a
    "default" rope; key/value lengths from head_dim), Qwen2MoeModel's
    expert_feed_forward_length, then Dots1Model's, the gating function last as the converter
    that wrote the published files does (sigmoid, for config.json's scoring_func "noaux_tc";
    it wrote no expert group counts). vocab_size, which Dots1Model does not write, is added last
    (llama.cpp reads it when present)."""
    a = "dots1"
    return _text_model_keys(a, c, c.n_routed_experts) + [
        (f"{a}.attention.key_length", U32, c.head_dim),
        (f"{a}.attention.value_length", U32, c.head_dim),
        (f"{a}.expert_feed_forward_length", U32, c.moe_intermediate_size),
        (f"{a}.leading_dense_block_count", U32, c.first_k_dense_replace),
        (f"{a}.expert_shared_count", U32, c.n_shared_experts),
        (f"{a}.expert_weights_scale", F32, float(c.routed_scaling_factor)),
        (f"{a}.expert_weights_norm", BOOL, bool(c.norm_topk_prob)),
        (f"{a}.expert_gating_func", U32, 2),  # sigmoid
        (f"{a}.vocab_size", U32, c.vocab_size),
    ]


def _ernie4_5_moe_metadata(c) -> list[MetaItem]:
    """The converter's keys, in its order: TextModel's generic ones up to the norm epsilon (it
    finds no expert counts under config.json's moe_* names), key/value lengths from head_dim,
    then Ernie4_5MoeModel's. The shared experts' width: the converter writes intermediate_size //
    num_key_value_heads, which is moe_num_shared_experts * moe_intermediate_size in the published
    models (21B: 12288 // 4 = 2 * 1536) but not in this tiny one (96 // 2 = 48); llama.cpp
    sizes ffn_*_shexp by this key, so the file holds the real width (32)."""
    a = "ernie4_5-moe"
    return _text_model_keys(a, c, c.moe_num_experts)[:9] + [
        (f"{a}.attention.key_length", U32, c.head_dim),
        (f"{a}.attention.value_length", U32, c.head_dim),
        (f"{a}.expert_count", U32, c.moe_num_experts),
        (f"{a}.expert_used_count", U32, c.moe_k),
        (f"{a}.interleave_moe_layer_step", U32, c.moe_layer_interval),
        (f"{a}.leading_dense_block_count", U32, c.moe_layer_start_index),
        (f"{a}.expert_feed_forward_length", U32, c.moe_intermediate_size),
        (f"{a}.expert_shared_count", U32, c.moe_num_shared_experts),
        (f"{a}.expert_shared_feed_forward_length", U32,
         c.moe_intermediate_size * c.moe_num_shared_experts),
    ]


def _nextn_layer(tensors: dict[str, np.ndarray], n: int, rng: np.random.Generator) -> None:
    """GLM's next-token-prediction block blk.n, as the converter writes it: a full MoE layer plus
    the nextn.* tensors. Random: the model does not run it."""
    for name, a in list(tensors.items()):
        if name.startswith(f"blk.{n - 1}."):
            tensors[name.replace(f"blk.{n - 1}.", f"blk.{n}.")] = rng.standard_normal(
                a.shape).astype(np.float32)
    e = tensors["token_embd.weight"].shape[1]
    tensors[f"blk.{n}.nextn.eh_proj.weight"] = rng.standard_normal((e, 2 * e)).astype(np.float32)
    for k in ("enorm", "hnorm", "shared_head_norm"):
        tensors[f"blk.{n}.nextn.{k}.weight"] = np.ones(e, np.float32)


def _tokenizer_metadata() -> list[MetaItem]:
    tokens, types, merges = vocab(N_VOCAB)
    return [
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "qwen2"),
        ("tokenizer.ggml.tokens", ARR, (STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, (I32, types)),
        ("tokenizer.ggml.merges", ARR, (STR, merges)),
        ("tokenizer.ggml.bos_token_id", U32, N_VOCAB - 3),
        ("tokenizer.ggml.eos_token_id", U32, N_VOCAB - 1),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.chat_template", STR, CHATML),
    ]


def _metadata(arch: str, m: torch.nn.Module, n_block: int, layout: str = "mla") -> list[MetaItem]:
    c, a = m.config, GGUF_ARCH[arch]
    if arch in DEEPSEEK_ARCHS:
        return _deepseek2_metadata(arch, c, layout) + _tokenizer_metadata()
    if arch == "minimax-m2":
        return _minimax_m2_metadata(c) + _tokenizer_metadata()
    if arch == "dots1":
        return _dots1_metadata(c) + _tokenizer_metadata()
    if arch == "ernie4_5-moe":
        return _ernie4_5_moe_metadata(c) + _tokenizer_metadata()
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    meta: list[MetaItem] = [
        ("general.architecture", STR, a),
        (f"{a}.block_count", U32, n_block),
        (f"{a}.context_length", U32, c.max_position_embeddings),
        (f"{a}.embedding_length", U32, c.hidden_size),
        (f"{a}.feed_forward_length", U32, c.intermediate_size),
        (f"{a}.attention.head_count", U32, c.num_attention_heads),
        (f"{a}.attention.head_count_kv", U32, c.num_key_value_heads),
        (f"{a}.attention.key_length", U32, head_dim),
        (f"{a}.attention.value_length", U32, head_dim),
        (f"{a}.rope.freq_base", F32, float(c.rope_parameters["rope_theta"])),
        (f"{a}.attention.layer_norm_rms_epsilon", F32, c.rms_norm_eps),
    ]
    if arch in LLAMA_ARCHS:
        meta.append((f"{a}.rope.dimension_count", U32, c.head_dim))
    if arch == "phi3":  # as the converter writes LongRoPE
        orig = PHI3_ROPE["original_max_position_embeddings"]
        scale = c.max_position_embeddings / orig
        meta += [(f"{a}.rope.dimension_count", U32, int(head_dim * c.partial_rotary_factor)),
                 (f"{a}.rope.scaling.original_context_length", U32, orig),
                 (f"{a}.rope.scaling.attn_factor", F32,
                  math.sqrt(1 + math.log(scale) / math.log(orig)))]
    if arch not in ("llama3", "phi3"):
        meta.append((f"{a}.expert_used_count", U32, c.num_experts_per_tok))
    if arch in ("llama3", "phi3"):  # dense: the factors are tensors, not metadata
        pass
    elif arch == "mixtral":  # the converter writes no expert_feed_forward_length for it
        meta.append((f"{a}.expert_count", U32, c.num_local_experts))
    elif arch == "qwen3moe":
        meta += [(f"{a}.expert_count", U32, c.num_experts),
                 (f"{a}.expert_feed_forward_length", U32, c.moe_intermediate_size)]
    elif arch == "gpt-oss":
        rp = c.rope_parameters
        meta += [(f"{a}.expert_count", U32, c.num_local_experts),
                 (f"{a}.expert_feed_forward_length", U32, c.intermediate_size),
                 (f"{a}.attention.sliding_window", U32, c.sliding_window),
                 (f"{a}.rope.scaling.type", STR, "yarn"),
                 (f"{a}.rope.scaling.factor", F32, rp["factor"]),
                 (f"{a}.rope.scaling.original_context_length", U32,
                  rp["original_max_position_embeddings"])]
    else:
        meta += [(f"{a}.expert_count", U32, c.n_routed_experts),
                 (f"{a}.expert_feed_forward_length", U32, c.moe_intermediate_size),
                 (f"{a}.rope.dimension_count", U32,
                  int(c.head_dim * c.rope_parameters["partial_rotary_factor"])),
                 (f"{a}.expert_shared_count", U32, c.n_shared_experts),
                 (f"{a}.leading_dense_block_count", U32, c.first_k_dense_replace),
                 (f"{a}.expert_gating_func", U32, 2),
                 (f"{a}.expert_weights_scale", F32, c.routed_scaling_factor),
                 (f"{a}.expert_weights_norm", BOOL, c.norm_topk_prob),
                 (f"{a}.nextn_predict_layers", U32, c.num_nextn_predict_layers)]
    return meta + _tokenizer_metadata()


def _type_of(name: str, a: np.ndarray, quant: str) -> Q:
    """The file's type for a tensor: vectors, biases and the router stay F32 (as llama.cpp keeps
    them); with quant "q8_0" every other matrix is Q8_0, gpt-oss's experts MXFP4."""
    if quant == "f32" or a.ndim == 1 or name.endswith(".bias") or "ffn_gate_inp" in name:
        return Q.F32
    if "_exps." in name and quant == "mxfp4":
        return Q.MXFP4
    return Q.Q8_0


def write_pair(arch: str, quant: str, path: Path, seed: int = 0, edit=None,
               layout: str = "mla") -> tuple[torch.nn.Module, Path]:
    """(transformers model, GGUF path) holding the same weights. ``quant``: "f32", "q8_0" or
    "mxfp4" (Q8_0 with MXFP4 experts). ``edit(meta, tensors)`` may break the file (tests).
    ``layout`` (deepseek2/deepseek3 only): "mla" (attn_k_b + attn_v_b) or "legacy" (attn_kv_b)."""
    if layout not in LAYOUTS or (layout != "mla" and arch not in DEEPSEEK_ARCHS):
        raise ValueError(f"layout {layout!r} for {arch}")
    m = hf_model(arch, seed)
    tensors = _gguf_tensors(arch, m, layout)
    n_block = m.config.num_hidden_layers
    if arch == "glm4moe":
        _nextn_layer(tensors, n_block, np.random.default_rng(seed))
        n_block += 1
    meta = _metadata(arch, m, n_block, layout)
    raw: dict[str, bytes] = {}
    table = []
    for name, a in tensors.items():
        t = _type_of(name, a, quant)
        if t == Q.F32:
            data = np.ascontiguousarray(a, np.float32)
        else:
            data = quantize(np.ascontiguousarray(a, np.float32), t)
            tensors[name] = dequantize(data, t).reshape(a.shape)  # what the file holds
        raw[name] = data.tobytes()
        table.append((name, tuple(reversed(a.shape)), int(t)))
    if edit is not None:
        meta, table = edit(meta, table)
    if quant != "f32":
        _load_back(arch, m, tensors)

    def payload(name: str, ggml_type: int, nbytes: int):
        b = raw.get(name, b"")  # a tensor an edit added: zeros
        yield b[:nbytes] + b"\0" * max(0, nbytes - len(b))

    GGUFSink(meta, table, [path]).write(payload)
    return m, path


def _load_back(arch: str, m: torch.nn.Module, tensors: dict[str, np.ndarray]) -> None:
    """Give the transformers model the dequantized weights of the file."""
    if arch in DEEPSEEK_ARCHS:
        _copy_params(m, _deepseek2_back(m.config, tensors))
        return
    back = {}
    back["model.embed_tokens.weight"] = tensors["token_embd.weight"]
    back["lm_head.weight"] = tensors["output.weight"]
    for i in range(m.config.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o")):
            back[f"{h}self_attn.{theirs}_proj.weight"] = tensors[f"{b}attn_{ours}.weight"]
        if arch in LLAMA_ARCHS:
            c = m.config
            for n, heads in (("q", c.num_attention_heads), ("k", c.num_key_value_heads)):
                back[f"{h}self_attn.{n}_proj.weight"] = permute(tensors[f"{b}attn_{n}.weight"],
                                                               heads, back=True)
        if b + "ffn_gate.weight" in tensors:
            for n in ("gate", "up", "down"):
                back[f"{h}mlp.{n}_proj.weight"] = tensors[f"{b}ffn_{n}.weight"]
            continue
        g, u = tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"]
        d = tensors[b + "ffn_down_exps.weight"]
        if arch == "gpt-oss":
            gu = np.empty((g.shape[0], g.shape[2], 2 * g.shape[1]), np.float32)
            gu[..., ::2], gu[..., 1::2] = g.transpose(0, 2, 1), u.transpose(0, 2, 1)
            back[h + "mlp.experts.gate_up_proj"] = gu
            back[h + "mlp.experts.down_proj"] = d.transpose(0, 2, 1)
        else:
            back[h + "mlp.experts.gate_up_proj"] = np.concatenate((g, u), axis=1)
            back[h + "mlp.experts.down_proj"] = d
        for n in ("gate", "up", "down"):
            if f"{b}ffn_{n}_shexp.weight" in tensors:
                back[f"{h}mlp.shared_experts.{n}_proj.weight"] = tensors[f"{b}ffn_{n}_shexp.weight"]
    _copy_params(m, back)


def _deepseek2_back(cfg, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """transformers' parameter name -> the file's (dequantized) weight, for DeepSeek."""
    back = {"model.embed_tokens.weight": tensors["token_embd.weight"],
            "lm_head.weight": tensors["output.weight"]}
    for i in range(cfg.num_hidden_layers):
        h, b = f"model.layers.{i}.", f"blk.{i}."
        a = h + "self_attn."
        for ours, theirs in (("q", "q_proj"), ("q_a", "q_a_proj"), ("q_b", "q_b_proj"),
                             ("kv_a_mqa", "kv_a_proj_with_mqa"), ("kv_b", "kv_b_proj"),
                             ("output", "o_proj")):
            if f"{b}attn_{ours}.weight" in tensors:
                back[f"{a}{theirs}.weight"] = tensors[f"{b}attn_{ours}.weight"]
        if b + "attn_k_b.weight" in tensors:
            back[a + "kv_b_proj.weight"] = join_kv_b(tensors[b + "attn_k_b.weight"],
                                                     tensors[b + "attn_v_b.weight"])
        if b + "ffn_gate.weight" in tensors:
            for n in ("gate", "up", "down"):
                back[f"{h}mlp.{n}_proj.weight"] = tensors[f"{b}ffn_{n}.weight"]
            continue
        back[h + "mlp.experts.gate_up_proj"] = np.concatenate(
            (tensors[b + "ffn_gate_exps.weight"], tensors[b + "ffn_up_exps.weight"]), axis=1)
        back[h + "mlp.experts.down_proj"] = tensors[b + "ffn_down_exps.weight"]
        for n in ("gate", "up", "down"):
            back[f"{h}mlp.shared_experts.{n}_proj.weight"] = tensors[f"{b}ffn_{n}_shexp.weight"]
    return back


def _copy_params(m: torch.nn.Module, back: dict[str, np.ndarray]) -> None:
    params = dict(m.named_parameters())
    with torch.no_grad():
        for k, v in back.items():
            params[k].copy_(torch.from_numpy(np.ascontiguousarray(v)).reshape(params[k].shape))


def file_array(t) -> np.ndarray:
    """A tensor read back with gguf's GGUFReader, as float32 in torch order (dequantized)."""
    return dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])


def read_converter_file(path: Path, arch: str, keys: dict, shapes: dict, quant: str
                        ) -> tuple[dict, dict]:
    """The GGUF written by `write_pair` as llama.cpp's converter writes it (asserted): its
    architecture, each of ``keys`` as ``arch.KEY`` (approximately), the norm epsilon 1e-6, the
    vocabulary's N_VOCAB tokens, exactly the tensors of ``shapes`` (name -> torch-order shape),
    F32 where ``quant`` is "f32" and for vectors and routers, else Q8_0. Returns the reader's
    fields and its tensors by name."""
    import pytest
    from gguf import GGUFReader

    r = GGUFReader(path)
    assert r.fields["general.architecture"].contents() == arch
    for k, v in keys.items():
        assert r.fields[f"{arch}.{k}"].contents() == pytest.approx(v), k
    assert r.fields[f"{arch}.attention.layer_norm_rms_epsilon"].contents() == pytest.approx(1e-6)
    assert len(r.fields["tokenizer.ggml.tokens"].contents()) == N_VOCAB
    tensors = {t.name: t for t in r.tensors}
    assert {n: tuple(int(d) for d in reversed(t.shape)) for n, t in tensors.items()} == shapes
    for n, t in tensors.items():
        f32 = quant == "f32" or len(shapes[n]) == 1 or "ffn_gate_inp" in n
        assert t.tensor_type.name == ("F32" if f32 else "Q8_0"), n
    return r.fields, tensors

"""Mixture-of-experts families: qwen3moe, gpt-oss, glm4moe, minimax-m2, dots1, ernie4_5-moe, and
Mixtral (llama files with experts).

Every MoE layer routes each token to ``n_expert_used`` of ``n_expert`` expert FFNs: the router
``ffn_gate_inp`` [n_expert, n_embd] (float32 in the files) scores the experts, ``ops.route``
picks them by the family's gating (HParams.expert_gating), ``ops.experts`` runs the chosen
experts' slices of the 3-D ``ffn_{gate,up,down}_exps`` tensors and sums them by weight.

- qwen3moe: qwen3's block (per-head q/k RMSNorm), every layer MoE; softmax over all experts,
  top-k, weights renormalised.
- gpt-oss: attention sinks, biases on q/k/v/o, on the router and on every expert's products;
  the clamped SwiGLU; sliding window on even layers; YaRN RoPE; top-k on the router logits,
  softmax over the k. Its FFN norm is the GGUF's ``post_attention_norm`` (applied before the
  FFN, as every pre-norm block's).
- glm4moe: ``n_layer_dense_lead`` dense layers, then MoE layers with a shared expert beside the
  routed ones; sigmoid routing with the selection bias ``exp_probs_b``, the chosen weights
  the plain sigmoid values, normalised, times ``expert_weights_scale``; partial RoPE, q/k/v
  biases, optional q/k norm. Its NextN layers (blk.N, N >= n_layer_run) are not run.
- minimax-m2: RMSNorms over each token's whole q and whole k (HParams.qk_norm_whole), RoPE on
  the first rope_dim dims of each head (halves), every layer MoE with no shared expert;
  sigmoid routing that selects by sigmoid + ``exp_probs_b``, weights normalised.
- dots1 (dots.llm1): qwen3's attention (per-head q/k RMSNorm), then glm4moe's FFNs (leading
  dense layers, shared experts, sigmoid routing by the selection bias, weights normalised
  and scaled as the file says).
- ernie4_5-moe (ERNIE-4.5 MoE): llama's attention (adjacent-pair RoPE, optional q/k/v
  biases), leading dense layers, shared experts; softmax routing that selects by softmax +
  ``exp_probs_b`` and weighs by the plain softmax, weights normalised.
- Mixtral: a "llama" file whose metadata declares experts: llama's block (adjacent-pair RoPE,
  no biases, no q/k norm), every layer MoE; softmax over all experts, top-k, weights
  renormalised (as qwen3moe).
"""

from __future__ import annotations

import torch

from engine.runtime.models.layers import KVStore, Stage, weight


class MoEStage(Stage):
    ffn_norm = "ffn_norm"  # the pre-FFN norm's GGUF name

    def layer(self, i: int, x: torch.Tensor, rope: dict, pos0: int, kv: KVStore) -> torch.Tensor:
        ops, eps, p, t = self.ops, self.hp.rms_eps, f"blk.{i}.", self.t
        h = ops.rmsnorm(x, weight(t, p + "attn_norm.weight"), eps)
        qn = kn = None
        if self.hp.qk_norm:
            qn, kn = weight(t, p + "attn_q_norm.weight"), weight(t, p + "attn_k_norm.weight")
        a = self.attention(i, h, rope, pos0, kv, qn, kn)
        h, x = ops.add_rmsnorm(a, x, weight(t, p + self.ffn_norm + ".weight"), eps)
        f = self.moe(i, h) if self.hp.is_moe_layer(i) else self.ffn(i, h)
        return x + f

    def moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """The routed experts of layer i on normed x [T, n_embd] (plus the shared expert)."""
        hp, ops, p, t = self.hp, self.ops, f"blk.{i}.", self.t
        logits = self.proj(x.float(), p + "ffn_gate_inp")  # [T, n_expert]
        ids, w = ops.route(logits, hp.n_expert_used, hp.expert_gating, hp.expert_weights_norm,
                           hp.expert_weights_scale, t.get(p + "exp_probs_b.bias"),
                           groups=(hp.n_expert_groups, hp.n_group_used))
        biases = None
        if p + "ffn_gate_exps.bias" in t:
            biases = tuple(weight(t, p + f"ffn_{n}_exps.bias") for n in ("gate", "up", "down"))
        y = ops.experts(
            x, ids, w,
            weight(t, p + "ffn_gate_exps.weight"),
            weight(t, p + "ffn_up_exps.weight"),
            weight(t, p + "ffn_down_exps.weight"),
            hp.act, hp.swiglu_limit, biases,
        )
        if hp.n_expert_shared:
            y = y + self.shared_expert(i, x)
        return y

    def shared_expert(self, i: int, x: torch.Tensor) -> torch.Tensor:
        ops, p = self.ops, f"blk.{i}."
        g = ops.linear(x, weight(self.t, p + "ffn_gate_shexp.weight"))
        u = ops.linear(x, weight(self.t, p + "ffn_up_shexp.weight"))
        return ops.linear(ops.glu(g, u, self.hp.act), weight(self.t, p + "ffn_down_shexp.weight"))


class Qwen3MoEStage(MoEStage):
    pass


class MixtralStage(MoEStage):
    pass


class MiniMaxM2Stage(MoEStage):
    pass


class Dots1Stage(MoEStage):
    pass


class Ernie45MoEStage(MoEStage):
    pass


class GptOssStage(MoEStage):
    ffn_norm = "post_attention_norm"


class Glm4MoEStage(MoEStage):
    ffn_norm = "post_attention_norm"

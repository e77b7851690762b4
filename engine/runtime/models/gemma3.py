"""Gemma 3: embeddings scaled by sqrt(n_embd), per-head q/k RMSNorm, sandwich norms (a norm
after attention and after the FFN, before each residual add), GeGLU with the tanh GELU,
sliding-window layers with their own RoPE base, tied embeddings.

llama.cpp's converter already stores Gemma's RMSNorm weights as (1 + w), so every norm here is
the plain x / rms(x) * w.
"""

from __future__ import annotations

import torch

from engine.runtime.models.layers import KVStore, Stage, weight


class Gemma3Stage(Stage):
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embed(ids, self.embd) * self.hp.embed_scale

    def layer(self, i: int, x: torch.Tensor, rope: dict, pos0: int, kv: KVStore) -> torch.Tensor:
        ops, eps, p, t = self.ops, self.hp.rms_eps, f"blk.{i}.", self.t
        h = ops.rmsnorm(x, weight(t, p + "attn_norm.weight"), eps)
        qn, kn = weight(t, p + "attn_q_norm.weight"), weight(t, p + "attn_k_norm.weight")
        a = self.attention(i, h, rope, pos0, kv, qn, kn)
        a = ops.rmsnorm(a, weight(t, p + "post_attention_norm.weight"), eps)
        h, x = ops.add_rmsnorm(a, x, weight(t, p + "ffn_norm.weight"), eps)
        f = ops.rmsnorm(self.ffn(i, h), weight(t, p + "post_ffw_norm.weight"), eps)
        return x + f

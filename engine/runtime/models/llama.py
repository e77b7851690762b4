"""The llama family: llama, mistral, qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorm).

Pre-norm blocks: x += attn(norm(x)); x += ffn(norm(x)). Biases and qk-norm are present or not
in the tensors; the HParams say which RoPE style the file's q/k rows are laid out for.
"""

from __future__ import annotations

import torch

from engine.runtime.models.layers import KVStore, Stage, weight


class LlamaStage(Stage):
    def layer(self, i: int, x: torch.Tensor, rope: dict, pos0: int, kv: KVStore) -> torch.Tensor:
        ops, eps, p = self.ops, self.hp.rms_eps, f"blk.{i}."
        h = ops.rmsnorm(x, weight(self.t, p + "attn_norm.weight"), eps)
        qn = kn = None
        if self.hp.qk_norm:
            qn = weight(self.t, p + "attn_q_norm.weight")
            kn = weight(self.t, p + "attn_k_norm.weight")
        a = self.attention(i, h, rope, pos0, kv, qn, kn)
        h, x = ops.add_rmsnorm(a, x, weight(self.t, p + "ffn_norm.weight"), eps)
        return x + self.ffn(i, h)

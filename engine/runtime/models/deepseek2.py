"""DeepSeek-V2/V3 (GGUF arch deepseek2, also Kimi K2's files): multi-head latent attention
(MLA) over a MoE block with leading dense layers and shared experts.

Attention, as llama.cpp's deepseek2 graph runs it with the absorption trick, so the KV cache
holds one latent row per token and layer (kv_lora_rank + rope_dim values, HParams.kv_rows)
instead of every head's keys and values:

- q = attn_q x, or attn_q_b(rmsnorm(attn_q_a x)); each head's first nope dims are its
  position-free part, the last rope_dim rotated (adjacent pairs).
- attn_kv_a_mqa x = [latent | k_pe]: the latent RMS-normed (attn_kv_a_norm), k_pe rotated;
  the cache row is [latent | k_pe], shared by all heads.
- Each head's position-free query is carried into the latent space by its attn_k_b matrix
  (q_lat = k_b[h] q_nope), so q·k = [q_lat | q_pe] · row: one key head for all queries.
- The attention-weighted latent o_lat is carried out by attn_v_b (o = v_b[h] o_lat), then
  attn_output.
- Older files hold both as one attn_kv_b [n_head (nope + v), kv_lora] whose per-head row
  blocks are k_b[h]^T then v_b[h] (HParams.mla_legacy).

Mistral Large 3's files add an attention temperature (HParams.attn_temp_scale): each
token's query is multiplied by 1 + scale ln(floor(pos / length) + 1).

The FFN is the MoE family's (engine/runtime/models/moe.py): softmax (V2) or sigmoid with the
selection bias (V3) routing, optionally limited to groups, shared experts beside the routed.
"""

from __future__ import annotations

from typing import Any

import torch

from carve_kernels.dequant import dequantize_to
from engine.runtime.models.layers import KVStore, weight
from engine.runtime.models.moe import MoEStage
from engine.runtime.models.ops import QExperts


class Deepseek2Stage(MoEStage):
    def attention(
        self,
        i: int,
        x: torch.Tensor,
        rope: dict,
        pos0: int,
        kv: KVStore,
        q_norm: torch.Tensor | None = None,
        k_norm: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hp, ops, p, t = self.hp, self.ops, f"blk.{i}.", self.t
        n, h, c, rd = x.shape[0], hp.n_head, hp.kv_lora_rank, hp.rope_dim
        nope = hp.head_dim - rd
        if hp.q_lora_rank:
            qa = ops.rmsnorm(self.proj(x, p + "attn_q_a"), weight(t, p + "attn_q_a_norm.weight"),
                             hp.rms_eps)
            q = self.proj(qa, p + "attn_q_b")
        else:
            q = self.proj(x, p + "attn_q")
        q = q.view(n, h, hp.head_dim)
        kv_a = self.proj(x, p + "attn_kv_a_mqa")  # [n, c + rd]
        latent = ops.rmsnorm(kv_a[:, :c], weight(t, p + "attn_kv_a_norm.weight"), hp.rms_eps)
        cos, sin = rope[False]
        q_pe = ops.rope(q[..., nope:], cos, sin, hp.rope_style)
        k_pe = ops.rope(kv_a[:, c:].reshape(n, 1, rd), cos, sin, hp.rope_style)
        row = torch.cat((latent.view(n, 1, c), k_pe.to(latent.dtype)), dim=-1)
        keys, values, mask = kv.store_and_fetch(i, row, None, pos0)  # [S, 1, c + rd], [S, 1, c]
        k_b = self._k_b(i)  # [h, c, nope]
        q_lat = torch.einsum("thn,hcn->thc", q[..., :nope].to(k_b.dtype), k_b)
        del k_b
        q_all = torch.cat((q_lat.float(), q_pe.float()), dim=-1)
        if hp.attn_temp_scale:  # Mistral Large 3: queries warmer with distance
            q_all = q_all * temperature(hp, pos0, n, q_all.device)[:, None, None]
        q_all = q_all.to(x.dtype)
        o_lat = latent_attention(q_all, keys[:, 0], values[:, 0], mask, hp.attn_scale)
        v_b = self._v_b(i)  # [h, v, c]
        o = torch.einsum("thc,hvc->thv", o_lat.to(v_b.dtype), v_b)
        return self.proj(o.reshape(n, h * hp.head_dim_v).to(x.dtype), p + "attn_output")

    # --- the absorbed matrices ----------------------------------------------------------------
    # Each is dequantized where it is used (an uncached one lands in the stage's one scratch,
    # so the two cannot be held at once); a legacy file's attn_kv_b is dequantized for each.
    def _k_b(self, i: int) -> torch.Tensor:
        """Layer i's [n_head, kv_lora, nope] matrices taking a head's query into the latent."""
        if not self.hp.mla_legacy:
            return _whole(weight(self.t, f"blk.{i}.attn_k_b.weight"))
        return self._kv_b(i)[:, : self._nope].transpose(1, 2)

    def _v_b(self, i: int) -> torch.Tensor:
        """Layer i's [n_head, head_dim_v, kv_lora] matrices taking a head's latent out."""
        if not self.hp.mla_legacy:
            return _whole(weight(self.t, f"blk.{i}.attn_v_b.weight"))
        return self._kv_b(i)[:, self._nope :]

    @property
    def _nope(self) -> int:
        return self.hp.head_dim - self.hp.rope_dim

    def _kv_b(self, i: int) -> torch.Tensor:
        # a legacy file's attn_kv_b [n_head (nope + v), kv_lora] as [n_head, nope + v, kv_lora]
        hp = self.hp
        kv_b = _whole(weight(self.t, f"blk.{i}.attn_kv_b.weight"))
        return kv_b.view(hp.n_head, self._nope + hp.head_dim_v, -1)


def temperature(hp: Any, pos0: int, n: int, device: torch.device) -> torch.Tensor:
    """float32 [n]: the factor on the queries of positions pos0.. (llama.cpp's attention
    temperature, offset 0 for deepseek2): 1 + scale ln(floor(pos / length) + 1)."""
    pos = torch.arange(pos0, pos0 + n, device=device, dtype=torch.float64)
    f = torch.log(torch.floor(pos / hp.attn_temp_length) + 1) * hp.attn_temp_scale + 1
    return f.float()


# scores a block of queries may hold at once: [rows x heads, keys] float32 (64 MiB)
SCORES = 1 << 24


def latent_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax(q keys^T * scale) values for every head of q [T, H, D] over one key head:
    keys [S, D], values [S, Dv], mask bool [T, S] (True = may attend) or None -> float32
    [T, H, Dv]. The heads of a token share its keys, so they are rows of one product, in
    blocks of tokens whose scores stay within SCORES (a grouped-query attention op would
    repeat the keys for each of the H heads: 128 x the cache at DeepSeek-V3's)."""
    t, h, d = q.shape
    kf, vf = keys.float(), values.float()
    out = torch.empty(t, h, vf.shape[-1], dtype=torch.float32, device=q.device)
    step = max(1, SCORES // max(1, h * kf.shape[0]))
    for t0 in range(0, t, step):
        t1 = min(t, t0 + step)
        s = q[t0:t1].float().reshape(-1, d) @ kf.T * scale  # [(t1 - t0) h, S]
        if mask is not None:
            s = s.view(t1 - t0, h, -1).masked_fill(~mask[t0:t1, None], float("-inf"))
        out[t0:t1] = (torch.softmax(s.view(-1, kf.shape[0]), dim=-1) @ vf).view(t1 - t0, h, -1)
    return out


def _whole(w: Any) -> torch.Tensor:
    """A matrix (`QWeight`) or per-head matrices (`QExperts`, [n, rows, cols]) as one float
    tensor: the dequant cache's copy (made float32 on the CPU), else dequantized into the
    stage's priced scratch where it fits (float32 on the CPU, as every CPU product), else into a
    temporary."""
    n = getattr(w, "n_expert", 1)
    shape = (n, w.rows, w.cols) if isinstance(w, QExperts) else (w.rows, w.cols)
    c = w.cached
    cpu = w.raw.device.type == "cpu"
    if c is not None:
        return (c.float() if cpu else c).view(shape)
    dtype = torch.float32 if cpu else torch.bfloat16
    s, size = w.scratch, n * w.rows * w.cols
    out = None
    if s is not None and s.dtype == dtype and s.numel() >= size:
        out = s[:size].view(n * w.rows, w.cols)
    return dequantize_to(w.raw, w.ggml_type, (w.cols, n * w.rows), dtype, out=out).view(shape)

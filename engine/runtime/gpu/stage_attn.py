"""The attention half of a GPU stage's layers (``GpuStage`` mixes it in): the pre-norm, q/k/v
(one launch where the load decided so), the q/k norms, RoPE and the KV cache, attention (decode
split-K, prefill over the chunk and the cache) and the output projection.
"""

from __future__ import annotations

import torch

from carve_kernels import attention, gemv_t, kv_cache, norm, quant_matmul, rope
from engine.runtime.gpu.matrices import Attention, Ffn, gemv_rows
from engine.runtime.gpu.rows import Rows


class AttentionLayers:
    """GpuStage's attention steps (they read the stage's hp, buf, pdl, neox, t_part, t_count,
    attn_ws, attn_count and its ``_linear``, ``_add_norm``)."""

    def _attention(self, att: Attention, a: Rows, pos0: int | None, prev: Ffn | None) -> None:
        """The attention half of a layer: the pre-norm (adding the previous layer's output to
        hidden first), q/k/v, the q/k norms, RoPE and the KV cache, attention, and its output
        projection into proj."""
        hp = self.hp
        xq = att.xq if a.n == 1 else None
        if prev is None:
            norm.rmsnorm(a.hidden, att.norm, hp.rms_eps, out=a.normed, q8=xq, use_pdl=self.pdl)
        else:
            self._add_norm(a, prev.post_norm, att.norm, xq)
        self._qkv(att, a.normed, a.qkv, xq, a if pos0 is None and att.rope_in_qkv else None)
        if hp.qk_norm and getattr(hp, "qk_norm_whole", False):
            # minimax-m2: one RMSNorm over each token's whole q, one over its whole k, in place
            nq, nk = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
            q, k = a.qkv[:, :nq], a.qkv[:, nq:nq + nk]
            norm.rmsnorm(q, att.q_norm, hp.rms_eps, out=q, use_pdl=self.pdl)
            norm.rmsnorm(k, att.k_norm, hp.rms_eps, out=k, use_pdl=self.pdl)
        elif hp.qk_norm and not (pos0 is None and att.qk_norm_in_rope):
            norm.rmsnorm_heads(a.qk3, att.q_norm, att.k_norm, hp.n_head, hp.rms_eps,
                               use_pdl=self.pdl)
        if pos0 is None:
            self._attend_decode(att, a)
        else:
            self._attend_prefill(att, a)
        self._linear(att.output, a.attn, a.proj)

    def _qkv(self, att: Attention, x: torch.Tensor, out: torch.Tensor, xq,
             rotate: Rows | None = None) -> None:
        """q, k, v side by side in ``out``; decode runs the three GEMVs (and biases) in one
        launch where the load decided so, and with ``rotate`` (decode's rows, where
        ``att.rope_in_qkv``) their rotation and cache store in that launch too."""
        gemv = gemv_rows(x.shape[0], att.qkv, out)
        if gemv and att.fused == "t3":
            r = (None if rotate is None
                 else {**self._rope_args(att, rotate), "head_dim": self.hp.head_dim})
            gemv_t.gemv_t3(att.fused_mats, x, out, self.t_part, self.t_count, att.fused_biases,
                           config=att.fused_config, xq=xq, rope=r, use_pdl=self.pdl)
        elif gemv and att.fused == "gemv3":
            quant_matmul.gemv3(att.fused_mats, x, out, att.fused_biases, att.fused_config,
                               use_pdl=self.pdl, xq=xq)
        else:
            o = 0
            for m in att.qkv:
                self._linear(m, x, out[:, o:o + m.rows], xq=xq)
                o += m.rows

    def _rope_args(self, att: Attention, a: Rows) -> dict:
        # decode's rotation and cache store (rope.rope_store's arguments but the heads)
        return dict(positions=a.pos, base=att.rope_base, neox=self.neox,
                    freq_scale=att.rope_scale, k_cache=att.k_cache, v_cache=att.v_cache,
                    cells=att.cells, freqs=att.rope_freqs, mscale=att.rope_mscale,
                    qk_norm=(att.q_norm, att.k_norm, self.hp.rms_eps)
                    if att.qk_norm_in_rope else None)

    def _attend_decode(self, att: Attention, a: Rows) -> None:
        # one token at the position in buf.positions (the captured graph reads it there)
        hp = self.hp
        # rope_in_qkv: the q/k/v launch has rotated and stored them
        if att.rope_store and not att.rope_in_qkv:  # rotation and the cache store in one launch
            rope.rope_store(a.qk3, a.v3, n_q=hp.n_head, use_pdl=self.pdl,
                            **self._rope_args(att, a))
        elif not att.rope_store:
            rope.rope(self._rotated(att, a), a.pos, att.rope_base, self.neox, att.rope_scale,
                      use_pdl=self.pdl, freqs=att.rope_freqs, mscale=att.rope_mscale)
            kv_cache.kv_store(a.k3, att.k_cache, a.pos, att.cells, a.v3, att.v_cache,
                              use_pdl=self.pdl)
        attention.attn_decode(a.q3[0], att.k_cache, att.v_cache, a.pos, hp.n_head_kv, att.cells,
                              att.window, hp.attn_scale, out=a.o3[0], workspace=self.attn_ws,
                              counter=self.attn_count, use_pdl=self.pdl, sinks=att.sinks)

    def _rotated(self, att: Attention, a: Rows) -> torch.Tensor:
        # the q and k dims RoPE rotates: whole heads, or (partial RoPE) each head's first
        # rope_dim dims, whose angles then step by rope_dim, as ggml's n_dims
        return a.qk3 if att.rope_dim == self.hp.head_dim else a.qk3[..., :att.rope_dim]

    def _attend_prefill(self, att: Attention, a: Rows) -> None:
        rope.rope(self._rotated(att, a), a.pos, att.rope_base, self.neox, att.rope_scale,
                  use_pdl=self.pdl, freqs=att.rope_freqs, mscale=att.rope_mscale)
        if att.kv_q8:
            # q8_0: the chunk attends its own keys/values as the cache gives them back (the CPU
            # engine and llama.cpp do); the store below re-quantizes them
            kv_cache.q8_roundtrip_(a.k3, use_pdl=self.pdl)
            kv_cache.q8_roundtrip_(a.v3, use_pdl=self.pdl)
        # the first position read on the device from the chunk's positions: nothing of the
        # chunk's launches depends on where it starts (what capturing a chunk needs)
        attention.attn_prefill(a.q3, a.k3, a.v3, att.k_cache, att.v_cache, a.pos, att.cells,
                               att.window, self.hp.attn_scale, out=a.o3, use_pdl=self.pdl,
                               sinks=att.sinks)
        # a ring keeps only the chunk's last `cells` positions, and a padded chunk none of its
        # padding: the store skips the other rows on the device (so no two programs write one
        # cell, and the launch does not depend on how many rows are the prompt's)
        kv_cache.kv_store(a.k3, att.k_cache, a.pos, att.cells, a.v3, att.v_cache,
                          use_pdl=self.pdl)

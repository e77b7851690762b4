"""The attention half of a GPU stage's layers (``GpuStage`` mixes it in): the pre-norm, q/k/v
(one launch where the load decided so), the q/k norms, RoPE and the KV cache, attention (decode
split-K, prefill over the chunk and the cache) and the output projection.
"""

from __future__ import annotations

import torch

from carve_kernels import attention, gemv_fused, gemv_t3, kv_cache, latent, norm, quant_matmul, rope
from engine.runtime.gpu.layers import Attention, Ffn, Latent, Matrix, gemv_rows
from engine.runtime.gpu.rows import Rows
from spec import quant_types as qt

# file types a latent layer's per-head matrices are read in as they lie (else dequantized)
_FLOAT = {qt.F32: torch.float32, qt.F16: torch.float16, qt.BF16: torch.bfloat16}


class AttentionLayers:
    """GpuStage's attention steps (they read the stage's hp, buf, pdl, neox, t_part, t_count,
    attn_ws, attn_count and its ``_linear``, ``_add_norm``)."""

    def _attention(self, att: Attention | Latent, a: Rows, pos0: int | None,
                   prev: Ffn | None) -> None:
        """The attention half of a layer: the pre-norm (adding the previous layer's output to
        hidden first), q/k/v, the q/k norms, RoPE and the KV cache, attention, and its output
        projection into proj."""
        if isinstance(att, Latent):
            self._latent(att, a, pos0, prev)
            return
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
        # decode's attention wrote the int8 copy of its output where the load decided so
        self._linear(att.output, a.attn, a.proj, xq=att.xq_o if pos0 is None else None,
                     attn_output=True)

    def _qkv(self, att: Attention, x: torch.Tensor, out: torch.Tensor, xq,
             rotate: Rows | None = None) -> None:
        """q, k, v side by side in ``out``; decode runs the three GEMVs (and biases) in one
        launch where the load decided so, and with ``rotate`` (decode's rows, where
        ``att.rope_in_qkv``) their rotation and cache store in that launch too."""
        gemv = gemv_rows(x.shape[0], att.qkv, out)
        if gemv and att.fused == "t3":
            r = (None if rotate is None
                 else {**self._rope_args(att, rotate), "head_dim": self.hp.head_dim})
            gemv_t3.gemv_t3(att.fused_mats, x, out, self.t_part, self.t_count, att.fused_biases,
                            config=att.fused_config, xq=xq, rope=r, use_pdl=self.pdl)
        elif gemv and att.fused == "gemv3":
            gemv_fused.gemv3(att.fused_mats, x, out, att.fused_biases, att.fused_config,
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
                              counter=self.attn_count, use_pdl=self.pdl, sinks=att.sinks,
                              out_q=att.xq_o)

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

    # --- latent attention (deepseek2) ------------------------------------------------------
    def _latent(self, att: Latent, a: Rows, pos0: int | None, prev: Ffn | None) -> None:
        """A deepseek2 layer's attention half (carve_kernels/latent.py), on buf.qkv laid out as
        [q | latent row | q in the latent space (then the heads' outputs) | attn_q_a's output]
        (engine/planning/buffers.py) and the weighted latents in buf.attn."""
        hp, pdl, eps = self.hp, self.pdl, self.hp.rms_eps
        if prev is None:
            norm.rmsnorm(a.hidden, att.norm, eps, out=a.normed, use_pdl=pdl)
        else:
            self._add_norm(a, prev.post_norm, att.norm, None)
        n, h, c, r = a.n, hp.n_head, hp.kv_lora_rank, hp.rope_dim
        hd, nope, vd = hp.head_dim, hp.head_dim - hp.rope_dim, hp.head_dim_v
        qkv = self.buf["qkv"][:n]
        o_row, o_lat = h * hd, h * hd + c + r
        o_qa = o_lat + h * c
        q3 = qkv[:, :o_row].unflatten(1, (h, hd))
        row = qkv[:, o_row:o_lat]
        q_lat = qkv[:, o_lat:o_qa].unflatten(1, (h, c))
        if att.q_a is not None:
            qa = qkv[:, o_qa:o_qa + hp.q_lora_rank]
            self._linear(att.q_a, a.normed, qa)
            norm.rmsnorm(qa, att.q_a_norm, eps, out=qa, use_pdl=pdl)
            self._linear(att.q_b, qa, qkv[:, :o_row])
        else:
            self._linear(att.q, a.normed, qkv[:, :o_row])
        self._linear(att.kv_a, a.normed, row)
        norm.rmsnorm(row[:, :c], att.kv_norm, eps, out=row[:, :c], use_pdl=pdl)
        for x in (q3[..., nope:], row[:, c:].unsqueeze(1)):
            rope.rope(x, a.pos, att.rope_base, self.neox, att.rope_scale, use_pdl=pdl,
                      freqs=att.rope_freqs, mscale=att.rope_mscale)
        latent.latent_store(row, att.cache, a.pos, att.cells, use_pdl=pdl)
        latent.head_matmul(q3[..., :nope], self._k_b(att), q_lat, use_pdl=pdl)
        weighted = a.attn.view(n, h, -1)[..., :c]
        latent.latent_attention(q_lat, q3[..., nope:], att.cache, a.pos, att.cells,
                                hp.attn_scale, weighted,
                                workspace=self.attn_ws if pos0 is None else None,
                                temperature=att.temperature, use_pdl=pdl)
        out = qkv[:, o_lat:o_lat + h * vd]  # q_lat's place, read by now
        latent.head_matmul(weighted, self._v_b(att), out.unflatten(1, (h, vd)), use_pdl=pdl)
        self._linear(att.output, out, a.proj, attn_output=True)

    def _k_b(self, att: Latent) -> torch.Tensor:
        """[n_head, kv_lora, nope]: each head's matrix into the latent space."""
        hp = self.hp
        nope = hp.head_dim - hp.rope_dim
        w = self._dense(att.k_b)
        if att.v_b is None:  # a legacy attn_kv_b: per head [nope + v, kv_lora], k_b^T first
            return w.view(hp.n_head, nope + hp.head_dim_v, -1)[:, :nope].transpose(1, 2)
        return w.view(hp.n_head, hp.kv_lora_rank, nope)

    def _v_b(self, att: Latent) -> torch.Tensor:
        """[n_head, head_dim_v, kv_lora]: each head's matrix out of the latent space."""
        hp = self.hp
        if att.v_b is None:
            nope = hp.head_dim - hp.rope_dim
            w = self._dense(att.k_b)
            return w.view(hp.n_head, nope + hp.head_dim_v, -1)[:, nope:]
        return self._dense(att.v_b).view(hp.n_head, hp.head_dim_v, hp.kv_lora_rank)

    def _dense(self, m: Matrix) -> torch.Tensor:
        """Matrix m as floats [rows, cols]: its dequant-cache copy, the file's floats as they
        lie, or dequantized into buf.dequant (what prefill's GEMMs use; read before the next
        matrix is dequantized there)."""
        if m.dq is not None:
            return m.dq
        dt = _FLOAT.get(m.ggml_type)
        if dt is not None:
            return m.packed.view(dt)
        cols = quant_matmul.row_cols(m.packed, m.ggml_type)
        c = self.buf["dequant"][: m.rows * cols].view(m.rows, cols)
        quant_matmul.dequantize(m.packed, m.ggml_type, c.dtype, out=c, use_pdl=self.pdl)
        return c

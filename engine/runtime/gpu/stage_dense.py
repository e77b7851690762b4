"""The dense half of a GPU stage's layers and its matrix products (``GpuStage`` mixes it in): the
FFN of a layer (the fused add-and-norm before it, act(gate) * up, down into proj; a MoE layer's
goes on to stage_moe.py), the stage's last FFN output added into hidden, and every matrix's
product: decode's GEMVs (GGUF order or the T layout, fused where the load decided so) or
prefill's GEMM on the dequant cache.
"""

from __future__ import annotations

import torch

from carve_kernels import gemv_fused, gemv_t, glu, l2, moe, norm, quant_matmul, t_layout
from engine.runtime.gpu.layers import (
    Experts,
    Ffn,
    Layer,
    Matrix,
    attn_matrices,
    gemv_rows,
)
from engine.runtime.gpu.rows import Rows


class DenseLayers:
    """GpuStage's FFN and matrix steps (they read the stage's hp, buf, pdl, t_part, t_count
    and its ``_experts``)."""

    def _ffn(self, layer: Layer, a: Rows) -> None:
        """The FFN half of a layer: the pre-norm (adding attention's output to hidden first),
        act(gate) * up, and down into proj."""
        f = layer.ffn
        xq = f.xq if a.n == 1 else None
        if isinstance(f, Experts) and a.n == 1 and layer.attn.post_norm is None:
            # decode: the norm and the router in one launch (H200 tg128, one call, 2026-12-04:
            # Qwen3-30B-A3B 422.4 against 416.3 t/s, gpt-oss-20b 460.4 against 455.6)
            moe.norm_router(a.proj, a.hidden, f.norm, self.hp.rms_eps, f.router, f.router_bias,
                            a.normed, self.buf["moe_logits"][:1], self.buf["moe_count"][-1:],
                            q8=xq, use_pdl=self.pdl)
            self._experts(f, a, logits=True)
            return
        self._add_norm(a, layer.attn.post_norm, f.norm, xq)
        if isinstance(f, Experts):
            self._experts(f, a)
            return
        aq = self._glu(f, a, xq)
        self._linear(f.down, a.ffn_act, a.proj, xq=aq)

    def _l2_ffn(self, f: Ffn | Experts, budget: int) -> bool:
        """Decode: pull the first words of every block of this layer's gate and up T matrices
        into L2 (the same share of each, up to ``budget`` bytes in all), from the stage's
        prefetch stream after what this stream has queued so far (the previous layer's FFN):
        the fetch overlaps the attention half's latency-bound launches, and the gate/up launch
        then finds that share in L2. Whether it did (a layer with another FFN does not)."""
        if isinstance(f, Experts) or f.fused != "t_glu":
            return False
        mats = (f.gate, f.up)
        share = min(1.0, budget / sum(m.t_bytes.numel() for m in mats))
        side = self._l2_fork()
        with torch.cuda.stream(side):
            for m in mats:
                w, plane = t_layout.WORDS[m.ggml_type], m.rows * 4
                if plane % 16 or m.t_bytes.data_ptr() % 16:  # the bulk prefetch's alignment
                    continue
                nb = m.t_bytes.numel() // (m.rows * t_layout.BLOCK_BYTES[m.ggml_type])
                l2.prefetch(m.t_bytes, nb, w * plane, int(w * share) * plane,
                            evict_last=self.l2_last)
        return True

    def _l2_next(self, f: Ffn | Experts, nxt: Layer, budget: int) -> bool:
        """Decode, a MoE layer: pull the next layer's attention matrices, and its router if it
        has one (the first ``budget`` bytes of them, the same share of each), into L2 from
        the prefetch stream after this layer's attention half: the fetch overlaps the routed
        experts, whose GEMVs leave DRAM part idle (bound by what each program has in
        flight), and the next layer's q/k/v, attn_output and router launches then find those
        bytes in L2. Whether it did (a dense layer does not: its FFN is bound by DRAM
        itself)."""
        if not isinstance(f, Experts):
            return False
        mats = [m.t_bytes if m.t_bytes is not None else m.packed for m in attn_matrices(nxt.attn)]
        if isinstance(nxt.ffn, Experts):
            mats.append(nxt.ffn.router)
        share = min(1.0, budget / sum(t.numel() * t.element_size() for t in mats))
        side = self._l2_fork()
        with torch.cuda.stream(side):
            for t in mats:
                if t.data_ptr() % 16 or not t.is_contiguous():
                    continue
                length = int(t.numel() * t.element_size() * share) // 16 * 16
                l2.prefetch(t, 1, 0, length, evict_last=self.l2_last)
        return True

    def _l2_fork(self) -> torch.cuda.Stream:
        # the prefetch stream, after what this stream has queued so far
        if self._l2_stream is None:
            self._l2_stream = torch.cuda.Stream(self.device)
        self._l2_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._l2_stream

    def _add_norm(self, a: Rows, post: torch.Tensor | None, w: torch.Tensor, q8) -> None:
        """hidden += proj (gemma3: rmsnorm(proj) * post first), then normed = rmsnorm(hidden) *
        w (and its int8 copy into ``q8``; never with post: the stage keeps it off for gemma3)."""
        if post is None:
            norm.rmsnorm(a.proj, w, self.hp.rms_eps, residual=a.hidden, out=a.normed, q8=q8,
                         use_pdl=self.pdl)
        else:
            norm.rmsnorm_post(a.proj, post, w, self.hp.rms_eps, residual=a.hidden, out=a.normed,
                              use_pdl=self.pdl)

    def _add_output(self, a: Rows, last: Ffn) -> None:
        # the stage's last FFN output into hidden (the next stage's first norm takes hidden),
        # rounded once as the fused add-and-norm of a layer boundary rounds it: a split then
        # changes no bit of the stream
        # by the same kernels (a torch add rounds bf16 to nearest, the interpreter's Triton
        # casts truncate); their norm into normed is not read (the head rewrites it)
        if last.post_norm is not None:
            norm.rmsnorm_post(a.proj, last.post_norm, last.post_norm, self.hp.rms_eps,
                              residual=a.hidden, out=a.normed, use_pdl=self.pdl)
        else:
            norm.rmsnorm(a.proj, last.norm, self.hp.rms_eps, residual=a.hidden, out=a.normed,
                         use_pdl=self.pdl)

    # --- FFN -----------------------------------------------------------------------------
    def _glu(self, f: Ffn, a: Rows, xq):
        """act(gate) * up of normed into ffn_act; decode runs both GEMVs and the GLU in one
        launch where the load decided so. ``xq``: normed's int8 copy; returns the int8 copy of
        ffn_act if one was written (the input of ffn_down's GEMV)."""
        x = a.normed
        gemv = gemv_rows(a.n, (f.gate, f.up), a.ffn_act)
        if gemv and f.fused == "t_glu":
            oq = f.xq_down if a.n == 1 else None
            gemv_t.gemv_t_glu(f.gate.t_bytes, f.up.t_bytes, f.gate.ggml_type, f.gate.rows, x,
                              a.ffn_act, self.t_part, self.t_count, self.hp.act,
                              config=f.fused_config, xq=xq, out_q=oq, use_pdl=self.pdl)
            return oq
        if gemv and f.fused == "gemv_glu":
            gemv_fused.gemv_glu(f.gate.packed, f.up.packed, f.gate.ggml_type, x, self.hp.act,
                                out=a.ffn_act, config=f.fused_config, use_pdl=self.pdl,
                                xq=xq)
            return None
        nf = self.hp.n_ff
        self._linear(f.gate, x, a.ffn_up[:, :nf], xq=xq)
        self._linear(f.up, x, a.ffn_up[:, nf:], xq=xq)
        glu.glu(a.ffn_up[:, :nf], a.ffn_up[:, nf:], self.hp.act, out=a.ffn_act, use_pdl=self.pdl)
        return None

    # --- matrices ------------------------------------------------------------------------
    def _linear(self, m: Matrix, x: torch.Tensor, out: torch.Tensor, xq=None,
                attn_output: bool = False) -> None:
        """out = x @ m^T (+ m's bias, in the same launch): its GEMV where ``gemv_rows`` says
        (``xq``: x's int8 copy, for a T matrix or a row-body type's), else a GEMM.
        ``attn_output``: m is a layer's attn_output (its T launch's own tuning)."""
        if not gemv_rows(x.shape[0], (m,), out):
            self._gemm(m, x, out)
        elif m.t_bytes is not None:
            gemv_t.gemv_t(m.t_bytes, m.ggml_type, m.rows, x, out, self.t_part, self.t_count,
                          bias=m.bias, config=m.config, xq=xq, use_pdl=self.pdl,
                          attn_output=attn_output)
        else:
            quant_matmul.gemv(m.packed, m.ggml_type, x, out=out, bias=m.bias, config=m.config,
                              use_pdl=self.pdl, xq=xq)

    def _gemm(self, m: Matrix, x: torch.Tensor, out: torch.Tensor) -> None:
        # prefill only (never in the captured decode step): one GEMM on the dequant cache's
        # copy, or on the matrix dequantized into buf.dequant
        c = m.dq
        if c is None:
            c = self.buf["dequant"][: m.rows * quant_matmul.row_cols(m.packed, m.ggml_type)]
            c = c.view(m.rows, -1)
            quant_matmul.dequantize(m.packed, m.ggml_type, c.dtype, out=c, use_pdl=self.pdl)
        if x.dtype == c.dtype == out.dtype:
            torch.matmul(x, c.T, out=out)  # bf16 activations (GPU): no temporaries
        else:
            out.copy_(x.to(c.dtype) @ c.T)
        if m.bias is not None:
            out += m.bias

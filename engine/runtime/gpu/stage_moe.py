"""The mixture-of-experts FFN of a GPU stage's layers (``GpuStage`` mixes it in): router
logits and top-k routing on the device, glm4moe's shared expert, and the routed experts as
decode's expert GEMVs (carve_kernels/moe_decode.py; on x's int8 copy moe_decode_q8.py) or
prefill's sort by expert and grouped GEMMs (carve_kernels/moe_prefill.py), run from the layer's
own tensors or, for experts in host memory, through engine/runtime/gpu/host.py.
"""

from __future__ import annotations

from typing import Any

import torch

from carve_kernels import gemv_fused, glu, host_split, moe, moe_decode, moe_decode_q8, moe_prefill
from engine.runtime.gpu.layers import GEMV_ROWS, Experts, Ffn, gemv_rows
from engine.runtime.gpu.rows import Rows


class MoeLayers:
    """GpuStage's mixture-of-experts steps (they read the stage's hp, buf, pdl, layers and
    its ``_linear``)."""

    def _experts(self, f: Experts, a: Rows, logits: bool = False) -> None:
        """A mixture-of-experts FFN on normed into proj: router logits, top-k routing (ids and
        weights stay on the device), the shared expert (glm4moe) into proj, then the routed
        experts added onto it with their weights. Up to GEMV_ROWS rows: the expert GEMVs (the
        decode step's graph holds them); more: the rows sorted by expert and one grouped GEMM
        per expert (carve_kernels/moe_decode.py, moe_prefill.py). ``logits``: the router's
        logits are in buf.moe_logits already (decode's fused norm and router)."""
        self._route(f, a, logits)
        self._experts_out(f, a)

    def _route(self, f: Experts, a: Rows, logits: bool = False) -> None:
        """Router logits (``logits``: already in buf.moe_logits) and top-k routing into
        buf.moe_ids / moe_w (on the device), and the shared expert (glm4moe) into proj."""
        hp, b, n, x, pdl = self.hp, self.buf, a.n, a.normed, self.pdl
        if not logits:
            moe.router(f.router, x, f.router_bias, out=b["moe_logits"][:n], use_pdl=pdl)
        moe.route(b["moe_logits"][:n], hp.n_expert_used, hp.expert_gating,
                  hp.expert_weights_norm, hp.expert_weights_scale, f.sel_bias,
                  b["moe_ids"][:n], b["moe_w"][:n], use_pdl=pdl,
                  groups=(hp.n_expert_groups, hp.n_group_used))
        if f.shared is not None:
            self._shared_expert(f.shared, a)

    def _experts_out(self, f: Experts, a: Rows) -> None:
        """The routed experts of the routing in buf.moe_ids / moe_w onto proj."""
        b, n = self.buf, a.n
        ids, w = b["moe_ids"][:n], b["moe_w"][:n]
        h = f.host
        if h is not None and h.in_place is not None and n <= GEMV_ROWS:
            # decode's rows: the routed experts read in pinned host memory, gathered into the
            # staging span first (the kernels then run there) or by the kernels themselves;
            # a split layer's row hands the CPU its first experts (it computes them while the
            # GPU runs the rest) and adds the CPU's sum after the GPU's own
            # (a precompile's dry pass launches only what is compiled: no handing over there)
            c = h.cpu_share if n == 1 and self.dry_runs is None else 0
            if c:
                host_split.publish(a.normed[0], ids[0, :c], w[0, :c], h.x, h.ids, h.w, h.flags,
                                   use_pdl=self.pdl)
                if not self.capturing():  # eager (warm-up, interpreter): answered right here
                    h.serve()
                ids, w = ids[:, c:], w[:, c:]
            if ids.shape[1] and h.gather:
                st = h.stream
                moe_decode.gather_experts(h.in_place + (h.bias_bytes or []),
                                          st.views + [v for _, v in st.bias_pairs],
                                          self.hp.n_expert, ids, use_pdl=self.pdl)
                self._routed(f, st.views, self.hp.n_expert, ids, w, a, st.biases)
            elif ids.shape[1]:
                self._routed(f, h.in_place, self.hp.n_expert, ids, w, a, h.in_place_biases)
            if c:  # the CPU's sum, once the host has answered
                host_split.await_sum(h.flags, h.y[0], a.proj[0],
                                     accumulate=ids.shape[1] > 0 or f.shared is not None,
                                     use_pdl=self.pdl)
            if not self.capturing():  # a graph's replays count theirs (`replay`)
                h.moved += h.row_bytes if c else n * h.row_moved(0)
            return
        if f.host is not None:  # experts in host memory: routed here, run from the expert
            # cache's slots, the staging span or by the CPU (engine/runtime/gpu/host.py)
            f.host.run(a.normed, ids, w, a.proj, b["moe_out"][:n], f.shared is not None,
                       lambda mats, slots, sid, bias: self._routed(f, mats, slots, sid, w, a,
                                                                    bias))
            return
        self._routed(f, [f.gate.packed, f.up.packed, f.down.packed], self.hp.n_expert, ids, w,
                     a)

    def _routed(self, f: Experts, mats: list[torch.Tensor], ne: int, ids: torch.Tensor,
                w: torch.Tensor, a: Rows, biases: list[torch.Tensor] | None = None) -> None:
        """The routed experts onto proj: ``mats`` the gate, up and down bytes of ``ne``
        experts ([ne * rows, bytes per row] each: the layer's tensors, or cache slots);
        ``biases``: their biases where they are not the layer's own (a host layer's, copied
        into the staging span)."""
        hp, b, n, x, pdl = self.hp, self.buf, a.n, a.normed, self.pdl
        k = ids.shape[1]  # n_expert_used, or the GPU's share of a split row
        act = "swiglu_oai" if hp.swiglu_limit else hp.act
        g, u, d = f.gate, f.up, f.down
        gb, ub, db = biases or (g.bias, u.bias, d.bias)
        gp, up, dp = mats
        h = b["moe_h"][:n * k]
        if n == 1 and f.xq is not None:  # decode on the int8 copies (carve_kernels/gemv_q8.py)
            rows_out = b["moe_out"][:k]
            # the down launched with PDL, resident only once the gate/up's tiles are written
            # (``late``): made resident at the gate/up's start instead, the step lost 13 %
            # (carve_kernels/NOTES.md)
            scratch = None if self.t_count is None else (self.t_part.view(-1),
                                                         self.t_count.view(-1))
            moe_decode_q8.expert_glu_q8(gp, g.ggml_type, up, u.ggml_type, ne, f.xq, ids, h, act,
                                        gb, ub, hp.swiglu_limit, f.xq_h, use_pdl=pdl,
                                        late=f.xq_h is not None, scratch=scratch)
            if f.xq_h is not None:
                moe_decode_q8.expert_down_q8(dp, d.ggml_type, ne, f.xq_h, ids, w, a.proj,
                                             rows_out, db, accumulate=f.shared is not None,
                                             use_pdl=pdl, counter=b["moe_count"])
            else:
                moe_decode.expert_down(dp, d.ggml_type, ne, h, ids, w, a.proj, db,
                                       accumulate=f.shared is not None, config=f.down_config,
                                       use_pdl=pdl, rows_out=rows_out)
            return
        if n <= GEMV_ROWS:
            moe_decode.expert_glu(gp, g.ggml_type, up, u.ggml_type, ne, x, ids, h, act,
                                  gb, ub, hp.swiglu_limit, f.config, use_pdl=pdl)
            moe_decode.expert_down(dp, d.ggml_type, ne, h, ids, w, a.proj, db,
                                   accumulate=f.shared is not None, config=f.down_config,
                                   use_pdl=pdl, rows_out=b["moe_out"][:n * k]
                                   if moe_decode.DOWN_SPLIT else None)
            return
        rows, pos, tiles = b["moe_rows"][:n * k], b["moe_pos"][:n * k], b["moe_tiles"]
        # the router's logits are read by now: their span holds the sort's counts
        moe_prefill.sort_routes(ids, ne, rows, pos, tiles, b["moe_logits"][:n].view(torch.int32))
        moe_prefill.grouped_glu(gp, g.ggml_type, up, u.ggml_type, ne, x, ids, rows, tiles, h,
                                act, gb, ub, hp.swiglu_limit)
        out = b["moe_out"][:n * k]
        moe_prefill.grouped_down(dp, d.ggml_type, ne, h, tiles, out, db)
        moe.combine(out, pos, w, a.proj, accumulate=f.shared is not None)

    def _shared_expert(self, f: Ffn, a: Rows) -> None:
        # glm4moe's shared expert into proj, on views of ffn_up / ffn_act as wide as its rows
        # (n_ff_shexp, not the dense layers' n_ff)
        n, nf, x = a.n, f.gate.rows, a.normed
        act = self.buf["ffn_act"].view(-1)[: n * nf].view(n, nf)
        if gemv_rows(n, (f.gate, f.up), act) and f.fused == "gemv_glu":
            gemv_fused.gemv_glu(f.gate.packed, f.up.packed, f.gate.ggml_type, x, self.hp.act,
                                out=act, config=f.fused_config, use_pdl=self.pdl)
        else:
            gu = self.buf["ffn_up"].view(-1)[: 2 * n * nf].view(n, 2 * nf)
            self._linear(f.gate, x, gu[:, :nf])
            self._linear(f.up, x, gu[:, nf:])
            glu.glu(gu[:, :nf], gu[:, nf:], self.hp.act, out=act, use_pdl=self.pdl)
        self._linear(f.down, act, a.proj)

    def host_moved(self) -> int:
        """Bytes the stage's host layers have copied between the GPU and host memory."""
        return sum(h.moved for h in self._hosts())

    def host_cpu_s(self) -> float:
        """Seconds the CPU has spent computing the stage's host layers' experts."""
        return sum(h.cpu_s for h in self._hosts())

    def host_wait_s(self) -> float:
        """Seconds the host has waited for the GPU's rows of the stage's split layers."""
        return sum(h.wait_s for h in self._hosts())

    def cache_hits(self) -> tuple[int, int]:
        """(hits, misses) of the stage's expert cache so far."""
        caches = [h.cache for h in self._hosts() if h.cache is not None]
        return sum(c.hits for c in caches), sum(c.misses for c in caches)

    def _hosts(self) -> list[Any]:
        return [la.ffn.host for la in self.layers if getattr(la.ffn, "host", None) is not None]

    def eager_hosts(self) -> set[int]:
        """The host layers whose decode waits on the host (expert cache, CPU compute): the
        step's graph breaks around them. Layers read in place stay inside it."""
        return {la.index for la in self.layers
                if getattr(la.ffn, "host", None) is not None and la.ffn.host.in_place is None}

    def capturing(self) -> bool:
        return self.on_cuda and torch.cuda.is_current_stream_capturing()

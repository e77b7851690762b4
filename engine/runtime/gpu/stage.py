"""A GPU stage: layers [lb, le) of a model on one device, run with the Triton kernels of
``kernels/`` on the allocations of its DeviceLayout and nothing else. The llama family (llama,
mistral, qwen2 with q/k/v biases, qwen3 with per-head q/k RMSNorm) and gemma3 (embeddings
scaled by sqrt(n_embd), q/k norms, sandwich norms, GeGLU, sliding-window layers with their own
RoPE base) follow engine/runtime/models/ step for step.

Every tensor the stage touches is a view into one of the Layout's arenas (weights, globals, KV,
``buf.*`` activation buffers, ``dq.*`` dequant cache), so the memory it holds is the priced
memory. Decode runs one token through preallocated buffers and is captured once in a CUDA graph
that reads the token id and the position from device buffers; prefill runs in chunks of the
priced size with the dequant cache feeding bf16 GEMMs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import triton

from engine.runtime.models import FAMILIES
from engine.runtime.models.layers import _linear_scale
from kernels import attention, gemv_t, glu, kv_cache, norm, q8x, quant_matmul, rope
from spec import quant_types as qt
from spec.errors import CarveError

DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "i64": torch.int64, "i32": torch.int32, "uint8": torch.uint8}
ARCHS = tuple(FAMILIES)  # every family the CPU engine runs
# matrices the stage repacks into the T layout (kernels/gemv_t.py) for their decode GEMVs: the
# big single ones and the FFN pair (q, k and v follow their own rule: QKV below)
T_MATRICES = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_output.weight")
# on a GPU only matrices of at least this many bytes: below it the split rows' atomics cost more
# than the layout saves (H200, bf16 x: Qwen2-7B's 7.2 MB attn_output 8.4 -> 9.8 us in T,
# 0.5B's 2.4 MB ffn_down 5.8 -> 7.8 us; 32B's 14.7 MB attn_output 18.3 -> 14.3 us)
T_MIN_BYTES = 12 << 20
# q, k and v go to the T layout together (one launch, kernels/gemv_t.py gemv_t3) when all three
# can, whatever their size (on int8 x the one launch beats GGUF order's gemv3 even at 7B's 9.7
# MB: 9.1 against ~11.6 us on an H200)
QKV = ("attn_q.weight", "attn_k.weight", "attn_v.weight")


def new_arena(nbytes: int, device: torch.device) -> torch.Tensor:
    """The one place the GPU runner allocates device memory (tests wrap it to watch or fail)."""
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def allocate(dl: Any, device: torch.device | str, arenas: list[torch.Tensor] | None = None,
             spans: dict[str, torch.Tensor] | None = None,
             ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One uint8 allocation per Arena of the DeviceLayout; every span becomes a view into it
    (typed for float spans, raw bytes for GGUF-typed weights). ``arenas``/``spans``: the
    caller's containers, filled as it goes, so a failure midway leaves the caller holding
    (and able to drop) every arena already made."""
    arenas = [] if arenas is None else arenas
    spans = {} if spans is None else spans
    device = torch.device(device)
    for a in dl.arenas:
        buf = new_arena(a.nbytes, device)
        arenas.append(buf)
        for s in a.spans:
            raw = buf[s.offset:s.offset + s.nbytes]
            dt = DTYPES.get(s.dtype)
            if dt is not None and s.purpose != "weights" and s.purpose != "globals":
                raw = raw.view(dt).view(s.shape)
            spans[s.name] = raw
    return arenas, spans


class GpuStage:
    def __init__(self, hp: Any, model: Any, dl: Any, spans: dict[str, torch.Tensor],
                 device: torch.device | str, ctx: int, chunk: int) -> None:
        if hp.arch not in ARCHS:
            raise CarveError(f"the GPU stage runs {', '.join(ARCHS)} models; {hp.arch} runs on "
                             f"the CPU engine for now")
        if "rope_freqs.weight" in spans:  # gpu_session.why_not sends these to the torch engine
            raise CarveError("rope_freqs.weight (llama-3.1 RoPE factors) is not supported by "
                             "the Triton runner yet; run with CARVE_RUNNER=torch")
        # linear scaling of the global layers' RoPE, or the CPU engine's error for other kinds
        self.rope_scale = 1.0 / _linear_scale(hp)
        self.hp, self.model, self.spans = hp, model, spans
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"  # else the CPU under TRITON_INTERPRET=1
        self.lb, self.le = dl.layers
        self.first, self.last = dl.first, dl.last
        self.ctx, self.chunk = ctx, chunk
        self.buf = {n[4:]: t for n, t in spans.items() if n.startswith("buf.")}
        self.act = self.buf["hidden"].dtype
        self.q_w = hp.n_head * hp.head_dim
        self.kv_w = hp.n_head_kv * hp.head_dim
        self.graph: torch.cuda.CUDAGraph | None = None
        part, lse = self.buf["attn_partial"], self.buf["attn_lse"]
        self.attn_ws = (part, lse)
        self.attn_count = self.buf.get("attn_count")
        if self.attn_count is not None:
            self.attn_count.zero_()  # the decode kernel leaves it at zero after each use
        # the greedy id lives in the last slot of buf.tokens: nothing outside the Layout
        self.next_id = self.buf["tokens"][-1:] if self.last else None
        self.t_part, self.t_count = self.buf.get("t_part"), self.buf.get("t_count")
        if self.t_count is not None:
            self.t_count.zero_()  # the T GEMVs leave their counters at zero after each use
        # the matrices held in the T layout (set by fill_dequant_cache)
        self.tmats: set[str] = set()
        # decode's int8 copies of the T GEMVs' inputs (a normed row, the GLU output) for their
        # dp4a bodies (llama.cpp's activation rounding; Qwen2-7B tg128 324.6 -> 438.1 t/s on an
        # H200); CARVE_Q8X=0 keeps the bf16 x path
        self.xq = None
        e, f = hp.n_embd, hp.n_ff
        if (os.environ.get("CARVE_Q8X", "1") != "0" and "xq" in self.buf and not hp.sandwich_norm
                and e % 32 == 0 and f % 32 == 0):
            self.xq = (q8x.buffers(self.buf["xq"], self.buf["xq_ds"], e),
                       q8x.buffers(self.buf["xq"], self.buf["xq_ds"], f, e))

    def _t_eligible(self, name: str) -> bool:
        """Repack into the T layout: a T type with a dequant-cache copy (prefill reads that,
        never the packed bytes) that decode reads through one GEMV or the FFN pair, on a GPU
        at least T_MIN_BYTES (under the interpreter every such matrix, so that CI runs the
        path); q, k and v all three or none. Off with CARVE_T_LAYOUT=0 (the GGUF-order
        kernels)."""
        if os.environ.get("CARVE_T_LAYOUT", "1") == "0" or self.t_part is None:
            return False
        if name.endswith(QKV):
            p = name.rsplit("attn_", 1)[0]
            return all(self._t_able(p + s) for s in QKV)
        info = self.model.tensor(name)
        return (self._t_able(name) and (name == "output.weight" or name.endswith(T_MATRICES))
                and (info.nbytes >= T_MIN_BYTES or not self.on_cuda))

    def _t_able(self, name: str) -> bool:
        # a T type with a dequant-cache copy (the part of the rule that is not size or role)
        return "dq." + name in self.spans and self.model.tensor(name).ggml_type in gemv_t.WORDS

    # --- tensors -------------------------------------------------------------------------
    def mat(self, name: str) -> tuple[torch.Tensor, int]:
        info = self.model.tensor(name)
        raw = self.spans.get(name)
        if raw is None:
            raise CarveError(f"tensor {name} is not in this stage's Layout")
        return raw.view(info.shape[1], -1), info.ggml_type

    def vec(self, name: str) -> torch.Tensor | None:
        raw = self.spans.get(name)
        if raw is None:
            return None
        info = self.model.tensor(name)
        if info.ggml_type != qt.F32:
            raise CarveError(f"{name}: expected F32, the file has {qt.type_name(info.ggml_type)}")
        return raw.view(torch.float32)

    def fill_dequant_cache(self) -> int:
        """Dequantize every matrix that has a ``dq.`` span into it, and repack the T-layout
        matrices on the way (their GGUF bytes go through the still-empty dq span, so no
        memory outside the Layout); returns matrices cached."""
        n = 0
        for name, dst in self.spans.items():
            if not name.startswith("dq."):
                continue
            w, t = self.mat(name[3:])
            rows = w.shape[0]
            if self._t_eligible(name[3:]):
                g = dst.view(torch.uint8).reshape(-1)[: w.numel()].view(w.shape)
                g.copy_(w)
                gemv_t.repack(g, t, out=self.spans[name[3:]])
                self.tmats.add(name[3:])
                self._dequant_t(name[3:], t, rows, dst)
            else:
                quant_matmul.dequantize(w, t, dst.dtype, out=dst.view(rows, -1))
            n += 1
        return n

    def _dequant_t(self, name: str, t: int, rows: int, dst: torch.Tensor) -> None:
        # row slabs back into GGUF order through buf.ffn_up (free at load, wider than any row
        # of any matrix), each slab dequantized into its rows of dst
        wt = self.spans[name]
        scratch = self.buf["ffn_up"].view(torch.uint8).reshape(-1)
        row_bytes = wt.numel() // rows
        slab = max(1, scratch.numel() // row_bytes)
        out = dst.view(rows, -1)
        for r0 in range(0, rows, slab):
            r1 = min(rows, r0 + slab)
            g = gemv_t.unpack_rows(wt, t, rows, r0, r1, scratch)
            quant_matmul.dequantize(g, t, dst.dtype, out=out[r0:r1])

    def kv(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        k, v = self.spans[f"kv.{layer}.k"], self.spans[f"kv.{layer}.v"]
        return k, v, self.hp.kv_cells(layer, self.ctx)

    # --- one step ------------------------------------------------------------------------
    def _gemv_cfg(self, w: torch.Tensor) -> tuple[int, ...] | None:
        # the tuned tile on a GPU; under the CPU interpreter one program per matrix (each
        # program costs ~20 ms there whatever its size)
        return None if self.on_cuda else (min(512, triton.next_power_of_2(w.shape[0])), 16, 1)

    def _t_cfg(self, rows: int) -> tuple[int, int, int] | None:
        # the tuned config on a GPU; under the interpreter one program per matrix, no split
        return None if self.on_cuda else (min(512, triton.next_power_of_2(rows)), 1, 1)

    def _qkv(self, p: str, x: torch.Tensor, qkv: torch.Tensor) -> None:
        """q, k, v side by side in qkv; decode runs the three GEMVs (and biases) in one launch."""
        mats = [self.mat(f"{p}attn_{s}.weight") for s in "qkv"]
        biases = [self.vec(f"{p}attn_{s}.bias") for s in "qkv"]
        has = [b is not None for b in biases]
        if x.shape[0] <= 8 and (all(has) or not any(has)) and p + QKV[0] in self.tmats:
            gemv_t.gemv_t3([(self.spans[p + n], t, w.shape[0]) for n, (w, t) in zip(QKV, mats)],
                           x, qkv, self.t_part, self.t_count, biases if all(has) else None,
                           config=self._t_cfg(max(w.shape[0] for w, _ in mats)),
                           xq=self._q8(p + QKV[0], 0, x.shape[0]))
            return
        if x.shape[0] <= 8 and (all(has) or not any(has)):
            quant_matmul.gemv3(mats, x, qkv, biases if all(has) else None,
                               [self._gemv_cfg(w) for w, _ in mats])
            return
        o = 0
        for s, (w, _) in zip("qkv", mats):
            self._linear(f"{p}attn_{s}.weight", x, qkv[:, o:o + w.shape[0]], f"{p}attn_{s}.bias")
            o += w.shape[0]

    def _q8(self, name: str, slot: int, n: int):
        """The int8 copy (slot 0: a normed row, 1: the GLU output) that decode gives matrix
        ``name``, if it is a T matrix and CARVE_Q8X is on; else None."""
        if self.xq is None or n != 1 or name not in self.tmats:
            return None
        return self.xq[slot]

    def _ffn(self, p: str, x: torch.Tensor, ffn_up: torch.Tensor, ffn_act: torch.Tensor,
             xq=None):
        """act(gate) * up into ffn_act; decode runs both GEMVs and the GLU in one launch.
        ``xq``: x's int8 copy; returns the int8 copy of ffn_act if one was written."""
        (gw, gt), (uw, ut) = self.mat(p + "ffn_gate.weight"), self.mat(p + "ffn_up.weight")
        gn, un = p + "ffn_gate.weight", p + "ffn_up.weight"
        in_t = (gn in self.tmats) + (un in self.tmats)
        if x.shape[0] <= 8 and quant_matmul.can_pair(gw, gt, uw, ut) and in_t != 1:
            if in_t:
                oq = self._q8(p + "ffn_down.weight", 1, x.shape[0])
                gemv_t.gemv_t_glu(self.spans[gn], self.spans[un], gt, gw.shape[0], x, ffn_act,
                                  self.t_part, self.t_count, self.hp.act,
                                  config=self._t_cfg(gw.shape[0]), xq=xq, out_q=oq)
                return oq
            quant_matmul.gemv_glu(gw, uw, gt, x, self.hp.act, out=ffn_act,
                                  config=self._gemv_cfg(gw))
            return None
        f = self.hp.n_ff
        self._linear(p + "ffn_gate.weight", x, ffn_up[:, :f])
        self._linear(p + "ffn_up.weight", x, ffn_up[:, f:])
        glu.glu(ffn_up[:, :f], ffn_up[:, f:], self.hp.act, out=ffn_act)
        return None

    def _linear(self, name: str, x: torch.Tensor, out: torch.Tensor, bias: str | None = None,
                xq=None):
        w, t = self.mat(name)
        b = self.vec(bias) if bias else None
        if x.shape[0] <= 8 and name in self.tmats:
            gemv_t.gemv_t(self.spans[name], t, w.shape[0], x, out, self.t_part, self.t_count,
                          bias=b, config=self._t_cfg(w.shape[0]), xq=xq)
            return
        if x.shape[0] <= 8:
            # bias added in the same launch
            quant_matmul.gemv(w, t, x, out=out, bias=b, config=self._gemv_cfg(w))
            return
        else:
            # prefill only (not the captured decode step): one GEMM on the dequant cache's copy,
            # or on the matrix dequantized into buf.dequant
            c = self.spans.get("dq." + name)
            if c is None:
                c = self.buf["dequant"][: w.shape[0] * quant_matmul.row_cols(w, t)]
                quant_matmul.dequantize(w, t, c.dtype, out=c.view(w.shape[0], -1))
            c = c.view(w.shape[0], -1)
            if x.dtype == c.dtype == out.dtype:
                torch.matmul(x, c.T, out=out)  # bf16 activations (GPU): no temporaries
            else:
                out.copy_(x.to(c.dtype) @ c.T)
        if b is not None:
            out += b

    def forward(self, n: int, pos0: int | None, head: bool = True,
                check: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """Run layers on buf.hidden[:n] (first stage: embeds buf.tokens[:n] first). Positions
        are buf.positions[:n]; ``pos0`` is the host copy for prefill, None for decode (the
        graph-captured path, which reads the position from the device). ``head``: the last
        stage projects the last rows of buf.logits' height (see `head` for other rows).
        ``check(layer, hidden)``: called after every layer (the NaN hunt; not on the hot path)."""
        hp, b = self.hp, self.buf
        hidden, normed = b["hidden"][:n], b["normed"][:n]
        qkv, attn_o, proj = b["qkv"][:n], b["attn"][:n], b["proj"][:n]
        ffn_up, ffn_act = b["ffn_up"][:n], b["ffn_act"][:n]
        pos = b["positions"][:n]
        if self.first:
            w, t = self.mat("token_embd.weight")
            quant_matmul.embed(w, t, b["tokens"][:n], out=hidden)
            if hp.embed_scale != 1.0:
                hidden.mul_(hp.embed_scale)  # gemma3: sqrt(n_embd)
        pending = False  # proj holds a sub-layer output not yet added to hidden
        post = None  # gemma3: the norm proj gets before that add (sandwich norm)
        eps = hp.rms_eps
        d = hp.head_dim
        neox = hp.rope_style == "neox"
        for i in range(self.lb, self.le):
            p = f"blk.{i}."
            w_norm = self.vec(p + "attn_norm.weight")
            xq = self._q8(p + QKV[0], 0, n)
            if pending:
                self._add_norm(proj, post, w_norm, hidden, normed, xq)
            else:
                norm.rmsnorm(hidden, w_norm, eps, out=normed, q8=xq)
            q, k, v = (qkv[:, :self.q_w], qkv[:, self.q_w:self.q_w + self.kv_w],
                       qkv[:, self.q_w + self.kv_w:self.q_w + 2 * self.kv_w])
            self._qkv(p, normed, qkv[:, :self.q_w + 2 * self.kv_w])
            q3 = q.unflatten(1, (hp.n_head, d))
            k3 = k.unflatten(1, (hp.n_head_kv, d))
            v3 = v.unflatten(1, (hp.n_head_kv, d))
            # q and k heads sit side by side in buf.qkv: one launch norms (qwen3, gemma3) and
            # one rotates both
            qk3 = qkv[:, :self.q_w + self.kv_w].unflatten(1, (hp.n_head + hp.n_head_kv, d))
            if hp.qk_norm:
                norm.rmsnorm_heads(qk3, self.vec(p + "attn_q_norm.weight"),
                                   self.vec(p + "attn_k_norm.weight"), hp.n_head, eps)
            swa = bool(hp.swa_layers[i]) if hp.swa_layers else False
            # sliding-window layers: their own base, never scaled (engine/runtime/models/layers.py)
            base = hp.rope_base_swa if swa else hp.rope_base
            scale = 1.0 if swa else self.rope_scale
            kc, vc, cells = self.kv(i)
            window = hp.sliding_window if swa else 0
            o3 = attn_o.view(n, hp.n_head, d)
            fused = pos0 is None and rope.can_fuse_store(neox, kc, d)
            if fused:  # decode: rotation and the cache store of k and v in one launch
                rope.rope_store(qk3, v3, pos, base, neox, scale, hp.n_head, kc, vc, cells)
            else:
                rope.rope(qk3, pos, base, neox, scale)
            if pos0 is None:
                if not fused:
                    kv_cache.kv_store(k3, kc, pos, cells, v3, vc)
                attention.attn_decode(q3[0], kc, vc, pos, hp.n_head_kv, cells, window,
                                      hp.attn_scale, out=o3[0], workspace=self.attn_ws,
                                      counter=self.attn_count)
            else:
                if kc.dtype == torch.uint8:
                    # q8_0: the chunk attends its own keys/values as the cache gives them back
                    # (the CPU engine and llama.cpp do); the store below re-quantizes them
                    kv_cache.q8_roundtrip_(k3)
                    kv_cache.q8_roundtrip_(v3)
                attention.attn_prefill(q3, k3, v3, kc, vc, pos0, cells, window, hp.attn_scale,
                                       out=o3)
                # a ring keeps only the chunk's last `cells` rows: store only those, so that no
                # two programs write one cell
                s0 = max(0, n - cells)
                kv_cache.kv_store(k3[s0:], kc, pos[s0:], cells, v3[s0:], vc)
            self._linear(p + "attn_output.weight", attn_o, proj)
            post = self.vec(p + "post_attention_norm.weight") if hp.sandwich_norm else None
            xq = self._q8(p + "ffn_gate.weight", 0, n)
            self._add_norm(proj, post, self.vec(p + "ffn_norm.weight"), hidden, normed, xq)
            aq = self._ffn(p, normed, ffn_up, ffn_act, xq)
            self._linear(p + "ffn_down.weight", ffn_act, proj, xq=aq)
            post = self.vec(p + "post_ffw_norm.weight") if hp.sandwich_norm else None
            pending = True
            if check is not None:  # the residual stream after layer i (allocates: fine here)
                check(i, hidden + (proj if post is None else norm.rmsnorm(proj, post, eps)))
        if pending:
            if post is not None:
                norm.rmsnorm(proj, post, eps, out=proj)  # in place: one row per program
            hidden += proj
        if self.last and head:
            rows = b["logits"].shape[0]
            self.head(max(0, n - rows), min(n, rows))

    def _add_norm(self, x: torch.Tensor, post: torch.Tensor | None, w: torch.Tensor,
                  hidden: torch.Tensor, out: torch.Tensor, q8=None) -> None:
        """hidden += x (gemma3: rmsnorm(x) * post first), then out = rmsnorm(hidden) * w
        (and its int8 copy into ``q8``; never with post: the stage keeps it off for gemma3)."""
        if post is None:
            norm.rmsnorm(x, w, self.hp.rms_eps, residual=hidden, out=out, q8=q8)
        else:
            norm.rmsnorm_post(x, post, w, self.hp.rms_eps, residual=hidden, out=out)

    def head(self, r0: int, rows: int) -> torch.Tensor:
        """Output norm and projection of buf.hidden[r0:r0+rows] into buf.logits[:rows]
        (rows <= the logits buffer's height); returns that logits view."""
        b = self.buf
        h, normed = b["hidden"][r0:r0 + rows], b["normed"][:rows]
        name = "output.weight" if "output.weight" in self.spans else "token_embd.weight"
        xq = self._q8(name, 0, rows)
        norm.rmsnorm(h, self.vec("output_norm.weight"), self.hp.rms_eps, out=normed, q8=xq)
        out = b["logits"][:rows]
        if rows > 8 and normed.dtype != out.dtype:
            # a GEMM in bf16 would need a [rows, n_vocab] temporary outside the Layout before
            # the f32 logits: run the fused GEMV 8 rows at a time instead
            for s in range(0, rows, 8):
                self._linear(name, normed[s:s + 8], out[s:s + 8])
        else:
            self._linear(name, normed, out, xq=xq)
        return out

    def decode_step(self) -> None:
        """One token: buf.tokens[0] at buf.positions[0]; leaves logits (last stage) and, on the
        last stage, the greedy next id in ``next_id``; advances the device position."""
        self.forward(1, None)
        if self.last:
            torch.argmax(self.buf["logits"][0], dim=-1, keepdim=True, out=self.next_id)
            if self.first:  # one stage: feed the token back without leaving the graph
                self.buf["tokens"][:1].copy_(self.next_id)
        self.buf["positions"][:1] += 1

    def capture(self) -> None:
        """Capture decode_step in a CUDA graph (after one eager warm-up that compiles kernels).
        On the CPU (interpreter) there is no graph: replay runs decode_step eagerly."""
        if not self.on_cuda:
            return
        s = torch.cuda.Stream(self.device)
        s.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(s):
            self.decode_step()
        torch.cuda.current_stream(self.device).wait_stream(s)
        self.graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph's default capture stream is created once, on the first device that
        # captures; a second GPU's stage needs a stream of its own device
        with torch.cuda.graph(self.graph, stream=torch.cuda.Stream(self.device)):
            self.decode_step()

    def release(self) -> None:
        """Drop every view into the arenas this stage holds (and its graph), so that freeing
        the arenas frees the memory."""
        self.graph = None
        self.spans = {}
        self.buf = {}
        self.attn_ws = ()
        self.next_id = None
        self.t_part = self.t_count = None
        self.tmats = set()
        self.xq = None

    def replay(self) -> None:
        if self.graph is None:
            self.decode_step()
        else:
            self.graph.replay()

"""What a GPU stage runs for each of its layers, decided once at load: every tensor a view into
the Layout's spans, and for every matrix the kernels that multiply by it (the T layout's GEMV or
GGUF order's, on int8 or float x; q/k/v and the FFN pair in one launch or not; where prefill's
GEMM reads it). `GpuStage.forward` follows these decisions and makes none of its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import triton

from carve_kernels import (
    gemv_fused,
    gemv_t,
    gemv_t3,
    moe_decode,
    moe_decode_q8,
    q8x,
    quant_matmul,
    rope,
    t_layout,
)
from engine.runtime.gpu.layers import Attention, Experts, Ffn, Latent, Layer, Matrix
from engine.runtime.options import RunnerOptions
from spec import quant_types as qt
from spec.errors import CarveError

# matrices the stage repacks into the T layout (carve_kernels/gemv_t.py) for their decode GEMVs: the
# big single ones and the FFN pair (q, k and v follow their own rule: QKV below)
T_MATRICES = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight", "attn_output.weight")
# on a GPU only matrices of at least this many bytes: below it the split rows' atomics cost more
# than the layout saves (H200, bf16 x: Qwen2-7B's 7.2 MB attn_output 8.4 -> 9.8 us in T,
# 0.5B's 2.4 MB ffn_down 5.8 -> 7.8 us; 32B's 14.7 MB attn_output 18.3 -> 14.3 us)
T_MIN_BYTES = 12 << 20
# q, k and v go to the T layout together (one launch, carve_kernels/gemv_t3.py) when all
# three can, whatever their size (on int8 x the one launch beats GGUF order's gemv3 even at 7B's 9.7
# MB: 9.1 against ~11.6 us on an H200)
QKV = ("attn_q.weight", "attn_k.weight", "attn_v.weight")
# attn_output types put in the T layout on the attention's int8 copy (the attention then lets
# attn_output's programs in only after its partials, carve_kernels/attention.py attn_decode):
# those whose GGUF-order GEMV on bf16 x is slow, every grid IQ type and IQ4_XS. Measured on an
# H100 on 2026-12-07, tg128, against CARVE_ATTN_Q8=0 in one lease: the IQ3_XXS mix 468.8
# against 404.1 t/s, IQ2_M 466.4 against 404.2, IQ2_XS 506.9 against 452.1, all IQ1_S 521.8
# against 466.7; the IQ2_XXS mix 516.7 and the IQ3_S mix 418.9 against 494.7 and 395.5 before
# this rule. The K types lost with it, twice (carve_kernels/NOTES.md, "Tried and rejected":
# attn_q8_k)
ATTN_Q8_TYPES = gemv_t.GRID_SMEM | {qt.IQ4_XS}


def packed(model: Any, spans: dict[str, torch.Tensor], name: str, meta: bool = False
           ) -> tuple[torch.Tensor, int]:
    """Matrix ``name``'s span as [rows, bytes per row], and its GGUF type. ``meta``: a tensor
    of that shape on the meta device instead (host experts the CPU computes from its own
    layout: the GPU never reads them, and a launch on one fails loudly)."""
    info = model.tensor(name)
    raw = spans.get(name)
    if raw is None:
        raise CarveError(f"tensor {name} is not in this stage's Layout")
    rows = 1
    for d in info.shape[1:]:  # a 3-D expert tensor: every expert's rows, expert after expert
        rows *= d
    if meta:
        return torch.empty(rows, info.nbytes // rows, dtype=torch.uint8,
                           device="meta"), info.ggml_type
    return raw.view(rows, -1), info.ggml_type


class LayerBuilder:
    """Resolves a stage's tensors in its spans and decides each matrix's kernels.
    ``xq``: the stage's int8 copies of decode's x (carve_kernels/q8x.py: a normed row, the GLU
    output, a MoE layer's routed GLU outputs), or None where decode stays on float x."""

    def __init__(self, hp: Any, model: Any, spans: dict[str, torch.Tensor], ctx: int,
                 on_cuda: bool, options: RunnerOptions, xq: tuple | None,
                 rope_scale: float, yarn: tuple[torch.Tensor | None, float] = (None, 1.0),
                 cpu_layers: frozenset[int] = frozenset()) -> None:
        self.hp, self.model, self.spans, self.ctx = hp, model, spans, ctx
        # layers whose routed experts the CPU computes from its own layouts (host_compute
        # "cpu"): their spans hold those, so the GPU's matrices are shapes only (`packed`)
        self.cpu_layers = cpu_layers
        self.on_cuda, self.options, self.xq, self.rope_scale = on_cuda, options, xq, rope_scale
        self.rope_dim = getattr(hp, "rope_dim", 0) or hp.head_dim
        # (the global layers' frequencies in buf.rope_freqs, cos/sin scale) or (None, 1.0)
        self.yarn = yarn
        # gpt-oss and glm4moe name their pre-FFN norm post_attention_norm (llama.cpp's names)
        self.ffn_norm = ("post_attention_norm.weight" if hp.arch in ("gpt-oss", "glm4moe")
                         else "ffn_norm.weight")
        # the matrices held in the T layout
        self.tmats = {n[3:] for n in spans if n.startswith("dq.") and self._t_eligible(n[3:])}

    # --- the T layout --------------------------------------------------------------------
    def _t_eligible(self, name: str) -> bool:
        """Repack into the T layout: a T type with a dequant-cache copy (prefill reads that,
        never the packed bytes) that decode reads through one GEMV or the FFN pair, on a GPU
        at least T_MIN_BYTES (under the interpreter every such matrix, so that CI runs the
        path); q, k and v all three or none. Never with the T layout off (RunnerOptions)."""
        if not self.options.t_layout or "buf.t_part" not in self.spans:
            return False
        if name.endswith(QKV):  # one launch: blocks of one size
            p = name.rsplit("attn_", 1)[0]
            if not all(p + s in self.spans for s in QKV):
                return False  # deepseek2's attn_q beside its latent matrices: GGUF order
            sizes = {t_layout.BLOCK_VALUES.get(self.model.tensor(p + s).ggml_type, 256)
                     for s in QKV if p + s in self.spans}
            return all(self._t_able(p + s) for s in QKV) and len(sizes) == 1
        if getattr(self.hp, "fused_gate_up", False) and name.endswith("ffn_up.weight"):
            return False  # gate|up in one tensor: GGUF order, cut into two row ranges
        info = self.model.tensor(name)
        return (self._t_able(name) and (name == "output.weight" or name.endswith(T_MATRICES))
                and (info.nbytes >= T_MIN_BYTES or not self.on_cuda
                     or (name.endswith("attn_output.weight") and self._attn_q8(name))))

    def _attn_q8(self, name: str) -> bool:
        # decode's attention writes an int8 copy of its output (into the GLU output's int8
        # slot, free until the GLU) for attn_output ``name`` of a type of
        # ATTN_Q8_TYPES, which then takes the T layout whatever its size: heads of whole
        # 32-value groups, the merging programs (buf.attn_count), and a slot wide enough
        hp = self.hp
        return (self.options.attn_q8 and self.xq is not None
                and name in self.spans and self.model.tensor(name).ggml_type in ATTN_Q8_TYPES
                and "buf.attn_count" in self.spans and hp.head_dim_v % 32 == 0
                and hp.head_dim_v == hp.head_dim
                and q8x.fits(self.xq[1], hp.n_head * hp.head_dim_v)
                and not getattr(hp, "kv_lora_rank", 0))

    def _t_able(self, name: str) -> bool:
        # a T type with a dequant-cache copy (the part of the rule that is not size or role)
        t = self.model.tensor(name).ggml_type
        return "dq." + name in self.spans and t in t_layout.WORDS

    def _int8_x(self, name: str, slot: int) -> tuple | None:
        """The int8 copy decode gives matrix ``name`` (slot 0: a normed row, 1: the GLU
        output): a T matrix and a row-body type's (``quant_matmul.ROW_BODY_TYPES``: the grid IQ
        types, IQ4_XS; Q2_K and Q8_0 with their trials) multiply int8 x; a GEMV whose body
        does not run (a Q8_0 weight off a 4-byte boundary) ignores the copy and reads x, which
        the norm writes too."""
        if self.xq is None or name not in self.spans:
            return None
        if (name in self.tmats
                or self.model.tensor(name).ggml_type in quant_matmul.ROW_BODY_TYPES):
            return self.xq[slot]
        return None

    # --- tensors -------------------------------------------------------------------------
    def vec(self, name: str) -> torch.Tensor | None:
        raw = self.spans.get(name)
        if raw is None:
            return None
        info = self.model.tensor(name)
        if info.ggml_type != qt.F32:
            raise CarveError(f"{name}: expected F32, the file has {qt.type_name(info.ggml_type)}")
        return raw.view(torch.float32)

    def rows_of(self, name: str, sizes: Sequence[int], bias: str | None = None
                ) -> tuple[Matrix, ...]:
        """Matrix ``name`` cut into consecutive row ranges of ``sizes`` (phi3's fused q/k/v and
        gate/up): views of its packed bytes and dequant-cache copy (such a matrix stays in GGUF
        order), each a Matrix of its own under the fused tensor's name."""
        w, t = packed(self.model, self.spans, name)
        dq = self.spans.get("dq." + name)
        dq = None if dq is None else dq.view(w.shape[0], -1)
        b = self.vec(bias) if bias else None
        out, r0 = [], 0
        for n in sizes:
            rows = w[r0:r0 + n]
            out.append(Matrix(name, t, rows, None, None if dq is None else dq[r0:r0 + n],
                              None if b is None else b[r0:r0 + n], self._config(rows)))
            r0 += n
        if r0 != w.shape[0]:
            raise CarveError(f"tensor {name} has {w.shape[0]} rows, not the {r0} its parts need")
        return tuple(out)

    def matrix(self, name: str, bias: str | None = None) -> Matrix:
        w, t = packed(self.model, self.spans, name)
        dq = self.spans.get("dq." + name)
        t_bytes = self.spans[name] if name in self.tmats else None
        return Matrix(name, t, w, t_bytes, None if dq is None else dq.view(w.shape[0], -1),
                      self.vec(bias) if bias else None,
                      self._t_config(w.shape[0]) if t_bytes is not None else self._config(w))

    def _config(self, w: torch.Tensor) -> tuple[int, ...] | None:
        # the tuned tile on a GPU; under the CPU interpreter one program per matrix (each
        # program costs ~20 ms there whatever its size)
        return None if self.on_cuda else (min(512, triton.next_power_of_2(w.shape[0])), 16, 1)

    def _t_config(self, rows: int) -> tuple[int, int, int] | None:
        # the tuned config on a GPU; under the interpreter one program per matrix, no split
        return None if self.on_cuda else (min(512, triton.next_power_of_2(rows)), 1, 1)

    def head(self) -> tuple[torch.Tensor, Matrix, tuple | None]:
        """The output norm, the output projection (the embedding where the file ties them)
        and the int8 copy of decode's normed row it multiplies."""
        name = "output.weight" if "output.weight" in self.spans else "token_embd.weight"
        return self.vec("output_norm.weight"), self.matrix(name), self._int8_x(name, 0)

    # --- layers --------------------------------------------------------------------------
    def layer(self, i: int) -> Layer:
        moe = getattr(self.hp, "is_moe_layer", None)
        return Layer(i, self.attention(i), self.experts(i) if moe and moe(i) else self.ffn(i))

    def latent(self, i: int) -> Latent:
        """A deepseek2 layer's latent attention."""
        hp, p = self.hp, f"blk.{i}."
        lora = bool(hp.q_lora_rank)
        legacy = hp.mla_legacy
        return Latent(
            norm=self.vec(p + "attn_norm.weight"),
            q=None if lora else self.matrix(p + "attn_q.weight"),
            q_a=self.matrix(p + "attn_q_a.weight") if lora else None,
            q_a_norm=self.vec(p + "attn_q_a_norm.weight") if lora else None,
            q_b=self.matrix(p + "attn_q_b.weight") if lora else None,
            kv_a=self.matrix(p + "attn_kv_a_mqa.weight"),
            kv_norm=self.vec(p + "attn_kv_a_norm.weight"),
            k_b=self.matrix(p + ("attn_kv_b.weight" if legacy else "attn_k_b.weight")),
            v_b=None if legacy else self.matrix(p + "attn_v_b.weight"),
            cache=self.spans[f"kv.{i}.k"], cells=hp.kv_cells(i, self.ctx),
            rope_base=hp.rope_base, rope_scale=self.rope_scale,
            rope_freqs=self.yarn[0], rope_mscale=self.yarn[1],
            temperature=((hp.attn_temp_scale, hp.attn_temp_length) if hp.attn_temp_scale
                         else None),
            output=self.matrix(p + "attn_output.weight"))

    def attention(self, i: int) -> Attention | Latent:
        hp, p = self.hp, f"blk.{i}."
        if getattr(hp, "kv_lora_rank", 0):
            return self.latent(i)
        if getattr(hp, "fused_qkv", False):  # phi3: q, k and v are row ranges of attn_qkv
            qkv = self.rows_of(p + "attn_qkv.weight", (hp.n_head * hp.head_dim,
                                                       hp.n_head_kv * hp.head_dim,
                                                       hp.n_head_kv * hp.head_dim_v),
                               p + "attn_qkv.bias")
        else:
            qkv = tuple(self.matrix(p + n, p + n.replace(".weight", ".bias")) for n in QKV)
        fused, mats, biases, config = self._qkv_launch(qkv)
        k, v = self.spans[f"kv.{i}.k"], self.spans[f"kv.{i}.v"]
        swa = bool(hp.swa_layers[i]) if hp.swa_layers else False
        # partial RoPE rotates a view of each head: the fused store writes whole heads
        rope_store = (rope.can_fuse_store(hp.rope_style == "neox", k, hp.head_dim)
                      and self.rope_dim == hp.head_dim)
        whole = getattr(hp, "qk_norm_whole", False)
        return Attention(
            norm=self.vec(p + "attn_norm.weight"), xq=self._qkv_int8_x(p), qkv=qkv,
            fused=fused, fused_mats=mats, fused_biases=biases, fused_config=config,
            q_norm=self.vec(p + "attn_q_norm.weight") if hp.qk_norm else None,
            k_norm=self.vec(p + "attn_k_norm.weight") if hp.qk_norm else None,
            k_cache=k, v_cache=v, cells=hp.kv_cells(i, self.ctx), kv_q8=k.dtype == torch.uint8,
            # sliding-window layers: their own base, never scaled (engine/runtime/models/layers.py)
            window=hp.sliding_window if swa else 0,
            rope_base=hp.rope_base_swa if swa else hp.rope_base,
            rope_scale=1.0 if swa else self.rope_scale,
            rope_store=rope_store,
            # whole-vector q/k norms (minimax-m2) run between q/k/v and the rotation
            qk_norm_in_rope=rope_store and hp.qk_norm and not whole,
            rope_in_qkv=(rope_store and fused == "t3" and not whole
                         and gemv_t3.rope_fits([m.rows for m in qkv], hp.head_dim, config)),
            # YaRN's frequencies serve every layer (gpt-oss); the file's factors the global ones
            rope_dim=self.rope_dim,
            rope_freqs=self.yarn[0] if hp.rope_scaling == "yarn" or not swa else None,
            rope_mscale=self.yarn[1] if hp.rope_scaling == "yarn" or not swa else 1.0,
            sinks=self.vec(p + "attn_sinks.weight") if getattr(hp, "attn_sinks", False) else None,
            output=self.matrix(p + "attn_output.weight", p + "attn_output.bias"),
            post_norm=self.vec(p + "post_attention_norm.weight") if hp.sandwich_norm else None,
            xq_o=(self._int8_x(p + "attn_output.weight", 1)
                  if self._attn_q8(p + "attn_output.weight") else None))

    def _qkv_int8_x(self, p: str) -> tuple | None:
        # the normed row's int8 copy when any of q, k, v (or phi3's attn_qkv) multiplies it
        return next((x for x in (self._int8_x(p + n, 0) for n in (*QKV, "attn_qkv.weight"))
                     if x is not None), None)

    def _qkv_launch(self, qkv: tuple[Matrix, Matrix, Matrix]) -> tuple[str, list, Any, Any]:
        """Decode's q/k/v in one launch when the three have biases or none have: T when they
        are in the T layout (all three or none are), else GGUF order's gemv3."""
        has = [m.bias is not None for m in qkv]
        if any(has) and not all(has):
            return "", [], None, None
        biases = [m.bias for m in qkv] if all(has) else None
        if qkv[0].t_bytes is not None:
            return ("t3", [(m.t_bytes, m.ggml_type, m.rows) for m in qkv], biases,
                    self._t_config(max(m.rows for m in qkv)))
        return "gemv3", [(m.packed, m.ggml_type) for m in qkv], biases, [m.config for m in qkv]

    def ffn(self, i: int) -> Ffn:
        hp, p = self.hp, f"blk.{i}."
        if getattr(hp, "fused_gate_up", False):  # phi3: gate and up are ffn_up's two halves
            gate, up = self.rows_of(p + "ffn_up.weight", (hp.n_ff, hp.n_ff))
        else:
            gate, up = self.matrix(p + "ffn_gate.weight"), self.matrix(p + "ffn_up.weight")
        fused, config = self._ffn_launch(gate, up)
        return Ffn(norm=self.vec(p + self.ffn_norm), xq=self._int8_x(gate.name, 0),
                   gate=gate, up=up, down=self.matrix(p + "ffn_down.weight"), fused=fused,
                   fused_config=config, xq_down=self._int8_x(p + "ffn_down.weight", 1),
                   post_norm=self.vec(p + "post_ffw_norm.weight") if hp.sandwich_norm else None)

    def _ffn_launch(self, gate: Matrix, up: Matrix) -> tuple[str, Any]:
        """Decode's gate, up and GLU in one launch when the pair has one type and shape and
        both or neither are in the T layout."""
        in_t = (gate.t_bytes is not None) + (up.t_bytes is not None)
        if in_t == 1 or not gemv_fused.can_pair(gate.packed, gate.ggml_type, up.packed,
                                                up.ggml_type):
            return "", None
        if in_t:
            return "t_glu", self._t_config(gate.rows)
        return "gemv_glu", gate.config

    def experts(self, i: int) -> Experts:
        """A mixture-of-experts layer's FFN: router, routed experts, shared expert (glm4moe)."""
        hp, p = self.hp, f"blk.{i}."
        mats = [self._expert_matrix(p + f"ffn_{n}_exps", i in self.cpu_layers)
                for n in ("gate", "up", "down")]
        shared = None
        if hp.n_expert_shared:
            gate, up = self.matrix(p + "ffn_gate_shexp.weight"), self.matrix(p + "ffn_up_shexp.weight")
            fused, config = self._ffn_launch(gate, up)
            shared = Ffn(norm=self.vec(p + self.ffn_norm), xq=None, gate=gate, up=up,
                         down=self.matrix(p + "ffn_down_shexp.weight"), fused=fused,
                         fused_config=config, xq_down=None, post_norm=None)
        return Experts(norm=self.vec(p + self.ffn_norm),
                       router=self.vec(p + "ffn_gate_inp.weight").view(hp.n_expert, hp.n_embd),
                       router_bias=self.vec(p + "ffn_gate_inp.bias"),
                       sel_bias=self.vec(p + "exp_probs_b.bias"),
                       gate=mats[0], up=mats[1], down=mats[2],
                       config=self._expert_config(mats[0], hp.n_ff_exp, "glu"),
                       down_config=self._expert_config(mats[2], hp.n_embd, "down"),
                       shared=shared, **self._expert_int8_x(mats))

    def _expert_int8_x(self, mats: list[Matrix]) -> dict:
        """The routed experts' int8 copies (Experts.xq, xq_h) where their types have a GGUF-order
        int8-x body (carve_kernels/gemv_q8.py: Q4_K, Q6_K, MXFP4): gate and up both, then down
        too."""
        hp = self.hp
        g, u, d = mats
        if (self.xq is None or not self.options.expert_q8
                or not all(moe_decode_q8.q8_able(m.ggml_type, hp.n_embd) for m in (g, u))):
            return {}
        routed = self.xq[2]
        able = routed is not None and moe_decode_q8.q8_able(d.ggml_type, hp.n_ff_exp)
        return {"xq": self.xq[0], "xq_h": routed if able and hp.n_ff_exp % 32 == 0 else None}

    def _expert_matrix(self, stem: str, meta: bool = False) -> Matrix:
        w, t = packed(self.model, self.spans, stem + ".weight", meta)
        return Matrix(stem + ".weight", t, w, None, None, self.vec(stem + ".bias"), None)

    def _expert_config(self, m: Matrix, rows: int, part: str) -> tuple[int, ...]:
        # the type's tuned tile for one expert's shape on a GPU (not the whole tensor's: its
        # many rows would pick the wide tile); under the interpreter one program per expert
        if self.on_cuda:
            return moe_decode.expert_config(m.ggml_type, rows,
                                            quant_matmul.row_cols(m.packed, m.ggml_type), part)
        return (min(512, triton.next_power_of_2(rows)), 16, 1)

"""The one list of activation buffers a stage allocates; pricing sizes it, runtimes allocate it.

Sized for the prefill chunk (the widest pass); decode uses the first row of each. Buffers are
reused across layers, so a stage holds one set whatever its layer count. Anything a runtime
allocates on a device that is not in this list (or in the Layout) breaks "priced == loaded":
even one tiny tensor costs a 2 MiB caching-allocator segment on a GPU.

Attention is flash-style in prefill (scores live in registers/tiles, never a
[heads, chunk, ctx] matrix) and split-K in decode (partials below).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any

from engine.gguf.hparams import rope_per_pair
from spec import launch
from spec.launch import ATTN_SPLITS

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "i64": 8, "i32": 4, "uint8": 1}


@dataclass(frozen=True, slots=True)
class BufferSpec:
    name: str  # allocated as span "buf.<name>"
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * DTYPE_BYTES[self.dtype]


def activation_buffers(
    hp: Any,
    chunk: int,
    act_dtype: str,
    n_vocab_rows: int,
    dequant_scratch: int = 0,
) -> list[BufferSpec]:
    """Buffers for one stage of a model with hyper-parameters `hp` (engine.gguf.hparams.HParams).

    chunk: prefill chunk (tokens per forward). n_vocab_rows: rows of logits this stage keeps
    (0 on every stage but the last; 1 for generation; the chunk for perplexity).
    dequant_scratch: elements of the largest matrix this stage dequantizes on the fly (not in
    the dequant cache); 0 when every matrix is cached or nothing needs a GEMM.
    """
    a = act_dtype
    # the FFN buffers serve the dense layers and a shared expert (glm4moe) alike
    e, f = hp.n_embd, max(hp.n_ff, getattr(hp, "n_ff_shexp", 0))
    q_width = hp.n_head * hp.head_dim
    kv_width = hp.n_head_kv * hp.head_dim + hp.n_head_kv * hp.head_dim_v
    kv_k = hp.n_head_kv * hp.head_dim
    attn_width = hp.n_head * hp.head_dim_v
    partial_width = hp.head_dim_v
    if getattr(hp, "kv_lora_rank", 0):
        # latent attention (deepseek2): buf.qkv holds each token's q (n_head x head_dim), its
        # latent row (kv_lora + rope_dim), the queries carried into the latent space (n_head x
        # kv_lora; later the heads' outputs) and attn_q_a's output (q_lora_rank); buf.attn
        # the heads' attention-weighted latents; the split-K partials are latent-wide (a power
        # of two: carve_kernels/latent.py workspace_width)
        c = hp.kv_lora_rank
        row = c + hp.rope_dim
        q_width = hp.n_head * (hp.head_dim + c) + getattr(hp, "q_lora_rank", 0)
        kv_width = kv_k = row
        attn_width = hp.n_head * max(hp.head_dim_v, c)
        partial_width = max(16, 1 << (c - 1).bit_length())
    out = [
        BufferSpec("tokens", (chunk,), "i64"),  # [chunk] token ids (first stage embeds them)
        BufferSpec("positions", (chunk,), "i64"),  # [chunk] absolute positions for RoPE / KV rows
        BufferSpec(
            "hidden", (chunk, e), a
        ),  # [chunk, n_embd] residual stream; recv from prior stage
        BufferSpec("normed", (chunk, e), a),  # [chunk, n_embd] RMSNorm output, GEMM input
        BufferSpec("qkv", (chunk, q_width + kv_width), a),  # [chunk, q | k | v] projections
        BufferSpec("attn", (chunk, attn_width), a),  # [chunk, n_head*head_dim_v]
        BufferSpec(
            "proj", (chunk, e), a
        ),  # [chunk, n_embd] o-proj / ffn-down out, before residual add
        BufferSpec("ffn_up", (chunk, 2 * f), a),  # [chunk, gate | up]
        BufferSpec("ffn_act", (chunk, f), a),  # [chunk, n_ff] act(gate) * up
        BufferSpec(
            "attn_partial", (hp.n_head, ATTN_SPLITS, partial_width), "f32"
        ),  # split-K decode
        BufferSpec("attn_lse", (hp.n_head, ATTN_SPLITS), "f32"),  # per split log-sum-exp
        # per kv head: split-K programs done, so that the last one merges (kept at zero);
        # one 256-byte line per counter, so that the heads' atomics do not share a line
        BufferSpec("attn_count", (hp.n_head_kv, 64), "i32"),
    ]
    # T-layout decode GEMVs (carve_kernels/gemv_t.py), up to 8 rows: the float32 sums of programs
    # that split a row's blocks, one row per split, and a counter per row tile (left zero),
    # for the largest of the launches decode can make (spec/launch.py, the same rule)
    # (every config a type's launch may take: spec/launch.py t_config)
    launches = [launch.scratch([q_width, kv_k, kv_width - kv_k], e, launch.T_CONFIG)]  # q, k, v
    for glu, one in ((launch.T_GLU_CONFIG, launch.T_CONFIG),
                     (launch.T_CONFIG_LOWBIT, launch.T_CONFIG_LOWBIT)):
        launches += [
            launch.scratch([f], e, glu, parts=2),  # gate | up
            launch.scratch([e], f, one),  # ffn_down
            launch.scratch([e], hp.n_head * hp.head_dim_v, one),  # attn_output
        ]
        if n_vocab_rows > 0:
            launches.append(launch.scratch([hp.n_vocab], e, one))  # the head
    part, count = (-(-max(1, *v) // 64) * 64 for v in zip(*launches))  # whole 256-byte lines
    out += [BufferSpec("t_part", (8, part), "f32"), BufferSpec("t_count", (8, count), "i32")]
    # decode's int8 copies of the T GEMVs' inputs (carve_kernels/q8x.py): the normed row (n_embd)
    # and the GLU output (n_ff; a MoE layer's k routed GLU outputs, k x n_ff_exp, where wider)
    # side by side, each as int8 words plus a scale and a sum per 32 (rounded to 1024 values:
    # both spans whole 256-byte arena slots)
    glu_w = max(f, getattr(hp, "n_expert_used", 0) * getattr(hp, "n_ff_exp", 0))
    q8 = -(-(-(-e // 32) * 32 + -(-glu_w // 32) * 32) // 1024) * 1024
    out += [BufferSpec("xq", (q8 // 4,), "i32"), BufferSpec("xq_ds", (2, q8 // 32), "f32")]
    # the IQ types' value tables and the load's scale-scan flags (spec/launch.py LOOKUP_BYTES)
    out.append(BufferSpec("lookup", (launch.LOOKUP_BYTES,), "uint8"))
    if n_vocab_rows > 0:
        out.append(BufferSpec("logits", (n_vocab_rows, hp.n_vocab), "f32"))  # [rows, n_vocab]
        # the GPU sampler (carve_kernels/sample.py): each first-pass program's best candidates as
        # (value, id) keys, and its settings, history ring and ring of sampled ids
        out.append(BufferSpec("samp_keys", (launch.SAMPLE_KEYS,), "i64"))
        out.append(BufferSpec("samp_state", (-(-launch.SAMPLE_STATE // 64) * 64,), "i32"))  # whole 256-byte lines
    if dequant_scratch > 0:
        # [elements] one matrix dequantized for a prefill GEMM, reused matrix after matrix
        out.append(BufferSpec("dequant", (dequant_scratch,), a))
    if rope_per_pair(hp):
        # the frequency per rotated pair, written once at load: YaRN's (gpt-oss), or the
        # file's factors applied (llama-3.1's rope_freqs, phi3's LongRoPE)
        out.append(BufferSpec("rope_freqs", ((getattr(hp, "rope_dim", 0) or hp.head_dim) // 2,),
                              "f32"))
    return out + moe_buffers(hp, chunk, act_dtype)


def moe_buffers(hp: Any, chunk: int, act_dtype: str) -> list[BufferSpec]:
    """The routed-expert buffers of a mixture-of-experts stage (carve_kernels/moe.py), sized for the
    chunk's ``chunk * n_expert_used`` routed rows; none for a dense model. Experts are read in
    their GGUF bytes in decode and prefill alike: no dequantized copy, no scratch."""
    n_expert = getattr(hp, "n_expert", 0)
    if not n_expert:
        return []
    k = hp.n_expert_used
    routed = chunk * k  # routed rows: row m * k + j is token m's j-th expert
    return [
        BufferSpec("moe_logits", (chunk, n_expert), "f32"),  # [chunk, n_expert] router logits
        BufferSpec("moe_ids", (chunk, k), "i32"),  # [chunk, k] chosen experts
        BufferSpec("moe_w", (chunk, k), "f32"),  # [chunk, k] their weights
        BufferSpec("moe_h", (routed, hp.n_ff_exp), act_dtype),  # [routed, n_ff_exp] act(g) * u
        # prefill: routed rows sorted by expert (sorted place -> row, row -> place), the tiles
        # of one expert each the grouped GEMMs run on ([expert, first, end] x tiles), and the
        # down projections per sorted row before the weighted sum into each token
        BufferSpec("moe_rows", (routed,), "i32"),
        BufferSpec("moe_pos", (routed,), "i32"),
        BufferSpec("moe_tiles", (3, launch.moe_tiles(routed, n_expert)), "i32"),
        BufferSpec("moe_out", (routed, hp.n_embd), "f32"),  # [routed, n_embd]
        # decode's counters, kept at zero between launches (whole 256-byte lines): one per 16
        # output rows (down's smallest tile), down's last expert program of a row tile adding
        # the k rows; then 64 more, the last of them the fused FFN norm and router's
        # (moe.norm_router: its last program writes the residual stream back)
        BufferSpec("moe_count", (-(-hp.n_embd // 1024) * 64 + 64,), "i32"),
    ]

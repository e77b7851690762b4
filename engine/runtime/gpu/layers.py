"""What a GPU stage's layers hold, as data: each matrix with its kernels' choices (`Matrix`), the
attention and FFN halves of a layer (`Attention`, `Latent`, `Ffn`, `Experts`), and what of a
layer its compiled variants depend on (`launch_signature`). engine/runtime/gpu/matrices.py's
`LayerBuilder` makes them at load; `GpuStage.forward` follows them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

# up to this many rows (decode, a short chunk) a matrix runs as a GEMV on its packed bytes;
# more rows run one GEMM on its dequantized copy
GEMV_ROWS = 8


@dataclass(slots=True)
class Matrix:
    """A weight matrix and its kernels. Up to GEMV_ROWS rows of x: a GEMV on its packed bytes,
    carve_kernels/gemv_t.py's on ``t_bytes`` when the load repacks it into the T layout, else
    carve_kernels/quant_matmul.py's on ``packed``. More rows: a GEMM on ``dq``, its dequant-cache
    copy, or (no copy) on the matrix dequantized into buf.dequant at each call."""

    name: str
    ggml_type: int
    packed: torch.Tensor  # [rows, bytes per row] (the T layout's bytes once repacked)
    t_bytes: torch.Tensor | None  # the same bytes, flat, where the T GEMVs read them
    dq: torch.Tensor | None  # [rows, cols] in the activation dtype
    bias: torch.Tensor | None  # [rows] f32
    config: tuple[int, ...] | None  # the GEMV's tile (None: the kernel's tuned one)

    @property
    def rows(self) -> int:
        return self.packed.shape[0]


def gemv_rows(n: int, mats: Sequence[Matrix], out: torch.Tensor) -> bool:
    """Whether ``n`` rows of x run ``mats`` as GEMVs on their packed bytes (else one GEMM
    each on the dequant-cache copy, or on the matrix dequantized at the call): one row always;
    a short chunk (up to GEMV_ROWS) only where a matrix has no cache copy in ``out``'s dtype
    (a GEMM on the copy reads 16 bits a weight once for all the rows, and needs no kernel of
    its own: a GEMV on 16-bit x compiles a variant of each GEMV, 5-10 s each on a cold
    launch, for chunks that are rare, and reads its weights once a row); more rows never."""
    if n <= 1 or n > GEMV_ROWS:
        return n <= 1
    return not all(m.dq is not None and m.dq.dtype == out.dtype for m in mats)


@dataclass(slots=True)
class Attention:
    """The attention half of a layer: pre-norm, q/k/v, RoPE, the KV cache, attention, output."""

    norm: torch.Tensor  # attn_norm [n_embd]
    xq: tuple | None  # decode's int8 copy of the normed row (T q/k/v on int8 x), else None
    qkv: tuple[Matrix, Matrix, Matrix]
    fused: str  # decode's q/k/v launch: "t3" / "gemv3" one launch (T / GGUF order), "": three
    fused_mats: list[tuple]  # that launch's matrices
    fused_biases: list[torch.Tensor] | None  # that launch's biases (all three or none)
    fused_config: Any  # that launch's tile(s)
    q_norm: torch.Tensor | None  # per-head q/k norms (qwen3, gemma3) [head_dim]
    k_norm: torch.Tensor | None
    k_cache: torch.Tensor  # kv.<i>.k: [cells, n_head_kv, head_dim] f16, or q8_0 bytes
    v_cache: torch.Tensor
    cells: int
    kv_q8: bool  # the cache holds q8_0 blocks
    window: int  # sliding window (gemma3's local layers), 0: attends everything cached
    rope_base: float
    rope_scale: float
    rope_store: bool  # decode rotates k and stores k and v in one launch
    # ... and norms q and k per head first (qwen3's q/k norms: one launch a layer less)
    qk_norm_in_rope: bool
    # ... and that launch is the epilogue of decode's q/k/v T GEMV (gemv_t3.gemv_t3 ``rope=``)
    rope_in_qkv: bool
    rope_dim: int  # leading dims of each head RoPE rotates (glm4moe: part of head_dim)
    rope_freqs: torch.Tensor | None  # the frequency per pair (buf.rope_freqs) or None
    rope_mscale: float  # YaRN's cos/sin scale (1.0 without YaRN)
    sinks: torch.Tensor | None  # gpt-oss: attn_sinks [n_head], one more logit per head
    output: Matrix  # attn_output
    post_norm: torch.Tensor | None  # gemma3's sandwich norm of the output, before its add
    # decode's int8 copy of the attention output, written by the attention kernel's merging
    # programs, for attn_output's dp4a body (ATTN_Q8_TYPES), else None (bf16 x)
    xq_o: tuple | None = None


@dataclass(slots=True)
class Latent:
    """The attention half of a deepseek2 layer, multi-head latent attention
    (carve_kernels/latent.py): pre-norm; q (attn_q, or attn_q_b of the normed attn_q_a); the
    latent row (attn_kv_a_mqa: the latent, normed, then the rotated key part) into the cache;
    each head's position-free query into the latent space (attn_k_b), attention over the
    cached rows, each head's weighted latent out of it (attn_v_b); the output projection."""

    norm: torch.Tensor  # attn_norm [n_embd]
    q: Matrix | None  # attn_q, or None with a q LoRA
    q_a: Matrix | None  # attn_q_a [q_lora_rank, n_embd]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: Matrix | None  # attn_q_b [n_head * head_dim, q_lora_rank]
    kv_a: Matrix  # attn_kv_a_mqa [kv_lora + rope_dim, n_embd]
    kv_norm: torch.Tensor  # attn_kv_a_norm [kv_lora]
    k_b: Matrix  # attn_k_b (n_head x [kv_lora, nope] stacked), or a legacy file's attn_kv_b
    v_b: Matrix | None  # attn_v_b (n_head x [head_dim_v, kv_lora]); None: in k_b (legacy)
    cache: torch.Tensor  # kv.<i>.k [cells, 1, kv_lora + rope_dim] f16, or its q8_0 bytes
    cells: int
    rope_base: float
    rope_scale: float
    rope_freqs: torch.Tensor | None  # YaRN's frequency per pair (buf.rope_freqs) or None
    rope_mscale: float
    temperature: tuple[float, int] | None  # Mistral Large 3's (scale, length)
    output: Matrix  # attn_output
    post_norm: None = None  # (no sandwich norm: the FFN's add reads it)


@dataclass(slots=True)
class Ffn:
    """The FFN half of a layer: pre-norm, act(gate) * up, down."""

    norm: torch.Tensor  # ffn_norm [n_embd]
    xq: tuple | None  # decode's int8 copy of the normed row (T gate/up on int8 x), else None
    gate: Matrix
    up: Matrix
    down: Matrix
    fused: str  # decode's gate, up and GLU: "t_glu" / "gemv_glu" one launch, "": three
    fused_config: Any
    xq_down: tuple | None  # decode's int8 copy of the GLU output (T ffn_down on int8 x)
    post_norm: torch.Tensor | None  # gemma3's sandwich norm of the output, before its add


@dataclass(slots=True)
class Experts:
    """The FFN half of a mixture-of-experts layer: pre-norm, the router (float32, as files keep
    it), the top-k routing, the routed experts and (glm4moe) a shared expert beside them. Each
    routed tensor is a Matrix whose ``packed`` holds all experts, [n_expert * rows, bytes per
    row] (expert e's rows a contiguous slice, GGUF order); ``bias``: gpt-oss's per-expert
    biases [n_expert * rows]. Decode and prefill both read the quantized bytes
    (carve_kernels/moe.py)."""

    norm: torch.Tensor  # ffn_norm [n_embd]
    router: torch.Tensor  # ffn_gate_inp [n_expert, n_embd] f32
    router_bias: torch.Tensor | None  # [n_expert] (gpt-oss)
    sel_bias: torch.Tensor | None  # exp_probs_b [n_expert] (glm4moe: selection only)
    gate: Matrix
    up: Matrix
    down: Matrix
    config: tuple[int, ...] | None  # the decode gate/up GEMVs' tile (None: tuned per type)
    down_config: tuple[int, ...] | None
    shared: Ffn | None  # glm4moe's shared expert
    # decode's int8 copies (carve_kernels/gemv_q8.py): the normed row for gate/up, the k routed GLU
    # outputs for down; None: that GEMV runs on float x
    xq: tuple | None = None
    xq_h: tuple | None = None
    post_norm: torch.Tensor | None = None
    # the layer's experts live in host memory: the CPU runs them (engine/runtime/gpu/host.py)
    host: Any = None


def attn_matrices(att: Attention | Latent) -> list[Matrix]:
    """The matrices an attention half reads, in the order decode reads them."""
    if isinstance(att, Attention):
        return [*att.qkv, att.output]
    return [m for m in (att.q, att.q_a, att.q_b, att.kv_a, att.k_b, att.v_b, att.output)
            if m is not None]


@dataclass(slots=True)
class Layer:
    index: int
    attn: Attention | Latent
    ffn: Ffn | Experts


def launch_signature(v: Any) -> Any:
    """What of ``v`` (a Layer, or any part of one) the kernels' compiled variants can depend
    on: its fields' values (not its layer's index or its tensors' names), and each tensor's
    dtype, shape, strides and 16-byte alignment (not where it lies); an object of another
    kind (a layer's host experts) is itself. Two layers of one signature launch the same
    variants."""
    if isinstance(v, torch.Tensor):
        return ("tensor", v.dtype, v.device.type, tuple(v.shape), tuple(v.stride()),
                v.data_ptr() % 16 == 0)
    if isinstance(v, (Layer, Attention, Latent, Ffn, Experts, Matrix)):
        return (type(v).__name__, *(launch_signature(getattr(v, f.name)) for f in fields(v)
                                    if f.name not in ("index", "name")))
    if isinstance(v, (list, tuple)):
        return tuple(launch_signature(x) for x in v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return ("object", id(v))


def dry_pass_layers(layers: Sequence[Layer]) -> list[bool]:
    """Which of ``layers`` a precompile's dry pass runs (the rest launch nothing new): each
    layer whose signature, with its predecessor's, has not run yet (a layer's launches read
    the previous layer's FFN: its output is added and normed first), and the last (the
    stage's end reads it)."""
    seen, out, prev = set(), [], None
    for i, layer in enumerate(layers):
        sig = launch_signature(layer)
        out.append((prev, sig) not in seen or i == len(layers) - 1)
        seen.add((prev, sig))
        prev = sig
    return out

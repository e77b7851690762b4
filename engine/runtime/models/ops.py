"""The op table every model forward goes through: plain-torch implementations.

A model never calls torch for the heavy steps directly; it calls `ops.<name>` on the table it
was built with. The GPU path swaps this table for the Triton one in `carve_kernels/` (same names,
same signatures), so devices and kernels change without touching a model definition.

Shapes: T tokens, H query heads, K key/value heads, D head dim, S key positions.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from carve_kernels.dequant import dequantize_to


@dataclass(slots=True)
class QWeight:
    """A matrix as the engine holds it: the GGUF bytes in a weights arena, and optionally a
    dequantized copy in the dequant cache. ``rows``/``cols`` are torch order (out, in)."""

    name: str
    raw: torch.Tensor  # uint8 [nbytes], view into a weights/globals arena
    ggml_type: int
    rows: int
    cols: int
    cached: torch.Tensor | None = None  # [rows, cols] f16/bf16/f32, view into the dequant cache
    scratch: torch.Tensor | None = None  # float32 workspace for uncached matrices

    @property
    def gguf_shape(self) -> tuple[int, int]:
        return (self.cols, self.rows)


@dataclass(slots=True)
class QExperts:
    """A layer's expert matrices, one 3-D GGUF tensor [n_expert, rows, cols] (GGUF shape
    (cols, rows, n_expert), ne0 fastest): expert e's bytes are the contiguous e-th slice of
    ``raw``, so a product dequantizes only the experts it routes to."""

    name: str
    raw: torch.Tensor  # uint8 [nbytes], view into a weights arena
    ggml_type: int
    n_expert: int
    rows: int
    cols: int
    cached: torch.Tensor | None = None  # [n_expert, rows, cols], view into the dequant cache
    scratch: torch.Tensor | None = None

    @property
    def gguf_shape(self) -> tuple[int, int]:
        """The tensor as one matrix of all experts' rows (what the dequant cache holds)."""
        return (self.cols, self.rows * self.n_expert)

    def expert(self, e: int) -> QWeight:
        """Expert ``e`` as a matrix [rows, cols]: views, nothing is copied."""
        per = self.raw.numel() // self.n_expert
        c = None if self.cached is None else self.cached[e]
        return QWeight(f"{self.name}[{e}]", self.raw[e * per : (e + 1) * per], self.ggml_type,
                       self.rows, self.cols, c, self.scratch)

    def product(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, cols] -> [n, rows]: expert e's matrix times x (`linear`)."""
        return linear(x, self.expert(e))


FALLBACK_SCRATCH = 1 << 22  # elements
# Elements of a cached matrix made float32 at a time on the CPU (2 MiB): the block is still in
# cache when the product reads it. Measured on a Qwen2 head [151936, 896], decode, 2 threads of a
# Xeon: 33 ms in 512K-element blocks, 35 ms in 1M, 44 ms in 128K; the whole matrix at once is
# about ten times slower.
CPU_BLOCK = 1 << 19


def _dequant_rows(w: QWeight, r0: int, r1: int, out: torch.Tensor | None) -> torch.Tensor:
    row_bytes = w.raw.numel() // w.rows
    raw = w.raw[r0 * row_bytes : r1 * row_bytes]
    dtype = torch.float32 if out is None else out.dtype
    return dequantize_to(raw, w.ggml_type, (w.cols, r1 - r0), dtype, out=out)


_last_cast: list = [None, None]  # (source tensor, its cast): q/k/v and gate/up share an input


def _as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if x.dtype == dtype:
        return x
    src, cast = _last_cast
    if src is x and cast.dtype == dtype:
        return cast
    cast = x.to(dtype)
    _last_cast[0], _last_cast[1] = x, cast
    return cast


def linear(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [T, cols] @ w.T -> [T, rows] in x's dtype. On the CPU the product is float32 whatever
    holds the matrix (`_linear_f32`). On a GPU a cached matrix runs one GEMM in the cache's
    dtype; an uncached one is dequantized into the scratch buffer a row block at a time."""
    if x.device.type == "cpu":
        return _linear_f32(x, w).to(x.dtype)
    if w.cached is not None:
        c = w.cached
        return F.linear(_as_dtype(x, c.dtype), c).to(x.dtype)
    scratch = w.scratch
    # Without a priced scratch (a matrix the Layout did not expect to GEMM), bound the temporary.
    room = FALLBACK_SCRATCH if scratch is None else scratch.numel()
    step = max(1, min(w.rows, room // w.cols))
    out = torch.empty(x.shape[0], w.rows, dtype=x.dtype, device=x.device)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        buf = None if scratch is None else scratch[: (r1 - r0) * w.cols].view(r1 - r0, w.cols)
        block = _dequant_rows(w, r0, r1, buf)
        out[:, r0:r1] = F.linear(x.to(block.dtype), block)
    return out


class _one_thread:  # noqa: N801 - used as a statement: `with _one_thread():`
    """Run the upcasts and dequantization of a row block on one intra-op thread. Each is a
    short parallel region; on a machine whose cores are busy with anything else (the window, a
    browser, a build) the second thread is often descheduled and every region then waits a
    scheduler tick for it: on 2 busy cores a 512K-element bf16 -> f32 copy took 16 ms instead
    of 0.18 ms, and a demo-model token 14 s. The products keep every thread."""

    def __enter__(self) -> None:
        self.n = torch.get_num_threads()
        if self.n > 1:
            torch.set_num_threads(1)

    def __exit__(self, *exc: object) -> None:
        if self.n > 1:
            torch.set_num_threads(self.n)


def _linear_f32(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x [T, cols] @ w.T -> float32 [T, rows] on the CPU: float32 inputs, float32 sums, float32
    results. Row blocks of the matrix are made float32 (upcast from the dequant cache's bf16
    copy, or dequantized from the file's bytes) and multiplied in float32.

    Why not the cache's bf16 GEMM: it rounds its inputs and results to bf16, and which GEMM
    torch picks depends on the CPU (oneDNN's where the CPU has AVX-512 bf16 instructions,
    ATen's elsewhere), so one file's logits moved with the machine: Gemma 3 270M over 600
    positions was 1.6e-2 of the logit range from transformers on an AVX-512 CPU and 7.1e-2 on
    an AVX2-only one; in float32 it is 1.6e-2 on both (the bf16 weights and the f16 KV cache
    are what remain)."""
    c, scratch = w.cached, w.scratch
    if scratch is not None and scratch.dtype != torch.float32:
        scratch = None
    if c is not None:
        room = CPU_BLOCK
    else:  # the priced scratch holds the largest uncached matrix; else bound the temporary
        room = FALLBACK_SCRATCH if scratch is None else scratch.numel()
    step = max(1, min(w.rows, room // w.cols))
    if scratch is None or scratch.numel() < step * w.cols:
        scratch = torch.empty(step * w.cols, dtype=torch.float32)
    xf = x.float()
    out = torch.empty(x.shape[0], w.rows, dtype=torch.float32)
    for r0 in range(0, w.rows, step):
        r1 = min(w.rows, r0 + step)
        block = scratch[: (r1 - r0) * w.cols].view(r1 - r0, w.cols)  # [rows of block, cols]
        with _one_thread():
            if c is None:
                _dequant_rows(w, r0, r1, block)
            else:
                block.copy_(c[r0:r1])
        if x.shape[0] == 1:  # a one-row GEMM runs ~2x slower than the matrix-vector kernel
            torch.mv(block, xf[0], out=out[0, r0:r1])
        else:
            torch.mm(xf, block.T, out=out[:, r0:r1])
    return out


def embed(ids: torch.Tensor, w: QWeight) -> torch.Tensor:
    """Rows ``ids`` [T] of an embedding matrix -> float32 [T, cols]; only those rows are
    dequantized, from the file's bytes (a cache copy of a tied head is rounded)."""
    row_bytes = w.raw.numel() // w.rows
    raw = w.raw.view(w.rows, row_bytes)[ids].reshape(-1)
    return dequantize_to(raw, w.ggml_type, (w.cols, ids.numel()), torch.float32)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., n] / rms(x) * weight, computed in float32."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused call, same float32 maths
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight).to(x.dtype)


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rmsnorm(x + residual), x + residual): the residual add fused with the next norm."""
    s = x + residual
    return rmsnorm(s, weight, eps), s


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """Rotate x [T, H, D] by angles whose cos/sin are [T, D/2].
    "normal": pairs (x[2i], x[2i+1]) (llama GGUFs: the converter permuted q/k into this form);
    "neox": pairs (x[i], x[i + D/2])."""
    c = cos.unsqueeze(1)  # [T, 1, D/2]
    s = sin.unsqueeze(1)
    xf = x.float()
    if style == "neox":
        half = x.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        return torch.cat((a * c - b * s, b * c + a * s), dim=-1).to(x.dtype)
    pairs = xf.unflatten(-1, (-1, 2))  # [T, H, D/2, 2]
    a, b = pairs[..., 0], pairs[..., 1]
    return torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2).to(x.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax(q k^T * scale + mask) v with grouped KV heads.
    q [T, H, D], k [S, K, D], v [S, K, Dv], mask bool [T, S] (True = may attend) or None for
    "every key" -> [T, H * Dv]. ``sinks`` [H] (gpt-oss): one more logit per head in each
    softmax's denominator, attending to nothing."""
    t, h, _ = q.shape
    if sinks is not None:
        return _attention_sinks(q, k, v, mask, scale, sinks)
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
    kh = k.to(q.dtype).transpose(0, 1).unsqueeze(0)  # [1, K, S, D]
    vh = v.to(q.dtype).transpose(0, 1).unsqueeze(0)
    o = F.scaled_dot_product_attention(
        qh, kh, vh, attn_mask=mask, scale=scale, enable_gqa=kh.shape[1] != h
    )  # [1, H, T, Dv]
    return o[0].transpose(0, 1).reshape(t, -1)


def _attention_sinks(q, k, v, mask, scale, sinks) -> torch.Tensor:
    t, h, _ = q.shape
    rep = h // k.shape[1]
    qh = q.float().transpose(0, 1)  # [H, T, D]
    kh = k.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, S, D]
    vh = v.float().repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, S, Dv]
    logits = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [H, T, S]
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(h, 1, 1).expand(h, t, 1)
    probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
    o = torch.matmul(probs, vh)  # [H, T, Dv]
    return o.transpose(0, 1).reshape(t, -1).to(q.dtype)


def glu(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """act(gate) * up: SwiGLU for "silu", GeGLU with the tanh GELU for "gelu"."""
    if act == "silu":
        return F.silu(gate) * up
    return F.gelu(gate, approximate="tanh") * up


OAI_ALPHA = 1.702  # gpt-oss's SwiGLU: gate * sigmoid(1.702 gate), as its reference and llama.cpp


def glu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's SwiGLU: gate clamped to <= limit, up to [-limit, limit],
    gate * sigmoid(alpha gate) * (up + 1)."""
    g = gate.clamp(max=limit)
    u = up.clamp(-limit, limit)
    return g * torch.sigmoid(OAI_ALPHA * g) * (u + 1)


def route(
    logits: torch.Tensor,
    k: int,
    gating: str,
    norm: bool,
    scale: float,
    bias: torch.Tensor | None = None,
    groups: tuple[int, int] = (0, 0),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (float32) -> expert ids [T, k] int64 and their weights [T, k]
    float32, by the family's gating (HParams.expert_gating):
    "softmax": the k largest of the softmax over all E; "softmax_topk": the k largest logits,
    softmax over those k; "sigmoid": the k largest sigmoids. ``bias`` (the selection bias,
    exp_probs_b) is added to the scores the experts are chosen by, never to their weights.
    ``groups`` (n_groups, n_used) > 0 (DeepSeek-V3): the experts are n_groups equal groups,
    and a token chooses only among those of the n_used groups whose two best selection scores
    sum highest. ``norm`` divides the k weights by their sum; ``scale`` multiplies them."""
    logits = logits.float()
    if gating == "softmax_topk":
        top, ids = torch.topk(logits, k, dim=-1)
        w = torch.softmax(top, dim=-1)
    elif gating in ("softmax", "sigmoid"):
        probs = torch.softmax(logits, dim=-1) if gating == "softmax" else torch.sigmoid(logits)
        choice = probs if bias is None else probs + bias.float()
        if groups[0]:
            choice = _limit_groups(choice, *groups)
        ids = torch.topk(choice, k, dim=-1).indices
        w = probs.gather(-1, ids)
    else:
        raise ValueError(f"unknown expert gating {gating!r}")
    if norm:
        # llama.cpp clamps the sum away from zero the same way
        w = w / w.sum(-1, keepdim=True).clamp_min(6.103515625e-5)
    if scale != 1.0:
        w = w * scale
    return ids, w


def _limit_groups(choice: torch.Tensor, n_groups: int, n_used: int) -> torch.Tensor:
    """Selection scores [T, E] with every expert outside each token's n_used best groups
    (by the sum of a group's two highest scores) set to -inf."""
    t, e = choice.shape
    g = choice.view(t, n_groups, e // n_groups)
    score = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)  # [T, n_groups]
    keep = torch.zeros_like(score, dtype=torch.bool)
    keep.scatter_(1, score.topk(n_used, dim=-1).indices, True)
    return g.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)


def experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    gate: Any,
    up: Any,
    down: Any,
    act: str,
    limit: float = 0.0,
    biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The routed experts' FFN: sum over each token's k experts e of
    weights[t, j] * down_e(glu(gate_e x_t, up_e x_t)) -> [T, n_embd] in x's dtype.
    x [T, n_embd], ids/weights [T, k]. Tokens are grouped by expert, so each chosen expert's
    slices are read (and dequantized) once per call and no other expert is touched. The
    matrices are `QExperts` or anything with its ``n_expert`` and ``product(e, x)``
    (`cpu_experts.PackedExperts`, host experts in a CPU layout).
    ``limit`` > 0 takes gpt-oss's clamped SwiGLU; ``biases`` (gate, up, down) [E, rows] are
    added to each expert's products (gpt-oss)."""
    t, k = ids.shape
    w = weights.reshape(-1).float()
    out = torch.zeros(t, down.rows, dtype=torch.float32, device=x.device)

    def expert(e: int, xe: torch.Tensor) -> torch.Tensor:
        g, u = gate.product(e, xe).float(), up.product(e, xe).float()
        if biases is not None:
            g, u = g + biases[0][e], u + biases[1][e]
        h = glu_clamped(g, u, limit) if limit else glu(g, u, act)
        y = down.product(e, h.to(x.dtype)).float()
        return y if biases is None else y + biases[2][e]

    if t == 1 and x.device.type == "cpu":
        # one row (decode on the host): its k experts in expert order, as the grouping below
        # sums them, without the per-expert gathers (a fifth of a host layer's time on 2 cores)
        for e, j in sorted(zip(ids.reshape(-1).tolist(), range(k), strict=True)):
            out.add_(expert(e, x) * w[j])
        return out.to(x.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # routed slots grouped by expert
    counts = torch.bincount(flat, minlength=gate.n_expert).tolist()
    start = 0
    for e, n in enumerate(counts):
        if not n:
            continue
        slots = order[start : start + n]
        start += n
        rows = slots // k  # the tokens routed to e
        out.index_add_(0, rows, expert(e, x[rows]) * w[slots].unsqueeze(1))
    return out.to(x.dtype)


TORCH_OPS = SimpleNamespace(
    linear=linear,
    embed=embed,
    rmsnorm=rmsnorm,
    add_rmsnorm=add_rmsnorm,
    rope=rope,
    attention=attention,
    glu=glu,
    route=route,
    experts=experts,
)

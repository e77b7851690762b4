"""Pieces every model family shares: RoPE angles, the attention block, the gated FFN, and the
stage (a contiguous run of layers on one device) that a model definition fills in.

Tensors arrive as a dict name -> torch.Tensor (uint8 GGUF bytes or float views into the loaded
arenas) or `QWeight` for matrices; nothing here reads a file.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, Protocol

import torch

from engine.gguf.hparams import ROPE_FACTORS, ROPE_LONG, ROPE_SHORT
from engine.runtime.models.ops import QWeight
from spec.errors import CarveError

Tensors = Mapping[str, Any]  # GGUF tensor name -> QWeight (matrices) or float32 tensor


class KVStore(Protocol):
    """What a model needs from the runtime's KV cache (engine/runtime/kv_cache.py)."""

    def store_and_fetch(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, pos0: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Write k, v [T, K, D] for positions pos0.. and return (keys, values, mask) to attend:
        keys [S, K, D], values [S, K, Dv], mask bool [T, S] or None (attend to all S)."""
        ...


def inv_freq(head_dim: int, base: float, scale: float, factors: torch.Tensor | None) -> torch.Tensor:
    """float32 [D/2] rotation frequencies, computed the way transformers does (so positions
    rotate bit-identically); linear scaling divides them by ``scale``; llama-3 style
    ``rope_freqs`` factors divide them per pair."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    f = 1.0 / (base**exps)
    if scale != 1.0:
        f = f / scale
    if factors is not None:
        f = f / factors.float()
    return f


def factors_name(hp: Any, ctx: int) -> str | None:
    """The tensor of per-pair RoPE factors a context of ``ctx`` uses, or None: llama-3.1's
    rope_freqs, or LongRoPE's long factors beyond the original context and its short ones
    within it (llama.cpp chooses by the context, as here, not by each sequence's length)."""
    if getattr(hp, "rope_scaling", None) == "longrope":
        return ROPE_LONG if ctx > hp.rope_scaling_orig_ctx else ROPE_SHORT
    return ROPE_FACTORS if getattr(hp, "rope_factors", False) else None


def global_freqs(hp: Any, factors: torch.Tensor | None,
                 name: str = ROPE_FACTORS) -> tuple[torch.Tensor, float]:
    """The float32 [rope_dim/2] frequencies of the layers that are not sliding-window ones, and
    their cos/sin multiplier: YaRN's (every layer, ``factors`` unused), else the plain ones
    with the linear scale and the file's per-pair ``factors`` (tensor ``name``: llama-3.1's
    rope_freqs, llama.cpp's ``freq_factors``; or one of LongRoPE's sets, whose cos and sin
    are then times its attention factor) dividing them. A factor that is not finite and
    above 0 is a load error naming the tensor."""
    if hp.rope_scaling == "yarn":
        return yarn_freqs(hp, truncate=hp.rope_yarn_truncate)
    d = getattr(hp, "rope_dim", 0) or hp.head_dim  # partial RoPE (glm4moe) rotates fewer
    if factors is not None:
        factors = factors.float().reshape(-1)
        bad = ~(torch.isfinite(factors) & (factors > 0))
        if bad.any():
            i = int(bad.nonzero()[0])
            raise CarveError(f"tensor {name} holds {factors[i].item()!r} for rotated "
                             f"pair {i}; RoPE frequency factors must be finite and above 0 "
                             "(the file is damaged: re-download or re-convert it)")
    if hp.rope_scaling == "longrope":
        return inv_freq(d, hp.rope_base, 1.0, factors), hp.rope_attn_factor
    return inv_freq(d, hp.rope_base, _linear_scale(hp), factors), 1.0


def yarn_freqs(hp: Any, truncate: bool) -> tuple[torch.Tensor, float]:
    """YaRN's float32 [rope_dim/2] frequencies and its cos/sin multiplier, as transformers
    computes them: dims rotating fewer than beta_slow times over the original context are
    interpolated (divided by the factor), those rotating more than beta_fast times kept, a
    linear ramp between; cos and sin scaled by 0.1 ln(factor) + 1. ``truncate`` rounds the
    ramp's ends outwards to whole dims (llama.cpp always does; gpt-oss's own config and
    reference implementation do not). A file with YaRN's mscale_all_dim (deepseek2) leaves
    cos and sin unscaled: its attention scale carries the correction (HParams.attn_scale)."""
    d, base, factor = hp.rope_dim, hp.rope_base, hp.rope_scale
    orig = hp.rope_scaling_orig_ctx

    def dim_of(rotations: float) -> float:
        return d * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(hp.rope_yarn_beta_fast), dim_of(hp.rope_yarn_beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    extrapolated = inv_freq(d, base, 1.0, None)
    ramp = ((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (the original frequency), 0: interpolate
    f = extrapolated / factor * (1 - keep) + extrapolated * keep
    return f, 1.0 if getattr(hp, "rope_yarn_log_mul", 0.0) else 0.1 * math.log(factor) + 1.0


def rope_angles(
    positions: torch.Tensor, freqs: torch.Tensor, mscale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, D/2] for integer positions [T] (times ``mscale``: YaRN's)."""
    a = positions.float().unsqueeze(1) * freqs.unsqueeze(0)
    if mscale != 1.0:
        return a.cos() * mscale, a.sin() * mscale
    return a.cos(), a.sin()


def weight(tensors: Tensors, name: str) -> Any:
    try:
        return tensors[name]
    except KeyError:
        raise CarveError(
            f"tensor {name} is missing from the loaded layout; the GGUF does not match its "
            f"architecture metadata or the plan's split"
        ) from None


class Stage:
    """Layers [lb, le) of one model on one device, plus the embedding (first stage) and the
    head (last stage). Families subclass it and implement `layer`."""

    def __init__(
        self,
        hp: Any,
        tensors: Tensors,
        layers: tuple[int, int],
        first: bool,
        last: bool,
        ops: SimpleNamespace,
        device: torch.device | str = "cpu",
        ctx: int = 0,
    ) -> None:
        # ctx: the plan's context (LongRoPE's factor set depends on it)
        self.hp = hp
        self.t = tensors
        self.lb, self.le = layers
        self.first, self.last = first, last
        self.ops = ops
        self.device = torch.device(device)
        self._fused: dict[int, QWeight | None] = {}
        d = getattr(hp, "rope_dim", 0) or hp.head_dim  # partial RoPE (glm4moe) rotates fewer
        name = factors_name(hp, ctx)
        f, self.mscale = global_freqs(hp, None if name is None else weight(tensors, name), name)
        self.freqs = f.to(self.device)
        if hp.rope_scaling == "yarn":  # every layer, windowed or not (gpt-oss)
            self.freqs_swa = self.freqs
        else:  # sliding-window layers: their own base, neither scaled nor factored
            self.freqs_swa = inv_freq(d, hp.rope_base_swa, 1.0, None).to(self.device)
        # layers the model runs: a file's next-token-prediction layers (glm4moe) are not
        self.n_run = getattr(hp, "n_layer_run", 0) or hp.n_layer
        if first:
            self.embd = weight(tensors, "token_embd.weight")
        if last:
            self.out_norm = weight(tensors, "output_norm.weight")
            out = tensors.get("output.weight")
            # Tied embeddings: the last stage holds its own copy of token_embd (DESIGN.md).
            self.out = out if out is not None else weight(tensors, "token_embd.weight")

    # --- model-specific ---------------------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.ops.embed(ids, self.embd)

    def layer(self, i: int, x: torch.Tensor, rope: dict, pos0: int, kv: KVStore) -> torch.Tensor:
        raise NotImplementedError

    # --- shared ---------------------------------------------------------------------------
    def forward(
        self, x: torch.Tensor, pos0: int, kv: KVStore, check: bool = False
    ) -> torch.Tensor:
        """Run this stage's layers on hidden states x [T, n_embd]. With ``check`` each layer's
        output is tested for NaN/inf (slow path used only to name the failing layer)."""
        pos = torch.arange(pos0, pos0 + x.shape[0], device=self.device)
        rope = {
            False: rope_angles(pos, self.freqs, self.mscale),
            True: rope_angles(pos, self.freqs_swa, self.mscale),
        }
        for i in range(self.lb, min(self.le, self.n_run)):
            x = self.layer(i, x, rope, pos0, kv)
            if check and not bool(torch.isfinite(x).all()):
                raise NonFinite(i)
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output projection: x [T, n_embd] -> float32 logits [T, n_vocab]."""
        h = self.ops.rmsnorm(x, self.out_norm, self.hp.rms_eps)
        return self.ops.linear(h, self.out).float()

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
        """Self-attention of layer i on normed input x [T, n_embd] -> [T, n_embd]."""
        hp, ops, p = self.hp, self.ops, f"blk.{i}."
        t = x.shape[0]
        if getattr(hp, "fused_qkv", False):  # phi3: q, k and v are the rows of one matrix
            q, k, v = self.proj(x, p + "attn_qkv").split(
                (hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim,
                 hp.n_head_kv * hp.head_dim_v), dim=-1)
            q, k, v = (q.reshape(t, hp.n_head, hp.head_dim), k.reshape(t, hp.n_head_kv, hp.head_dim),
                       v.reshape(t, hp.n_head_kv, hp.head_dim_v))
        else:
            q, k = self.proj(x, p + "attn_q"), self.proj(x, p + "attn_k")
            if q_norm is not None and getattr(hp, "qk_norm_whole", False):
                # minimax-m2: one RMSNorm over each token's whole q and whole k
                q, k = ops.rmsnorm(q, q_norm, hp.rms_eps), ops.rmsnorm(k, k_norm, hp.rms_eps)
                q_norm = k_norm = None
            q = q.view(t, hp.n_head, hp.head_dim)
            k = k.view(t, hp.n_head_kv, hp.head_dim)
            v = self.proj(x, p + "attn_v").view(t, hp.n_head_kv, hp.head_dim_v)
        if q_norm is not None:
            q = ops.rmsnorm(q, q_norm, hp.rms_eps)
            k = ops.rmsnorm(k, k_norm, hp.rms_eps)
        swa = bool(hp.swa_layers[i]) if hp.swa_layers else False
        cos, sin = rope[swa]
        rd = getattr(hp, "rope_dim", 0) or hp.head_dim
        if rd < hp.head_dim:  # partial RoPE: the leading rd dims rotate, the rest pass
            q = torch.cat((ops.rope(q[..., :rd], cos, sin, hp.rope_style), q[..., rd:]), -1)
            k = torch.cat((ops.rope(k[..., :rd], cos, sin, hp.rope_style), k[..., rd:]), -1)
        else:
            q = ops.rope(q, cos, sin, hp.rope_style)
            k = ops.rope(k, cos, sin, hp.rope_style)
        keys, values, mask = kv.store_and_fetch(i, k, v, pos0)
        sinks = self.t.get(p + "attn_sinks.weight") if getattr(hp, "attn_sinks", False) else None
        if sinks is not None:
            o = ops.attention(q, keys, values, mask, hp.attn_scale, sinks)  # [T, H * Dv]
        else:
            o = ops.attention(q, keys, values, mask, hp.attn_scale)  # [T, H * Dv]
        return self.proj(o, p + "attn_output")

    def proj(self, x: torch.Tensor, name: str) -> torch.Tensor:
        y = self.ops.linear(x, weight(self.t, name + ".weight"))
        b = self.t.get(name + ".bias")
        return y if b is None else y + b

    def ffn(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Gated FFN of layer i: down(act(gate x) * up x)."""
        p = f"blk.{i}."
        ops = self.ops
        if getattr(self.hp, "fused_gate_up", False):  # phi3: gate and up are ffn_up's halves
            g, u = ops.linear(x, weight(self.t, p + "ffn_up.weight")).chunk(2, dim=-1)
            return ops.linear(ops.glu(g, u, self.hp.act), weight(self.t, p + "ffn_down.weight"))
        gate, up = weight(self.t, p + "ffn_gate.weight"), weight(self.t, p + "ffn_up.weight")
        fused = self._gate_up(i, gate, up)
        if fused is not None:  # one matrix-vector product instead of two
            g, u = ops.linear(x, fused).split(gate.rows, dim=-1)
        else:
            g, u = ops.linear(x, gate), ops.linear(x, up)
        return ops.linear(ops.glu(g, u, self.hp.act), weight(self.t, p + "ffn_down.weight"))

    def _gate_up(self, i: int, gate: Any, up: Any) -> QWeight | None:
        """gate and up as one [2 n_ff, n_embd] matrix when their dequant-cache copies happen to
        lie back to back in the arena (price orders equal-sized matrices by name, so they do in
        packed mode); a view, nothing is copied."""
        if i in self._fused:
            return self._fused[i]
        f = None
        g, u = getattr(gate, "cached", None), getattr(up, "cached", None)
        if (
            g is not None
            and u is not None
            and g.dtype == u.dtype
            and g.shape == u.shape
            and g.is_contiguous()
            and u.is_contiguous()
            and u.data_ptr() == g.data_ptr() + g.numel() * g.element_size()
        ):
            both = torch.as_strided(g, (2 * g.shape[0], g.shape[1]), (g.shape[1], 1))
            f = QWeight(gate.name + "+up", gate.raw, gate.ggml_type, 2 * gate.rows, gate.cols, both)
        self._fused[i] = f
        return f


class NonFinite(Exception):
    """Raised by a checked forward at the first layer whose output holds NaN or inf."""

    def __init__(self, layer: int) -> None:
        super().__init__(layer)
        self.layer = layer


def _linear_scale(hp: Any) -> float:
    kind = hp.rope_scaling
    if kind in (None, "", "none"):
        return 1.0
    if kind == "linear":
        return float(hp.rope_scale)
    raise CarveError(
        f"RoPE scaling {kind!r} is not supported by the engine yet; use a GGUF without "
        f"rope scaling or with linear scaling"
    )


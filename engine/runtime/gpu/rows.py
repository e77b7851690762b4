"""The activation rows a GPU stage's forward pass runs on (engine/runtime/gpu/stage.py and its
MoE steps, stage_moe.py): views into the stage's priced ``buf.*`` buffers."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Rows:
    """The first n rows of the activation buffers one forward pass runs on, with the head views
    of buf.qkv (q, k and v heads side by side)."""

    n: int
    hidden: torch.Tensor  # [n, n_embd] the residual stream
    normed: torch.Tensor  # [n, n_embd] a sub-layer's normed input
    qkv: torch.Tensor  # [n, (n_head + 2 n_head_kv) * head_dim]
    q3: torch.Tensor  # [n, n_head, head_dim]
    k3: torch.Tensor  # [n, n_head_kv, head_dim]
    v3: torch.Tensor  # [n, n_head_kv, head_dim]
    qk3: torch.Tensor  # [n, n_head + n_head_kv, head_dim]: one launch norms or rotates q and k
    attn: torch.Tensor  # [n, n_head * head_dim] attention's output
    o3: torch.Tensor  # [n, n_head, head_dim] the same memory
    proj: torch.Tensor  # [n, n_embd] a sub-layer's output, before its add to hidden
    ffn_up: torch.Tensor  # [n, 2 n_ff] gate then up (when not one launch)
    ffn_act: torch.Tensor  # [n, n_ff] act(gate) * up
    pos: torch.Tensor  # [n] positions

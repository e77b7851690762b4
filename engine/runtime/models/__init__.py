"""Model definitions: one per family, built from a dict of loaded tensors and the HParams."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

from engine.runtime.models.deepseek2 import Deepseek2Stage
from engine.runtime.models.gemma3 import Gemma3Stage
from engine.runtime.models.layers import Stage, Tensors
from engine.runtime.models.llama import LlamaStage
from engine.runtime.models.moe import (
    Dots1Stage,
    Ernie45MoEStage,
    Glm4MoEStage,
    GptOssStage,
    MiniMaxM2Stage,
    MixtralStage,
    Qwen3MoEStage,
)
from engine.runtime.models.ops import TORCH_OPS
from spec.errors import CarveError

FAMILIES: dict[str, type[Stage]] = {
    "llama": LlamaStage,
    "mistral": LlamaStage,
    "qwen2": LlamaStage,
    "qwen3": LlamaStage,
    "gemma3": Gemma3Stage,
    "phi3": LlamaStage,  # its fused q/k/v and gate/up matrices: HParams.fused_qkv / fused_gate_up
    "qwen3moe": Qwen3MoEStage,
    "gpt-oss": GptOssStage,
    "glm4moe": Glm4MoEStage,
    "deepseek2": Deepseek2Stage,
    "minimax-m2": MiniMaxM2Stage,
    "dots1": Dots1Stage,
    "ernie4_5-moe": Ernie45MoEStage,
}
# the files of a dense family whose metadata declares experts (HParams.n_expert > 0)
ROUTED_FAMILIES: dict[str, type[Stage]] = {"llama": MixtralStage}


def build_stage(
    hp: Any,
    tensors: Tensors,
    layers: tuple[int, int],
    first: bool,
    last: bool,
    ops: SimpleNamespace = TORCH_OPS,
    device: torch.device | str = "cpu",
    ctx: int = 0,
) -> Stage:
    """The stage of ``hp.arch`` running ``layers`` = [lb, le) on ``device`` for a context of
    ``ctx`` tokens."""
    try:
        cls = ROUTED_FAMILIES.get(hp.arch) if getattr(hp, "n_expert", 0) else None
        cls = cls or FAMILIES[hp.arch]
    except KeyError:
        raise CarveError(
            f"unsupported architecture {hp.arch!r}; the engine runs {', '.join(sorted(FAMILIES))}"
        ) from None
    return cls(hp, tensors, layers, first, last, ops, device, ctx)

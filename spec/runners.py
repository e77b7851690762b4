"""Which runner runs what: the tensor types each of the engine's two runners can multiply or
dequantize, and the architectures the engine runs. Planning reads this to refuse, before anything
is allocated, a plan whose runner lacks a type of the file.

A literal table, since spec imports nothing of ours: tests/engine/test_capability.py holds it
equal to what the kernels run (``carve_kernels.quant_blocks.PLANS`` for the GPU runner,
``carve_kernels.dequant.SUPPORTED_TYPES`` for the torch engine) and to the engine's model families.
"""

from __future__ import annotations

from typing import NamedTuple

from spec import quant_types as qt

# the architectures the engine runs (engine.runtime.models.FAMILIES): the torch engine runs all
ARCHS: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "gpt-oss", "glm4moe",
    "deepseek2", "minimax-m2", "dots1", "ernie4_5-moe",
)
# those the Triton GPU runner runs too (all of them)
TRITON_ARCHS: tuple[str, ...] = (
    "llama", "mistral", "qwen2", "qwen3", "gemma3", "phi3", "qwen3moe", "glm4moe", "gpt-oss",
    "deepseek2", "minimax-m2", "dots1", "ernie4_5-moe",
)


class Runner(NamedTuple):
    name: str  # as the engine names it: "triton" | "torch"
    lacks: str  # how a reason says a type is missing: "IQ4_XS ... has no GPU kernel"
    elsewhere: str  # what to do to run on this runner instead
    types: frozenset[int]  # ggml type ids of the tensors it runs


# The Triton GPU runner (engine/runtime/gpu/): its weight matrices go through the quantized
# kernels (carve_kernels/quant_blocks.py), so a matrix must be of one of these types; its vectors
# (norms, biases) are read as F32.
TRITON = Runner(
    "triton",
    "has no GPU kernel",
    "run every layer on GPUs (the GPU runner runs it)",
    frozenset({qt.F16, qt.BF16, qt.Q4_0, qt.Q5_0, qt.Q8_0, qt.Q4_K, qt.Q5_K, qt.Q6_K,
               qt.MXFP4,
               # carve_kernels/lowbit_blocks.py
               qt.Q4_1, qt.Q5_1, qt.Q2_K, qt.Q3_K, qt.IQ1_S, qt.IQ1_M, qt.IQ2_XXS, qt.IQ2_XS,
               qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S, qt.IQ4_NL, qt.IQ4_XS}),
)
# The torch engine (engine/runtime/models/, on the CPU or CUDA): every tensor is dequantized by
# carve_kernels/dequant.py.
TORCH = Runner(
    "torch",
    "has no dequantizer in the CPU engine",
    "run on the CPU engine (--gpus cpu)",
    frozenset({
        qt.F32, qt.F16, qt.BF16, qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1, qt.Q8_0,
        qt.Q2_K, qt.Q3_K, qt.Q4_K, qt.Q5_K, qt.Q6_K,
        qt.IQ1_S, qt.IQ1_M, qt.IQ2_XXS, qt.IQ2_XS, qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S,
        qt.IQ4_NL, qt.IQ4_XS, qt.MXFP4,
    }),
)
RUNNERS: dict[str, Runner] = {r.name: r for r in (TRITON, TORCH)}

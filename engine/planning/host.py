"""Host memory as a device of the plan (DESIGN.md "Experts in host memory"): the pinned
buffers a stage whose last MoE layers keep their experts in host memory runs the CPU compute
on, and the host line of the bill — every stage's pinned bytes against the RAM the machine has
available.

The experts themselves are priced per stage by `engine.planning.stage` (`host_terms`,
`host_arenas`); this module adds them up against the one host they all share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.hardware.devices import DeviceSpec
from engine.planning.buffers import BufferSpec
from engine.planning.rules import Verdict
from spec import quant_types as qt

# the arenas a GPU stage allocates in host memory (pinned) rather than on its device
HOST_PURPOSES = ("host_experts", "host_buffers")

# The share of a GPU's PCIe link rate (DeviceSpec.pcie_gbps) decode's gather of host experts
# reaches: on an H200's PCIe 5.0 x16 (63 GB/s) host-to-GPU copies ran at 53-55 GB/s and the
# gather at 90 % of that (2026-12-02, `benchmarks.device_check --moe-host`)
PCIE_SHARE = 0.78

# How a stage holds a host layer's expert tensor whose experts the CPU computes (host_compute
# "cpu"; engine.runtime.models.cpu_experts): "int4" keeps the 4-bit values with a bf16 (scale,
# zero) pair per CPU_GROUP values, "half" holds each weight dequantized once to a 16-bit float
# (f16 or bf16, whichever this CPU multiplies faster), "file" keeps the
# file's blocks (dequantized per routed expert on every product, about ten times slower).
CPU_GROUP = 32
# host_compute "both": the span of an expert tensor's CPU layout, beside the file's bytes
CPU_PREFIX = "cpu."
CPU_INT4 = (qt.Q4_0, qt.Q4_1, qt.Q4_K)
CPU_HALF = (qt.Q5_0, qt.Q5_1, qt.Q5_K, qt.Q6_K, qt.Q8_0, qt.F16, qt.BF16)


def cpu_layout(ggml_type: int, rows: int, cols: int) -> str:
    """The CPU layout of an expert matrix type (rows x cols per expert): "int4", "half" or
    "file". torch's int4 packer takes row counts that are multiples of 16."""
    if ggml_type in CPU_INT4 and rows % 16 == 0 and cols % CPU_GROUP == 0:
        return "int4"
    return "half" if ggml_type in CPU_HALF else "file"


def tensor_cpu_layout(name: str, ggml_type: int, shape: tuple[int, ...]) -> str:
    """The CPU layout of expert tensor ``name`` (GGUF shape (cols, rows, n_expert)); biases
    and anything not 3-D stay as the file has them ("file")."""
    if len(shape) != 3 or not name.endswith(".weight"):
        return "file"
    cols, rows, _ = shape
    return cpu_layout(ggml_type, rows, cols)


def cpu_bytes(name: str, ggml_type: int, shape: tuple[int, ...], nbytes: int) -> int:
    """Host bytes of expert tensor ``name`` (GGUF shape (cols, rows, n_expert), ``nbytes`` in
    the file) in its CPU layout (`tensor_cpu_layout`; the file's bytes for "file"). A size
    says nothing of the layout: Q4_1's file bytes equal its int4 layout's."""
    layout = tensor_cpu_layout(name, ggml_type, shape)
    if layout == "file":
        return nbytes
    cols, rows, n = shape
    if layout == "int4":  # 4 bits a value, then 2 x 16 bits per CPU_GROUP values
        return n * rows * cols // 2 + n * rows * (cols // CPU_GROUP) * 4
    return n * rows * cols * 2


def host_moe_buffers(hp: Any, chunk: int, act_dtype: str) -> list[BufferSpec]:
    """The pinned host buffers of a stage whose last MoE layers keep their experts in host
    memory and run them on the CPU (spans "hbuf.<name>"): the normed rows, expert ids and
    weights the GPU routed, copied down; the experts' weighted sum, copied back up; a
    float32 scratch for one expert matrix, which the CPU dequantizes per routed expert; and
    the words through which a decode step split between CPU and GPU meets."""
    e, k = hp.n_embd, hp.n_expert_used
    return [
        BufferSpec("x", (chunk, e), act_dtype),  # [chunk, n_embd] the normed rows
        BufferSpec("ids", (chunk, k), "i32"),  # [chunk, k] the experts the router chose
        BufferSpec("w", (chunk, k), "f32"),  # [chunk, k] their weights
        BufferSpec("y", (chunk, e), "f32"),  # [chunk, n_embd] the routed experts' sum
        BufferSpec("dequant", (hp.n_ff_exp * e,), "f32"),  # one expert matrix, dequantized
        # decode's split between CPU and GPU: the GPU's ticket, the host's answer, a timeout
        # mark (carve_kernels/host_split.py)
        BufferSpec("flags", (4,), "i32"),
    ]


@dataclass(frozen=True, slots=True)
class HostLayout:
    """The host line of the bill: what every stage pins, against the host's available RAM."""

    device: DeviceSpec  # the host memory: cpu_spec() (MemAvailable) or a stated size
    stages: tuple[int, ...]  # pinned bytes per stage, in plan order
    headroom: int  # free - reserve - pinned
    verdict: Verdict
    advice: str = ""

    @property
    def pinned(self) -> int:
        return sum(self.stages)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device.to_json(), "stages": list(self.stages),
                "pinned": self.pinned, "headroom": self.headroom, "verdict": self.verdict,
                "advice": self.advice}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> HostLayout:
        return cls(DeviceSpec.from_json(d["device"]), tuple(d["stages"]), d["headroom"],
                   Verdict(d["verdict"]), d.get("advice", ""))


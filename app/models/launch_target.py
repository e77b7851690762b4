"""Where a Launch would run the plan being edited, and the sentence the launch bar says about it.

Qt-free. The window knows, without torch, what NVML found: no GPU means "This machine" is the
CPU engine; a simulated rig ("2x24GiB", "rtx4090,rtx4090") prices cards this machine may not
have, so it plans but never launches.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from app.models.device_board import short_gpu_name

GPU, CPU, SIMULATED = "gpu", "cpu", "simulated"


@dataclass(frozen=True, slots=True)
class LaunchTarget:
    kind: str  # GPU | CPU | SIMULATED | "" (nothing planned)
    note: str = ""  # one sentence for the launch bar; "" when there is nothing to say

    @property
    def launchable(self) -> bool:
        return self.kind in (GPU, CPU)

    @property
    def button(self) -> str:
        return "Launch on CPU" if self.kind == CPU else "Launch"


def launch_target(devices: Sequence[Any], no_gpu: bool) -> LaunchTarget:
    """``devices``: the rig's DeviceSpecs (those the plan leaves out too: the sentence names the
    rig); ``no_gpu``: NVML found no NVIDIA GPU here."""
    if not devices:
        return LaunchTarget("")
    if any(d.simulated for d in devices):
        here = "the CPU here" if no_gpu else "its GPUs"
        return LaunchTarget(
            SIMULATED,
            f"{rig_label(devices)} is a simulated rig, for planning only: to launch, choose "
            f"“This machine” ({here}) under GPUs › Plan for.",
        )
    if all(d.is_cpu for d in devices):
        why = "No NVIDIA GPU was found, so" if no_gpu else "On this plan"
        return LaunchTarget(CPU, f"{why} the CPU engine runs the model.")
    return LaunchTarget(GPU)


def rig_label(devices: Sequence[Any]) -> str:
    """"2× RTX 4090", "2× RTX 3090 + RTX A6000": the cards in the order first named."""
    counts = Counter(short_gpu_name(str(d.name)).removesuffix(" (simulated)") for d in devices)
    return " + ".join(name if n == 1 else f"{n}× {name}" for name, n in counts.items())

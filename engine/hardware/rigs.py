"""Rigs a user may not have: common cards by name, or sizes, parsed into DeviceSpecs.

A simulated card is priced as an idle one: `free = total - DRIVER_RESERVE`. NVML v2 reports
the driver/firmware reserve outside `used` (615 MiB on an H200, DESIGN.md "Reference
figures"); we apply that measured figure to every simulated card — smaller cards reserve
somewhat less, so a simulated plan errs toward "does not fit", never toward an OOM.
"""

from __future__ import annotations

import re

from engine.hardware.devices import DeviceSpec, cpu_spec, live_specs
from spec.errors import CarveError

MIB = 1 << 20
GIB = 1 << 30
DRIVER_RESERVE = 615 * MIB

# name -> (display name, total MiB as nvidia-smi / NVML report it)
CARDS: dict[str, tuple[str, int]] = {
    "rtx3060": ("NVIDIA GeForce RTX 3060", 12288),
    "rtx3080": ("NVIDIA GeForce RTX 3080", 10240),
    "rtx3090": ("NVIDIA GeForce RTX 3090", 24576),
    "rtx3090ti": ("NVIDIA GeForce RTX 3090 Ti", 24564),
    "rtx4060ti": ("NVIDIA GeForce RTX 4060 Ti 16GB", 16380),
    "rtx4070tis": ("NVIDIA GeForce RTX 4070 Ti SUPER", 16376),
    "rtx4080": ("NVIDIA GeForce RTX 4080", 16376),
    "rtx4090": ("NVIDIA GeForce RTX 4090", 24564),
    "rtx5090": ("NVIDIA GeForce RTX 5090", 32607),
    "a4000": ("NVIDIA RTX A4000", 16376),
    "a5000": ("NVIDIA RTX A5000", 24564),
    "a6000": ("NVIDIA RTX A6000", 49140),
    "rtx6000ada": ("NVIDIA RTX 6000 Ada Generation", 49140),
    "t4": ("Tesla T4", 15360),
    "v100": ("Tesla V100-SXM2-32GB", 32768),
    "l4": ("NVIDIA L4", 23034),
    "a40": ("NVIDIA A40", 46068),
    "l40s": ("NVIDIA L40S", 46068),
    "a100-40": ("NVIDIA A100-SXM4-40GB", 40960),
    "a100-80": ("NVIDIA A100-SXM4-80GB", 81920),
    "h100": ("NVIDIA H100 80GB HBM3", 81559),
    "h100-nvl": ("NVIDIA H100 NVL", 95830),
    "h200": ("NVIDIA H200", 143771),
    "b200": ("NVIDIA B200", 183359),
}
ALIASES = {
    "a100": "a100-80",
    "h100-80": "h100",
    "rtx-a6000": "a6000",
    "4090": "rtx4090",
    "3090": "rtx3090",
    "5090": "rtx5090",
}

_UNITS = {
    "gib": GIB,
    "g": GIB,
    "gb": 10**9,
    "mib": MIB,
    "m": MIB,
    "mb": 10**6,
    "tib": 1 << 40,
    "tb": 10**12,
}
_SIZE = re.compile(r"^(\d+(?:\.\d+)?)\s*([a-z]+)$")
_COUNT = re.compile(r"^(\d+)\s*x\s*(.+)$")

ACCEPTED = (
    '"auto" (the GPUs here), "cpu", sizes like "4x24GiB" or "2x80GB,1x24GiB" '
    '(GiB/MiB are binary, GB/MB decimal), or card names like "rtx4090,rtx4090,a6000" / '
    '"2xh100"'
)


def parse_size(flag: str, text: str) -> int:
    """ "64GiB" | "96GB" | "512MiB" -> bytes (GiB/MiB binary, GB/MB decimal); CarveError
    naming ``flag`` otherwise."""
    m = _SIZE.match(text.strip().lower())
    if not m or m.group(2) not in _UNITS:
        raise CarveError(f"{flag}: cannot read {text!r}; give a size like 64GiB or 96GB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def card_names() -> list[str]:
    return sorted(CARDS)


def _card(part: str, token: str, index: int) -> DeviceSpec:
    key = ALIASES.get(token, token)
    if key in CARDS:
        name, mib = CARDS[key]
        total = mib * MIB
    else:
        m = _SIZE.match(token)
        if not m or m.group(2) not in _UNITS:
            raise CarveError(
                f"--gpus: cannot read {part!r}: not a card name or a size; accepted: {ACCEPTED}; "
                f"known cards: {', '.join(card_names())}"
            )
        total = int(float(m.group(1)) * _UNITS[m.group(2)])
        if total < GIB:
            raise CarveError(f"--gpus: {part!r} is too small for a GPU; give at least 1GiB")
        name = f"{m.group(1)} {m.group(2).upper().replace('I', 'i')} (simulated)"
    return DeviceSpec(
        index=index, name=name, total=total, free=total - DRIVER_RESERVE, simulated=True
    )


def parse_rig(text: str, reserve: int = 0) -> list[DeviceSpec]:
    """ "auto" | "cpu" | "4x24GiB" | "2x80GB,1x24GiB" | "rtx4090,rtx4090,a6000" -> DeviceSpecs.

    "auto" returns the live GPUs (possibly none: the caller says so and picks a rig).
    Simulated devices are numbered 0.. in the order written.
    """
    spec = text.strip().lower()
    if spec in ("", "auto"):
        return live_specs(reserve)
    if spec == "cpu":
        return [cpu_spec(reserve)]
    devices: list[DeviceSpec] = []
    for raw in spec.split(","):
        part = raw.strip()
        if not part:
            raise CarveError(f"--gpus: empty entry in {text!r}; accepted: {ACCEPTED}")
        m = _COUNT.match(part)
        count, token = (int(m.group(1)), m.group(2).strip()) if m else (1, part)
        if count < 1:
            raise CarveError(f"--gpus: {part!r} asks for {count} devices; use 1 or more")
        if token in ("cpu", "auto"):
            raise CarveError(f"--gpus: {token!r} cannot be mixed with other devices in {text!r}")
        for _ in range(count):
            devices.append(_card(part, token, len(devices)))
    if len(devices) > 8:
        raise CarveError(f"--gpus: {text!r} names {len(devices)} devices; Carve plans for 1 to 8")
    return [
        DeviceSpec(d.index, d.name, d.total, d.free, simulated=True, reserve=reserve)
        for d in devices
    ]

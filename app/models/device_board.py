"""What the VRAM bars show, per device: used by others, used by our engine (per term), free, and
the current plan's ghost. Qt-free: fed NVML snapshots by a poller and layouts by the plan model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.models.events import Events

# Our engine's memory, in the order the bars stack it (layout term -> label).
OUR_TERMS = (
    ("weights", "weights"),
    ("experts", "experts"),
    ("kv", "KV cache"),
    ("buffers", "buffers"),
    ("expert_cache", "expert cache"),
    ("dequant_cache", "dequant cache"),
    ("overhead", "overhead"),
    ("host_experts", "pinned experts"),  # the host row's: experts and buffers in host memory
)
HOST_KEY, HOST_INDEX = "host", -2  # the host row: shown while a plan pins experts there


@dataclass(slots=True)
class DeviceRow:
    """One bar. Bytes throughout; ``ours`` is empty until the engine has loaded."""

    key: str  # uuid or "sim:N": rows keep their identity across polls
    name: str
    index: int
    total: int
    used: int  # everything NVML counts as used (ours included)
    ours: dict[str, int] = field(default_factory=dict)
    planned: int = 0  # the plan's total on this device (ghost), 0 when excluded or launched
    verdict: str = ""
    temperature: int | None = None
    utilization: int | None = None
    simulated: bool = False
    excluded: bool = False

    @property
    def ours_total(self) -> int:
        return sum(self.ours.values())

    @property
    def others(self) -> int:
        return max(0, self.used - self.ours_total)

    @property
    def free(self) -> int:
        return max(0, self.total - self.used)


class DeviceBoard:
    """The devices being shown: live NVML rows, or a simulated rig when there is no driver."""

    def __init__(self) -> None:
        self.events = Events("rows", "values")
        self.rows: list[DeviceRow] = []
        self.simulated = False
        self.rig = ""
        self.nvml_error = ""
        self._launched: dict[int, dict[str, int]] = {}  # device index -> our terms after load
        self._host: DeviceRow | None = None  # host RAM, while the plan pins experts there

    # -- inputs ------------------------------------------------------------------------------
    def set_snapshots(self, snaps: list[Any]) -> None:
        """A fresh NVML view (``engine.hardware.devices.snapshot()``); keeps our-engine figures."""
        if self.simulated:
            return
        rows = [
            DeviceRow(
                key=str(getattr(s, "uuid", "") or f"gpu:{_cuda_index(s)}"),
                name=str(s.name),
                index=_cuda_index(s),
                total=int(s.total),
                used=int(getattr(s, "used", s.total - s.free)),
                temperature=_opt_int(getattr(s, "temperature", None)),
                utilization=_opt_int(getattr(s, "utilization", None)),
            )
            for s in snaps
        ]
        self._install(rows)

    def set_simulated(self, rig: str, specs: list[Any]) -> None:
        """Plan for a rig the machine does not have: its cards shown as given (free as stated)."""
        self.simulated, self.rig = True, rig
        rows = [
            DeviceRow(
                key=f"sim:{i}:{d.name}",
                name=str(d.name),
                index=int(d.index),
                total=int(d.total),
                used=int(d.total - d.free),
                simulated=True,
            )
            for i, d in enumerate(specs)
        ]
        self._install(rows)

    def set_live(self) -> None:
        self.simulated, self.rig = False, ""

    def _install(self, rows: list[DeviceRow]) -> None:
        rows = [r for r in rows if r.key != HOST_KEY] + ([self._host] if self._host else [])
        old = {r.key: r for r in self.rows}
        same = [r.key for r in rows] == [r.key for r in self.rows]
        for r in rows:
            prev = old.get(r.key)
            if prev is not None:
                r.planned, r.verdict, r.excluded = prev.planned, prev.verdict, prev.excluded
            r.ours = dict(self._launched.get(r.index, {}))
            if r.simulated and r.ours:
                r.used = r.ours_total  # a simulated card is used only by what we put there
        self.rows = rows
        (self.events.values if same else self.events.rows).emit()

    def set_plan(self, layout: Any, excluded_indices: set[int] | frozenset[int] = frozenset()) -> None:
        """The ghost: what the plan being edited will take on each device, coloured by verdict."""
        per_index = {}
        if layout is not None:
            per_index = {d.device.index: (d.total, d.verdict) for d in layout.devices}
        host = getattr(layout, "host", None)
        had = self._host is not None
        self._host = None if host is None else DeviceRow(
            key=HOST_KEY, name="host RAM", index=HOST_INDEX, total=host.device.total,
            used=host.device.total - host.device.free)
        if host is not None:
            per_index[HOST_INDEX] = (host.pinned, host.verdict)
        if had or host is not None:  # the host row comes, goes or takes this machine's figures
            self._install(list(self.rows))
        for r in self.rows:
            r.planned, r.verdict = per_index.get(r.index, (0, ""))
            r.excluded = r.index in excluded_indices
        self.events.values.emit()

    def set_launched(self, layout: Any | None) -> None:
        """After ``loaded``: our engine holds the layout's terms (priced == allocated); None after
        unload or a crash."""
        self._launched = {}
        if layout is not None:
            for d in layout.devices:
                terms = d.terms
                self._launched[d.device.index] = {
                    "weights": terms.get("weights", 0) + terms.get("globals", 0)
                    + terms.get("rounding", 0),
                    "experts": terms.get("experts", 0),
                    "kv": terms.get("kv", 0),
                    "buffers": terms.get("buffers", 0),
                    "expert_cache": terms.get("expert_cache", 0),
                    "dequant_cache": terms.get("dequant_cache", 0),
                    "overhead": terms.get("overhead", 0),
                }
            if getattr(layout, "host", None) is not None:
                self._launched[HOST_INDEX] = {"host_experts": layout.host.pinned}
        for r in self.rows:
            if r.simulated:
                r.used = max(0, r.used - r.ours_total)
            r.ours = dict(self._launched.get(r.index, {}))
            if r.simulated:
                r.used += r.ours_total
        self.events.values.emit()

    @property
    def launched(self) -> bool:
        return bool(self._launched)


def short_gpu_name(name: str) -> str:
    """"NVIDIA GeForce RTX 4090" -> "RTX 4090": the vendor is implied in a table of GPUs."""
    for prefix in ("NVIDIA GeForce ", "NVIDIA ", "GeForce "):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _cuda_index(snap: Any) -> int:
    """engine.hardware.devices.DeviceSnapshot numbers GPUs by CUDA (PCI bus) order as ``cuda_index``;
    the plan's DeviceSpec.index is that same number, so rows and plan devices line up."""
    return int(getattr(snap, "cuda_index", getattr(snap, "index", -1)))


def _opt_int(value: Any) -> int | None:
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None

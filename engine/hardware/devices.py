"""Live GPU snapshots from NVML, and the device description a Plan is priced for.

Pure Python (no torch): the GUI polls `snapshot()` four times a second, so NVML is initialised
once and the device handles are kept open; a poll is a handful of NVML calls per GPU.
No driver, no library, no GPU: `snapshot()` returns [] and `no_gpu_reason()` says why —
never an exception, because "no GPU" is a state the GUI shows, not a crash.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """One device a Plan is priced for: a live GPU, a simulated card, or the CPU (index -1)."""

    index: int  # CUDA index under CUDA_DEVICE_ORDER=PCI_BUS_ID; -1 for "cpu"
    name: str
    total: int  # bytes
    free: int  # bytes free now (live) or usable on an idle card (simulated)
    uuid: str = ""
    simulated: bool = False
    reserve: int = 0  # bytes the user keeps free on this device (display, other apps)
    used_by_others: int = 0  # bytes other processes hold now (already outside `free`)
    pcie_gbps: float = 0.0  # the host link's rate each way (PCIe generation x lanes); 0: unknown

    @property
    def is_cpu(self) -> bool:
        return self.index < 0

    @property
    def label(self) -> str:
        return "CPU" if self.is_cpu else f"GPU {self.index}"

    def to_json(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__slots__}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DeviceSpec:
        return cls(**{f: data[f] for f in cls.__slots__ if f in data})


@dataclass(frozen=True, slots=True)
class ProcessUse:
    pid: int
    used: int | None  # bytes; None where the driver hides it (containers, Windows WDDM)


@dataclass(frozen=True, slots=True)
class DeviceSnapshot:
    """What NVML says about one GPU right now."""

    nvml_index: int
    cuda_index: (
        int  # PCI-bus order among the GPUs CUDA can see; -1 if hidden by CUDA_VISIBLE_DEVICES
    )
    name: str
    uuid: str
    pci_bus_id: str  # "00000000:17:00.0"
    total: int  # bytes
    free: int
    used: int
    reserved: int  # driver/firmware reserve (v2 memory info), outside `used`; 0 on v1
    temperature: int | None  # degrees C
    utilization: int | None  # percent, GPU core
    memory_utilization: int | None  # percent, memory controller
    processes: tuple[ProcessUse, ...] = ()
    pcie_gbps: float = 0.0  # the host link's rate each way (`pcie_rate`); 0: unknown

    def used_by_others(self, own_pids: frozenset[int] = frozenset()) -> int:
        """Bytes held by processes not in `own_pids` (the visible ones only)."""
        return sum(p.used or 0 for p in self.processes if p.pid not in own_pids)

    def to_spec(self, reserve: int = 0, own_pids: frozenset[int] = frozenset()) -> DeviceSpec:
        # `free` already excludes every process; bytes our own engine holds come back when
        # it restarts, so they count as free for a new plan.
        own = sum(p.used or 0 for p in self.processes if p.pid in own_pids)
        return DeviceSpec(
            index=self.cuda_index,
            name=self.name,
            total=self.total,
            free=self.free + own,
            uuid=self.uuid,
            reserve=reserve,
            used_by_others=self.used_by_others(own_pids),
            pcie_gbps=self.pcie_gbps,
        )


# GB/s one PCIe lane carries each way, by generation, after its line encoding
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


def pcie_rate(nvml: Any, h: Any) -> float:
    """GB/s each way of the link between the host and GPU ``h``: the highest PCIe generation
    and width the GPU and its slot both support (an idle GPU drops its current link to save
    power, so the current one says little); 0 where NVML does not say."""
    try:
        gen = int(nvml.nvmlDeviceGetMaxPcieLinkGeneration(h))
        width = int(nvml.nvmlDeviceGetMaxPcieLinkWidth(h))
    except Exception:  # noqa: BLE001 - not supported here (or an older binding): unknown
        return 0.0
    return PCIE_LANE_GBPS.get(gen, 0.0) * max(width, 0)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_order(pci_ids: list[str], uuids: list[str], visible: str | None) -> list[int]:
    """CUDA index of each NVML device under CUDA_DEVICE_ORDER=PCI_BUS_ID (-1 = not visible).

    CUDA enumerates in PCI bus order (we always launch the engine with that order); NVML's
    own order is not guaranteed to match, so the mapping goes through the bus ids.
    CUDA_VISIBLE_DEVICES may list indices (into the PCI order) or UUID prefixes.
    """
    order = sorted(range(len(pci_ids)), key=lambda i: pci_ids[i].lower())
    if visible is None or visible.strip() == "":
        if visible is not None:  # set but empty: CUDA sees nothing
            return [-1] * len(pci_ids)
        result = [0] * len(pci_ids)
        for cuda, nvml in enumerate(order):
            result[nvml] = cuda
        return result
    result = [-1] * len(pci_ids)
    for cuda, item in enumerate(x.strip() for x in visible.split(",")):
        nvml = None
        if item.lstrip("-").isdigit():
            pos = int(item)
            if 0 <= pos < len(order):
                nvml = order[pos]
        else:
            matches = [i for i, u in enumerate(uuids) if u.startswith(item) and item]
            nvml = matches[0] if len(matches) == 1 else None
        if nvml is None or result[nvml] != -1:
            break  # CUDA stops enumerating at the first invalid entry
        result[nvml] = cuda
    return result


class NvmlMonitor:
    """Holds NVML open and answers snapshots. `nvml` is injectable so tests run without a GPU."""

    def __init__(self, nvml: ModuleType | None = None) -> None:
        self._nvml = nvml
        self._lock = threading.Lock()
        self._handles: list[Any] | None = None
        # name, uuid, pci bus id, host link GB/s per NVML index
        self._static: list[tuple[str, str, str, float]] = []
        self._cuda: list[int] = []
        self._v2 = True
        self.reason = ""
        self.driver = ""
        self._errors: tuple[type[BaseException], ...] = (OSError,)

    def _open(self) -> bool:
        if self._handles is not None:
            return bool(self._handles)
        self._handles = []
        try:
            nvml = self._nvml
            if nvml is None:
                import pynvml as nvml  # nvidia-ml-py

                self._nvml = nvml
            nvml.nvmlInit()
            self.driver = _text(nvml.nvmlSystemGetDriverVersion())
            count = nvml.nvmlDeviceGetCount()
            handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
            static = []
            for h in handles:
                pci = nvml.nvmlDeviceGetPciInfo(h)
                bus = _text(getattr(pci, "busId", "") or getattr(pci, "busIdLegacy", ""))
                static.append(
                    (_text(nvml.nvmlDeviceGetName(h)), _text(nvml.nvmlDeviceGetUUID(h)), bus,
                     pcie_rate(nvml, h))
                )
        # Library missing, driver missing, broken or mismatched: "no GPU" is a state the GUI
        # shows, never a crash, whatever the binding raises.
        except Exception as exc:  # noqa: BLE001
            self.reason = f"no NVIDIA GPU found: {type(exc).__name__}: {exc}".strip().rstrip(":")
            return False
        if not handles:
            self.reason = "no NVIDIA GPU found: the NVIDIA driver reports 0 devices"
            return False
        self._handles, self._static = handles, static
        self._errors = (getattr(nvml, "NVMLError", OSError), OSError, AttributeError, TypeError)
        self._cuda = _cuda_order(
            [s[2] for s in static], [s[1] for s in static], os.environ.get("CUDA_VISIBLE_DEVICES")
        )
        return True

    def _memory(self, h: Any) -> tuple[int, int, int, int]:
        nvml = self._nvml
        if self._v2:
            try:
                m = nvml.nvmlDeviceGetMemoryInfo(h, version=nvml.nvmlMemory_v2)
                return int(m.total), int(m.free), int(m.used), int(m.reserved)
            except self._errors:
                self._v2 = False  # old driver: v1 folds the reserve into `used`
        m = nvml.nvmlDeviceGetMemoryInfo(h)
        return int(m.total), int(m.free), int(m.used), 0

    def _processes(self, h: Any) -> tuple[ProcessUse, ...]:
        nvml = self._nvml
        seen: dict[int, ProcessUse] = {}
        for fn in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
            try:
                procs = getattr(nvml, fn)(h)
            except self._errors:  # not supported on this GPU/driver: no per-process figures
                procs = []
            for p in procs:
                used = getattr(p, "usedGpuMemory", None)
                # NVML_VALUE_NOT_AVAILABLE (ULL max) where the driver hides per-process use
                used = None if used is None or used >= (1 << 63) else int(used)
                seen.setdefault(int(p.pid), ProcessUse(int(p.pid), used))
        return tuple(seen.values())

    def opened(self) -> bool:
        """NVML is up and found at least one GPU (initialises on first use)."""
        with self._lock:
            return self._open()

    def snapshot(self) -> list[DeviceSnapshot]:
        with self._lock:
            if not self._open():
                return []
            nvml = self._nvml
            out = []
            for i, h in enumerate(self._handles or []):
                name, uuid, bus, link = self._static[i]
                try:
                    total, free, used, reserved = self._memory(h)
                except (
                    self._errors
                ) as exc:  # GPU fell off the bus mid-session: report, keep polling others
                    self.reason = f"GPU {i} ({name}) stopped answering NVML: {exc}"
                    continue
                try:
                    temp = int(nvml.nvmlDeviceGetTemperature(h, nvml.NVML_TEMPERATURE_GPU))
                except self._errors:
                    temp = None
                try:
                    rates = nvml.nvmlDeviceGetUtilizationRates(h)
                    util, mem_util = int(rates.gpu), int(rates.memory)
                except self._errors:
                    util = mem_util = None
                out.append(
                    DeviceSnapshot(
                        nvml_index=i,
                        cuda_index=self._cuda[i],
                        name=name,
                        uuid=uuid,
                        pci_bus_id=bus,
                        total=total,
                        free=free,
                        used=used,
                        reserved=reserved,
                        temperature=temp,
                        utilization=util,
                        memory_utilization=mem_util,
                        processes=self._processes(h),
                        pcie_gbps=link,
                    )
                )
            return out


_MONITOR: NvmlMonitor | None = None


def monitor() -> NvmlMonitor:
    global _MONITOR
    if _MONITOR is None:
        _MONITOR = NvmlMonitor()
    return _MONITOR


def snapshot() -> list[DeviceSnapshot]:
    """Every NVIDIA GPU now, in NVML order; [] with no driver or no GPU (see `no_gpu_reason`)."""
    return monitor().snapshot()


def no_gpu_reason() -> str:
    """Why `snapshot()` is empty ("no NVIDIA GPU found: ..."), or "" when GPUs were found."""
    mon = monitor()
    return "" if mon.opened() else mon.reason


def driver_version() -> str:
    """The NVIDIA driver version ("580.65.06"), "" without a driver. Cheap after the first call."""
    mon = monitor()
    mon.opened()
    return mon.driver


def live_specs(reserve: int = 0, own_pids: frozenset[int] = frozenset()) -> list[DeviceSpec]:
    """The CUDA-visible GPUs as DeviceSpecs, in CUDA index order."""
    snaps = [s for s in snapshot() if s.cuda_index >= 0]
    return [s.to_spec(reserve, own_pids) for s in sorted(snaps, key=lambda s: s.cuda_index)]


def cpu_spec(reserve: int = 0) -> DeviceSpec:
    """System RAM as a device: total and available from /proc/meminfo (Linux)."""
    total = avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                if key == "MemTotal":
                    total = int(rest.split()[0]) * 1024
                elif key == "MemAvailable":
                    avail = int(rest.split()[0]) * 1024
    except OSError:
        pass
    if total == 0:  # not Linux: fall back to what POSIX can tell
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = avail = 0
    return DeviceSpec(index=-1, name="cpu", total=total, free=avail or total, reserve=reserve)


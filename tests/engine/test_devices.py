"""NVML snapshots against a fake NVML module (no GPU here), and simulated rigs."""

from __future__ import annotations

import types
from typing import Any

import pytest

from engine.hardware import devices
from engine.hardware.devices import NvmlMonitor, _cuda_order
from engine.hardware.rigs import CARDS, DRIVER_RESERVE, parse_rig
from spec.errors import CarveError

GIB = 1 << 30
MIB = 1 << 20


class FakeNVMLError(Exception):
    pass


def fake_nvml(
    gpus: list[dict[str, Any]], v2: bool = True, fail_init: bool = False
) -> types.SimpleNamespace:
    """A stand-in for pynvml with the calls NvmlMonitor makes; counts nvmlInit."""
    calls = {"init": 0}

    def init() -> None:
        calls["init"] += 1
        if fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def memory(h: int, version: Any = None) -> Any:
        g = gpus[h]
        if version is not None:
            if not v2:
                raise FakeNVMLError("Function Not Found")
            return types.SimpleNamespace(
                total=g["total"], free=g["free"], used=g["used"], reserved=g["reserved"]
            )
        return types.SimpleNamespace(
            total=g["total"], free=g["free"], used=g["used"] + g["reserved"]
        )

    def procs(h: int) -> list[Any]:
        return [types.SimpleNamespace(pid=p, usedGpuMemory=u) for p, u in gpus[h].get("procs", [])]

    def graphics(h: int) -> list[Any]:
        raise FakeNVMLError("Not Supported")

    return types.SimpleNamespace(
        calls=calls,
        NVMLError=FakeNVMLError,
        nvmlMemory_v2=0x2000028,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlSystemGetDriverVersion=lambda: "580.65.06",
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=gpus[h]["bus"].encode()),
        nvmlDeviceGetName=lambda h: gpus[h]["name"],
        nvmlDeviceGetUUID=lambda h: gpus[h]["uuid"],
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetTemperature=lambda h, s: 41 + h,
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=7 * h, memory=3),
        nvmlDeviceGetComputeRunningProcesses=procs,
        nvmlDeviceGetGraphicsRunningProcesses=graphics,
    )


def two_gpus() -> list[dict[str, Any]]:
    # NVML order deliberately not PCI order: CUDA (PCI_BUS_ID) index 0 is NVML's device 1
    return [
        {
            "name": "NVIDIA RTX A6000",
            "uuid": "GPU-bbbb",
            "bus": "00000000:81:00.0",
            "total": 48 * GIB,
            "free": 40 * GIB,
            "used": 8 * GIB - 500 * MIB,
            "reserved": 500 * MIB,
            "procs": [(100, 6 * GIB), (200, (1 << 64) - 1)],
        },
        {
            "name": "NVIDIA GeForce RTX 4090",
            "uuid": "GPU-aaaa",
            "bus": "00000000:17:00.0",
            "total": 24 * GIB,
            "free": 23 * GIB,
            "used": 400 * MIB,
            "reserved": 624 * MIB,
        },
    ]


def test_snapshot_reads_v2_memory_processes_and_maps_cuda_order(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml = fake_nvml(two_gpus())
    mon = NvmlMonitor(nvml)  # type: ignore[arg-type]
    snaps = mon.snapshot()
    assert [s.name for s in snaps] == ["NVIDIA RTX A6000", "NVIDIA GeForce RTX 4090"]
    assert [s.cuda_index for s in snaps] == [1, 0]  # by PCI bus id
    a6000 = snaps[0]
    assert (a6000.total, a6000.free, a6000.reserved) == (48 * GIB, 40 * GIB, 500 * MIB)
    assert a6000.temperature == 41 and a6000.utilization == 0
    assert [(p.pid, p.used) for p in a6000.processes] == [
        (100, 6 * GIB),
        (200, None),
    ]  # hidden use -> None
    assert a6000.used_by_others() == 6 * GIB
    spec = a6000.to_spec(reserve=MIB, own_pids=frozenset({100}))
    assert (
        spec.index == 1
        and spec.free == 46 * GIB
        and spec.used_by_others == 0
        and spec.reserve == MIB
    )
    assert mon.driver == "580.65.06" and mon.reason == ""
    # a binding without the PCIe link calls: the link's rate is unknown, nothing else changes
    assert spec.pcie_gbps == 0.0


def test_the_host_link_rate_is_the_max_generation_times_width() -> None:
    """The GPU's host link (each way): the highest PCIe generation and width the GPU and its
    slot both support, read once; a GPU whose driver does not say gets 0 (unknown)."""
    nvml = fake_nvml(two_gpus())
    link = {0: (4, 16), 1: (5, 8)}
    asked = []

    def gen(h: int) -> int:
        asked.append(h)
        if h not in link:
            raise FakeNVMLError("Not Supported")
        return link[h][0]

    nvml.nvmlDeviceGetMaxPcieLinkGeneration = gen
    nvml.nvmlDeviceGetMaxPcieLinkWidth = lambda h: link[h][1]
    mon = NvmlMonitor(nvml)  # type: ignore[arg-type]
    for _ in range(3):
        snaps = mon.snapshot()
    assert sorted(asked) == [0, 1]  # static: read when NVML opens, not every poll
    assert [round(s.pcie_gbps, 2) for s in snaps] == [31.5, 31.5]  # 4.0 x16; 5.0 x8
    assert snaps[0].to_spec().pcie_gbps == snaps[0].pcie_gbps
    del link[1]
    assert devices.pcie_rate(nvml, 1) == 0.0


def test_nvml_is_initialised_once_for_many_polls() -> None:
    nvml = fake_nvml(two_gpus())
    mon = NvmlMonitor(nvml)  # type: ignore[arg-type]
    for _ in range(20):
        assert len(mon.snapshot()) == 2
    assert nvml.calls["init"] == 1


def test_v1_fallback_when_v2_memory_info_is_missing() -> None:
    mon = NvmlMonitor(fake_nvml(two_gpus(), v2=False))  # type: ignore[arg-type]
    s = mon.snapshot()[1]
    assert s.reserved == 0 and s.used == 400 * MIB + 624 * MIB and s.free == 23 * GIB


def test_no_driver_is_an_empty_list_and_a_reason_never_an_exception() -> None:
    nvml = fake_nvml([], fail_init=True)
    mon = NvmlMonitor(nvml)  # type: ignore[arg-type]
    assert mon.snapshot() == [] and mon.snapshot() == []
    assert mon.reason.startswith("no NVIDIA GPU found: ") and "Shared Library" in mon.reason
    assert nvml.calls["init"] == 1  # a missing driver is not re-probed 4x/s


def test_zero_devices_is_a_reason_too() -> None:
    mon = NvmlMonitor(fake_nvml([]))  # type: ignore[arg-type]
    assert mon.snapshot() == [] and "0 devices" in mon.reason


def test_module_level_snapshot_without_a_driver_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "_MONITOR", NvmlMonitor(fake_nvml([], fail_init=True)))  # type: ignore[arg-type]
    assert devices.snapshot() == [] and devices.live_specs() == []
    assert devices.no_gpu_reason().startswith("no NVIDIA GPU found")
    assert devices.driver_version() == ""


def test_live_specs_in_cuda_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(devices, "_MONITOR", NvmlMonitor(fake_nvml(two_gpus())))  # type: ignore[arg-type]
    specs = devices.live_specs(reserve=256 * MIB)
    assert [(s.index, s.name) for s in specs] == [
        (0, "NVIDIA GeForce RTX 4090"),
        (1, "NVIDIA RTX A6000"),
    ]
    assert all(s.reserve == 256 * MIB and not s.simulated for s in specs)
    assert parse_rig("auto") == specs[:0] + devices.live_specs()


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, [1, 2, 0]),
        ("", [-1, -1, -1]),
        ("2,0", [-1, 0, 1]),  # CUDA index 0 = PCI position 2 (NVML 1), 1 = PCI 0 (NVML 2)
        ("GPU-c", [-1, -1, 0]),
        ("1,7,0", [0, -1, -1]),  # CUDA stops at the first invalid entry
    ],
)
def test_cuda_visible_devices(visible: str | None, expected: list[int]) -> None:
    pci = ["0000:41:00.0", "0000:c1:00.0", "0000:01:00.0"]  # PCI order: NVML 2, 0, 1
    uuids = ["GPU-a", "GPU-b", "GPU-c"]
    assert _cuda_order(pci, uuids, visible) == expected


def test_rig_sizes_and_cards() -> None:
    rig = parse_rig("2x80GB,1x24GiB")
    assert [d.total for d in rig] == [80 * 10**9, 80 * 10**9, 24 * GIB]
    assert all(d.free == d.total - DRIVER_RESERVE and d.simulated for d in rig)
    assert [d.index for d in rig] == [0, 1, 2]
    cards = parse_rig("rtx4090, RTX4090,a6000", reserve=MIB)
    assert [d.name for d in cards] == [CARDS["rtx4090"][0]] * 2 + [CARDS["a6000"][0]]
    assert cards[2].total == 49140 * MIB and cards[0].reserve == MIB
    assert len(parse_rig("4x24GiB")) == 4 and len(parse_rig("2xh100")) == 2
    cpu = parse_rig("cpu")
    assert len(cpu) == 1 and cpu[0].index == -1 and cpu[0].total > 0


@pytest.mark.parametrize(
    ("text", "part"),
    [
        ("4x24GiBs", "4x24gibs"),
        ("rtx9999", "rtx9999"),
        ("2x80GB,,1x24GiB", "empty"),
        ("0x24GiB", "0x24gib"),
        ("9x24GiB", "9 devices"),
        ("cpu,4090", "cpu"),
        ("512MiB", "too small"),
    ],
)
def test_bad_rigs_name_the_part_and_the_accepted_forms(text: str, part: str) -> None:
    with pytest.raises(CarveError, match="--gpus") as err:
        parse_rig(text)
    assert part in str(err.value)
    if part in ("4x24gibs", "rtx9999"):  # unreadable: list what is accepted
        assert "4x24GiB" in str(err.value) and "rtx4090" in str(err.value)

"""Live GPUs through NVML, faked at engine.hardware.devices.snapshot: the poller's thread, the bars, the plan."""

from __future__ import annotations

import pytest

from app.nvml_poller import NvmlPoller
from app.theme import LIGHT
from app.window_main import MainWindow
from engine.hardware import devices
from engine.hardware.devices import DeviceSnapshot, ProcessUse

GIB = 1 << 30


def h200(i: int, used_gib: float, pids=()) -> DeviceSnapshot:
    used = int(used_gib * GIB)
    total = 140 * GIB
    return DeviceSnapshot(nvml_index=i, cuda_index=i, name="NVIDIA H200", uuid=f"GPU-{i}",
                          pci_bus_id=f"0000:0{i}:00.0", total=total, free=total - used, used=used,
                          reserved=615 << 20, temperature=40 + i, utilization=5,
                          memory_utilization=1,
                          processes=tuple(ProcessUse(p, u) for p, u in pids))


@pytest.fixture
def fake_nvml(monkeypatch):
    state = {"snaps": [h200(0, 2.0), h200(1, 30.0)], "calls": 0}

    def snapshot():
        state["calls"] += 1
        return list(state["snaps"])

    monkeypatch.setattr(devices, "snapshot", snapshot)
    return state


def test_poller_delivers_snapshots_from_its_thread(qtbot, fake_nvml):
    poller = NvmlPoller(interval_ms=20)
    got = []
    poller.snapshots.connect(got.append)
    poller.start()
    qtbot.waitUntil(lambda: len(got) >= 3, timeout=5000)
    poller.stop()
    assert got[0][1].name == "NVIDIA H200"
    assert poller.worker.polls >= 3 and poller.cpu_fraction(1.0) < 0.5


def test_live_gpus_are_planned_and_refreshed(qtbot, fake_nvml):
    w = MainWindow(LIGHT, live_poll=False, remember=False)
    qtbot.addWidget(w)
    w.set_rig("auto")
    assert w.rig == "auto" and not w.board.simulated
    assert not w.rig_picker.banner.isVisibleTo(w)  # GPUs found: no "simulated" banner
    assert [d.name for d in w.plan.devices] == ["NVIDIA H200"] * 2
    # another process takes 50 GiB on GPU 0: the next poll moves the bar and the free figure
    fake_nvml["snaps"] = [h200(0, 52.0, pids=[(4242, 50 * GIB)]), h200(1, 30.0)]
    w._on_snapshots(devices.snapshot())
    assert w.board.rows[0].others == int(52.0 * GIB)
    assert w.plan.devices[0].free == 88 * GIB
    assert "40 °C" in w.vram._captions[0].toPlainText()

"""GUI tests run headless; every test gets its own empty config folder."""

from __future__ import annotations

import os

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")  # before anything imports Qt

import pytest


@pytest.fixture(autouse=True)
def _config_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("CARVE_CONFIG_DIR", str(tmp_path / "config"))
    return tmp_path / "config"


@pytest.fixture
def make_gpu():
    """``make_gpu(index, free_mib)``: a simulated device with exactly that much free."""
    from engine.hardware.devices import DeviceSpec

    def make(index: int, free_mib: int, total_mib: int = 24576, name: str = "Test GPU"):
        return DeviceSpec(index=index, name=name, total=total_mib << 20, free=free_mib << 20,
                          simulated=True)

    return make


import app.pyside_refcount  # noqa: E402, F401  (PySide6 6.12.0 refcount bug: before any Qt call)

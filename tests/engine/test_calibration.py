"""Carve's config folder (one rule for presets and calibration records) and the tests' isolation
from the machine's own folders (tests/conftest.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.models.presets import PresetStore
from engine.gguf import demo
from engine.hardware import calibration
from engine.hardware.devices import DeviceSpec
from engine.hardware.rigs import parse_rig
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.synth.header import HeaderModel
from engine.synth.shapes import SHAPES

MIB = 1 << 20


def test_config_dir_is_one_rule_for_presets_and_calibration(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert calibration.config_dir() == tmp_path / "home" / ".config" / "carve"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    assert calibration.config_dir() == tmp_path / "xdg" / "carve"
    monkeypatch.setenv("CARVE_CONFIG_DIR", str(tmp_path / "own"))
    assert calibration.config_dir() == tmp_path / "own"
    assert calibration.path() == tmp_path / "own" / "calibration.json"
    assert PresetStore().root == tmp_path / "own"


def test_calibration_records_follow_the_config_dir(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CARVE_CONFIG_DIR", str(tmp_path / "a"))
    calibration.remember("NVIDIA Test Card", "580.1", calibration.torch_version(), 555 * MIB)
    assert (tmp_path / "a" / "calibration.json").is_file()
    card = DeviceSpec(index=0, name="NVIDIA Test Card", total=24 << 30, free=23 << 30,
                      simulated=True)
    assert calibration.overhead_for(card)[0] == 555 * MIB
    monkeypatch.setenv("CARVE_CONFIG_DIR", str(tmp_path / "b"))  # read again, at once
    assert calibration.overhead_for(card)[0] == calibration.DEFAULT_OVERHEAD


def test_tests_see_no_folder_of_the_machine(tmp_path_factory) -> None:
    base = tmp_path_factory.getbasetemp()
    for folder in (calibration.config_dir(), PresetStore().root, demo.cache_dir()):
        assert folder.is_relative_to(base), folder
    assert not calibration.path().exists()  # every test starts uncalibrated


def _rig_price() -> dict:
    model = HeaderModel(SHAPES["llama3-8b"], name="llama3-8b.gguf")
    devices = tuple(parse_rig("rtx4090,rtx4090"))
    layout = price(Plan(str(model.paths[0]), devices, (0, 16, 32), ctx=4096), model)
    return layout.to_json()  # every term, verdict, headroom and where the overhead came from


def test_simulated_rig_prices_the_same_with_a_calibration_file_on_the_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # simulated cards take the newest record for their name: one measured on this machine
    # would change what the tests see, unless the test's config folder hides it
    without = _rig_price()
    home = tmp_path / "home"
    machine = home / ".config" / "carve" / "calibration.json"
    machine.parent.mkdir(parents=True)
    record = {"gpu": parse_rig("rtx4090")[0].name, "driver": "580.1",
              "torch": calibration.torch_version(), "overhead": 3000 * MIB,
              "measured": "2999-01-01T00:00:00Z"}
    machine.write_text(json.dumps({"records": [record]}))
    monkeypatch.setenv("HOME", str(home))
    assert _rig_price() == without
    # and the file is one pricing would read outside the tests' folders: the check can fail
    monkeypatch.delenv("XDG_CONFIG_HOME")
    assert calibration.path() == machine
    assert _rig_price() != without

"""Experts in host memory in the window: the plan model's per-GPU placement (Auto or counts)
and expert-cache slots, the launch settings' controls, and the fit check's host line, cache
column and bottleneck."""

from __future__ import annotations

import pytest

from app.models.plan_model import PlanModel
from app.theme import LIGHT
from app.widgets.fit_check import COLUMNS, FitCheck
from app.widgets.launch_settings import LaunchSettings
from engine.gguf.hparams import HParams
from engine.hardware import devices, native
from engine.hardware.devices import DeviceSpec
from engine.planning.carve import is_expert
from engine.planning.host import cpu_bytes
from engine.planning.rules import Verdict
from engine.synth.header import HeaderModel
from engine.synth.shapes import SHAPES

GIB, MIB = 1 << 30, 1 << 20


@pytest.fixture
def plan(monkeypatch) -> PlanModel:
    """qwen3moe-30b-a3b (its tensor table, no file) on a 12 GiB card, a host with 48 GiB free."""
    monkeypatch.setattr(devices, "cpu_spec", lambda reserve=0: DeviceSpec(
        -1, "cpu", 64 * GIB, 48 * GIB, reserve=reserve))
    m = PlanModel()
    gguf = HeaderModel(SHAPES["qwen3moe-30b-a3b"])
    m.set_model(gguf, HParams.from_model(gguf))
    m.set_devices([DeviceSpec(0, "card", 12 * GIB, 12 * GIB - 615 * MIB, simulated=True)])
    return m


def test_auto_places_experts_and_counts_override_it(plan) -> None:
    lay = plan.layout
    assert lay.fits and lay.host is not None and lay.plan.experts_resident == (23,)
    plan.set_experts_resident((48,))  # every layer's experts in VRAM: VRAM is the bottleneck
    assert plan.verdict() == Verdict.DOES_NOT_FIT
    assert plan.layout.bottleneck().startswith("does not fit: the bottleneck is VRAM of GPU 0")
    plan.set_experts_resident((10,))
    assert plan.layout.fits and plan.layout.plan.experts_resident == (10,)
    plan.set_expert_slots(16)
    d = plan.layout.devices[0]
    assert d.terms["expert_cache"] == 16 * d.span("expert_cache")[1].shape[1] + d.span(
        "expert_stream")[1].nbytes
    saved = plan.settings()
    assert saved["experts_resident"] == [10] and saved["expert_slots"] == 16
    plan.set_experts_resident(None)
    plan.set_expert_slots(0)
    assert plan.layout.plan.experts_resident == (23,) and plan.layout.plan.expert_slots == ()
    plan.apply_settings(saved)
    assert (plan.experts_resident, plan.expert_slots) == ((10,), 16)


def test_settings_and_fit_check_show_the_placement(qtbot, plan) -> None:
    settings, fit = LaunchSettings(plan), FitCheck(plan, LIGHT)
    qtbot.addWidget(settings)
    qtbot.addWidget(fit)
    settings.show()
    fit.show()
    assert settings.resident_edit.isVisible() and settings.resident_edit.text() == ""
    assert "GPU 0: experts of 23 of its 48 MoE layers in VRAM (its first), 25 in host memory" in (
        fit.advice.text())
    assert "host RAM: " in fit.advice.text() and "of 48.00 GiB available now" in fit.advice.text()
    cache = next(i for i, (_, key) in enumerate(COLUMNS) if key == "expert_cache")
    # the cache term: the staging span host layers' experts are copied into
    assert not fit.table.isColumnHidden(cache)
    settings.resident_edit.setText("48")
    settings.resident_edit.editingFinished.emit()
    assert plan.experts_resident == (48,)
    assert fit.table.isColumnHidden(cache)  # no host layers, no slots
    assert "— the bottleneck is VRAM of GPU 0 (over by 7.17 GiB)" in fit.summary.text()
    settings.resident_edit.setText("x,1")
    settings.resident_edit.editingFinished.emit()
    assert plan.experts_resident == (48,)  # unreadable: nothing changes, the tooltip says why
    assert "Experts in VRAM: cannot read 'x,1'" in settings.resident_edit.toolTip()
    settings.resident_edit.setText("auto")
    settings.resident_edit.editingFinished.emit()
    settings.slots_spin.setValue(8)
    assert plan.experts_resident is None and plan.expert_slots == 8
    assert not fit.table.isColumnHidden(cache)
    dense = HeaderModel(SHAPES["qwen2-7b"])
    plan.set_model(dense, HParams.from_model(dense))
    assert not settings.resident_edit.isVisible()  # dense models have no experts to place


def test_the_bars_show_a_host_row_of_pinned_experts(qtbot, plan) -> None:
    from app.models.device_board import HOST_KEY, DeviceBoard
    from app.widgets.vram_bars import VramBars

    board = DeviceBoard()
    board.set_simulated("12GiB", list(plan.devices))
    bars = VramBars(board, LIGHT)
    qtbot.addWidget(bars)
    host = plan.layout.host
    board.set_plan(plan.layout)
    row = board.rows[-1]
    assert [r.key for r in board.rows].count(HOST_KEY) == 1 and row.key == HOST_KEY
    assert (row.planned, row.verdict, row.total) == (host.pinned, host.verdict, 64 * GIB)
    assert row.used == 16 * GIB  # what the machine uses: 64 GiB less 48 available
    assert bars._caption(row).startswith("Host  host RAM")
    board.set_simulated("12GiB", list(plan.devices))  # a new poll keeps the host row
    assert board.rows[-1].key == HOST_KEY
    board.set_launched(plan.layout)
    assert board.rows[-1].ours == {"host_experts": host.pinned}
    assert f"Carve pins {host.pinned / GIB:.2f} GiB" in bars._caption(board.rows[-1])
    board.set_launched(None)
    board.set_plan(None)  # nothing planned: no host row
    assert HOST_KEY not in [r.key for r in board.rows]


def test_host_experts_computed_by_the_cpu_from_the_window(qtbot, plan) -> None:
    """The launch settings' "Host experts on" choice: CPU prices the host layers' experts in
    the CPU's layouts (more host RAM than the file's bytes for Q6_K's bf16), drops the staging
    span and the slots from VRAM, says so in the fit check, and round-trips in a preset."""
    settings, fit = LaunchSettings(plan), FitCheck(plan, LIGHT)
    qtbot.addWidget(settings)
    qtbot.addWidget(fit)
    settings.show()
    settings.slots_spin.setValue(8)
    on_gpu = plan.layout  # Auto with expert slots: the GPU's kernels read them
    assert settings.host_combo.isVisible() and settings.host_combo.currentData() == "auto"
    assert on_gpu.plan.host_compute == "gpu" and on_gpu.plan.expert_slots == (8,)
    assert on_gpu.devices[0].terms["expert_cache"] > 0 and on_gpu.plan.expert_slots == (8,)
    settings.host_combo.setCurrentIndex(settings.host_combo.findData("cpu"))
    assert plan.host_compute == "cpu" and not settings.slots_spin.isEnabled()
    lay = plan.layout
    assert lay.plan.host_compute == "cpu" and lay.plan.expert_slots == ()
    d, d0 = lay.devices[0], on_gpu.devices[0]
    assert d.terms["expert_cache"] == 0
    # Auto: the staging span's and the slots' VRAM now keeps more layers' experts resident
    (kept,) = lay.plan.experts_resident
    assert kept > on_gpu.plan.experts_resident[0]
    away = [t for t in plan.gguf.tensors if is_expert(t.name) and t.layer >= kept]
    assert d.terms["host_experts"] == sum(
        cpu_bytes(t.name, t.ggml_type, tuple(t.shape), t.nbytes) for t in away)
    assert d.terms["host_experts"] > sum(t.nbytes for t in away) > 0  # Q6_K's bf16 is larger
    assert d0.terms["host_experts"] < d.terms["host_experts"]
    assert "in host memory" in fit.advice.text() and "computed by the CPU" in fit.advice.text()
    saved = plan.settings()
    assert saved["host_compute"] == "cpu" and saved["expert_slots"] == 8
    settings.host_combo.setCurrentIndex(settings.host_combo.findData("gpu"))
    assert plan.host_compute == "gpu" and settings.slots_spin.isEnabled()
    assert plan.layout.plan.expert_slots == (8,)
    plan.apply_settings(saved)
    assert plan.host_compute == "cpu" and settings.host_combo.currentData() == "cpu"
    # both: the staging span again (prefill), the file's bytes (and where this machine has no
    # native kernel, the CPU's layouts beside them)
    settings.host_combo.setCurrentIndex(settings.host_combo.findData("both"))
    lay = plan.layout
    assert lay.plan.host_compute == "both" and not settings.slots_spin.isEnabled()
    assert lay.devices[0].terms["expert_cache"] > 0 and lay.plan.expert_slots == ()
    assert "split for decode between the CPU" in fit.advice.text()
    # decode's PCIe bytes: at most what "gpu" reads (the CPU's share, timed at load, reads none)
    assert "GPU 0: decode reads " in fit.advice.text()


@pytest.mark.skipif(not native.available(), reason="no C compiler to build the native kernel")
def test_auto_splits_decode_where_the_native_kernel_reads_the_experts(qtbot, plan,
                                                                       monkeypatch) -> None:
    """Auto (the default) on Qwen3-30B-A3B's Q4_K / Q6_K experts, where this machine builds
    the CPU's native kernel: "both", pinning exactly what "gpu" pins (the file's bytes and the
    CPU's buffers), the fit check saying so; with the kernel off (CARVE_NATIVE=0), "gpu"."""
    settings, fit = LaunchSettings(plan), FitCheck(plan, LIGHT)
    qtbot.addWidget(settings)
    qtbot.addWidget(fit)
    auto = plan.layout
    assert plan.host_compute == "auto" and settings.slots_spin.isEnabled()
    assert auto.plan.host_compute == "both" and auto.plan.expert_slots == ()
    assert "split for decode between the CPU" in fit.advice.text()
    assert settings.host_combo.itemText(0) == "Auto: Both"  # what Auto chose, shown
    settings.host_combo.setCurrentIndex(settings.host_combo.findData("gpu"))
    gpu = plan.layout
    assert gpu.plan.host_compute == "gpu"
    assert gpu.plan.experts_resident == auto.plan.experts_resident
    assert gpu.host.pinned == auto.host.pinned
    assert [d.allocated for d in gpu.devices] == [d.allocated for d in auto.devices]
    monkeypatch.setenv("CARVE_NATIVE", "0")
    settings.host_combo.setCurrentIndex(settings.host_combo.findData("auto"))
    assert plan.layout.plan.host_compute == "gpu"
    assert settings.host_combo.itemText(0) == "Auto: GPU"


def test_the_split_strip_drags_where_a_gpus_experts_go_to_host_memory(qtbot, plan) -> None:
    """The split editor shows Auto's placement: a dashed line at the first layer whose
    experts live in host memory, a strip from there to the stage's end; dragging the line
    snaps to a whole MoE layer and sets that GPU's count, which the fit check then prices.
    The fit check names PCIe as decode's bottleneck with the bytes per token."""
    from app.widgets.split_editor import HOST_STRIP, SplitEditor

    ed, fit = SplitEditor(plan, LIGHT), FitCheck(plan, LIGHT)
    qtbot.addWidget(ed)
    qtbot.addWidget(fit)
    ed.show()
    (line,) = ed._host_lines
    assert line.isVisible() and line.value() == 23 and ed.host_hint.isVisible()
    opts = ed.hosts.opts
    assert list(opts["x0"]) == [23] and list(opts["width"]) == [25]
    assert list(opts["height"]) == [HOST_STRIP]
    assert "GPU 0: decode reads " in fit.advice.text()
    assert "(the link's rate is not known here)" in fit.advice.text()  # a stated card
    line.setValue(30.4)  # as a drag does: the cut snaps to layer 30
    assert plan.experts_resident == (30,) and line.value() == 30
    assert plan.layout.plan.experts_resident == (30,) and list(ed.hosts.opts["x0"]) == [30]
    assert "experts of 30 of its 48 MoE layers in VRAM" in fit.advice.text()
    line.setValue(60)  # past the stage's end: every layer's experts in VRAM, no strip
    assert plan.experts_resident == (48,) and line.value() == 48
    assert list(ed.hosts.opts["width"]) == [0]
    plan.set_experts_resident(None)  # Auto again: the line follows
    assert line.value() == 23


def test_a_dense_model_has_no_host_line(qtbot) -> None:
    from app.widgets.split_editor import SplitEditor

    m = PlanModel()
    gguf = HeaderModel(SHAPES["qwen2-0.5b"])
    m.set_model(gguf, HParams.from_model(gguf))
    m.set_devices([DeviceSpec(0, "card", 12 * GIB, 12 * GIB - 615 * MIB, simulated=True)])
    ed = SplitEditor(m, LIGHT)
    qtbot.addWidget(ed)
    ed.show()
    assert not any(ln.isVisible() for ln in ed._host_lines) and not ed.host_hint.isVisible()
    assert m.host_cut(0) is None and m.moe_layers(0) == []
    with pytest.raises(IndexError):
        m.set_host_cut(0, 3)

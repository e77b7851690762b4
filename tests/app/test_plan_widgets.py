"""Split editor, fit check, VRAM bars and launch settings mirror the plan model."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from PySide6.QtCore import QEvent, QPoint, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QApplication

from app.models.device_board import DeviceBoard
from app.models.model_summary import human_bytes
from app.models.plan_model import PlanModel
from app.theme import LIGHT
from app.widgets.fit_check import FitCheck
from app.widgets.launch_settings import LaunchSettings
from app.widgets.split_editor import SplitEditor
from app.widgets.vram_bars import GIB, VramBars


@pytest.fixture
def plan(synth_model, make_gpu):
    m = PlanModel()
    m.open_model(str(synth_model("gemma3")))  # 6 layers
    m.set_devices([make_gpu(0, 8000), make_gpu(1, 8000), make_gpu(2, 8000)])
    m.pick_devices("spread")  # Auto keeps this small model on one GPU; these tests edit a split
    m.set_split((0, 2, 4, 6))
    return m


@pytest.fixture
def editor(qtbot, plan):
    w = SplitEditor(plan, LIGHT)
    w.resize(800, 140)
    qtbot.addWidget(w)
    w.show()
    qtbot.waitExposed(w)
    return w


def weights_cell(fit: FitCheck, row: int) -> str:
    return fit.table.item(row, 1).text()


def test_programmatic_drag_snaps_and_reprices(qtbot, plan, editor):
    fit = FitCheck(plan, LIGHT)
    qtbot.addWidget(fit)
    before = weights_cell(fit, 0)
    line = editor._lines[0]
    line.setValue(3.4)  # what a drag does: a raw, unsnapped position
    assert plan.split == (0, 3, 4, 6)
    assert line.value() == 3  # the view shows the model's snapped layer
    assert plan.layout.devices[0].layers == (0, 3)
    assert weights_cell(fit, 0) == human_bytes(plan.layout.devices[0].terms["weights"])
    assert weights_cell(fit, 0) != before
    line.setValue(5.9)  # beyond the next boundary: clamped, stage 1 keeps one layer
    assert plan.split == (0, 3, 4, 6)
    assert tuple(line.bounds()) == (1, 3) and line.value() == 3


def _send(widget, kind, pos: QPoint, button, buttons) -> None:
    event = QMouseEvent(kind, QPointF(pos), QPointF(widget.mapToGlobal(pos)), button, buttons,
                        Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(widget, event)


def test_drag_through_the_view(qtbot, plan, editor):
    view = editor.plot
    view.scene().minDragTime = 0  # pyqtgraph's own tests do this to drag without waiting
    vb = view.getPlotItem().getViewBox()

    def to_widget(x: float) -> QPoint:
        return view.mapFromScene(vb.mapViewToScene(QPointF(x, 0.5)))

    qtbot.wait(20)  # let the view lay out before mapping layers to pixels
    viewport = view.viewport()
    start, end = to_widget(4.0), to_widget(5.2)  # grab the second boundary at layer 4
    left = Qt.MouseButton.LeftButton
    _send(viewport, QEvent.Type.MouseMove, start, Qt.MouseButton.NoButton, Qt.MouseButton.NoButton)
    _send(viewport, QEvent.Type.MouseButtonPress, start, left, left)
    seen = []
    plan.events.layout.connect(lambda layout: seen.append(layout.devices[1].layers))
    for k in range(1, 11):
        p = start + (end - start) * (k / 10)
        _send(viewport, QEvent.Type.MouseMove, p, Qt.MouseButton.NoButton, left)
        qtbot.wait(20)  # pyqtgraph's scene rate-limits drag moves
    assert seen and seen[0] == (2, 5)  # re-priced while the mouse moved, not at release
    _send(viewport, QEvent.Type.MouseButtonRelease, end, left, Qt.MouseButton.NoButton)
    assert plan.split == (0, 2, 5, 6)
    assert editor._lines[1].value() == 5


def test_keyboard_nudges(qtbot, plan, editor):
    editor.setFocus()
    editor.selected = 1
    qtbot.keyClick(editor, Qt.Key.Key_Right)
    assert plan.split == (0, 3, 4, 6)
    qtbot.keyClick(editor, Qt.Key.Key_Down)  # next boundary
    qtbot.keyClick(editor, Qt.Key.Key_Left)
    assert plan.split == (0, 3, 4, 6)  # cannot: stage 1 keeps its layer
    qtbot.keyClick(editor, Qt.Key.Key_Right)
    assert plan.split == (0, 3, 5, 6)


def test_exclude_checkbox_and_even(qtbot, plan, editor):
    editor._use_boxes[2].setChecked(False)
    assert len(plan.split) == 3 and len(editor._lines) == 1
    editor._use_boxes[2].setChecked(True)
    editor.even_button.click()
    assert plan.split == (0, 2, 4, 6)


def test_fit_check_shows_a_fix_that_applies(qtbot, demo_model_path, make_gpu):
    m = PlanModel()
    m.open_model(str(demo_model_path))
    m.set_devices([make_gpu(0, 1400)])  # 1.4 GiB free: the 32k-context KV cache does not fit
    m.set_ctx(32768)
    fit = FitCheck(m, LIGHT)
    qtbot.addWidget(fit)
    assert m.verdict() == "does not fit"
    assert fit.table.item(0, fit.table.columnCount() - 1).text() == "does not fit"
    qtbot.waitUntil(lambda: bool(fit.fix_buttons), timeout=3000)
    assert not fit.advice.isHidden()
    button = next(b for b in fit.fix_buttons if b.text().startswith("Set context"))
    button.click()
    assert m.verdict() != "does not fit" and m.ctx < 32768


def test_launch_settings_write_and_mirror(qtbot, plan):
    w = LaunchSettings(plan)
    qtbot.addWidget(w)
    w.kv_combo.setCurrentText("q8_0")
    assert plan.kv_type == "q8_0"
    w.ctx_spin.setValue(1024)
    assert plan.ctx == 1024 and w.ctx_slider.value() == 1024 // 256
    w.arena_combo.setCurrentText("chunked")
    assert plan.arena == "chunked:512"
    w.reserve_spin.setValue(256)
    assert plan.cache_reserve == 256 << 20
    plan.set_ctx(512)  # a fix or a preset changes the model: the controls follow
    assert w.ctx_spin.value() == 512
    qtbot.waitUntil(lambda: "rounding waste" in w.waste.text(), timeout=2000)


def test_vram_bars_follow_the_board(qtbot, plan):
    board = DeviceBoard()
    bars = VramBars(board, LIGHT)
    qtbot.addWidget(bars)
    board.set_simulated("3 test cards", list(plan.devices))
    board.set_plan(plan.layout)
    ghost = bars._ghost_outline.opts
    planned = [d.total / GIB for d in plan.layout.devices]
    assert np.allclose(ghost["width"], planned)
    others = np.array([r.others for r in board.rows]) / GIB
    assert np.allclose(ghost["x0"], others)  # the ghost starts where other users' memory ends
    board.set_launched(plan.layout)  # after "loaded": our terms replace the ghost
    assert np.allclose(bars._ghost_outline.opts["width"], 0)
    weights = [d.terms["weights"] + d.terms["globals"] + d.terms["rounding"] for d in plan.layout.devices]
    assert np.allclose(bars._items["weights"].opts["width"], np.array(weights) / GIB)
    board.set_launched(None)  # unload frees
    assert np.allclose(bars._items["weights"].opts["width"], 0)


def test_live_snapshots_update_in_place(qtbot):
    board = DeviceBoard()
    bars = VramBars(board, LIGHT)
    qtbot.addWidget(bars)
    snap = SimpleNamespace(uuid="GPU-1", name="NVIDIA H200", index=0, total=140 * 2**30,
                           free=100 * 2**30, used=40 * 2**30, temperature=41, utilization=7)
    board.set_snapshots([snap])
    items = dict(bars._items)
    snap.used, snap.free = 50 * 2**30, 90 * 2**30
    board.set_snapshots([snap])
    assert bars._items == items  # same items, new values: update, don't rebuild
    assert bars._items["others"].opts["width"][0] == pytest.approx(50)
    assert "41 °C" in bars._captions[0].toPlainText()

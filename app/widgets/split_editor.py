"""The split editor: the model's layers as a strip, one coloured segment per GPU, boundaries that
drag. Mirrors ``PlanModel``: a dragged line writes its raw position to ``set_boundary``; the model
snaps it to a whole layer and re-prices; the view then shows the snapped value. A MoE model
shows, per GPU, the layers whose experts live in host memory as a strip along the bottom, with
a dashed line at their start that drags the same way (``set_host_cut``).
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.models.plan_model import PlanModel
from app.theme import Theme, stage_color
from app.widgets.static_plot import static_plot

HOST_STRIP = 0.28  # the host strip's height, of the strip's
HOST_LINE_SPAN = 0.45  # the dashed lines' height, of the strip's


class SplitEditor(QWidget):
    def __init__(self, model: PlanModel, theme: Theme, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.theme = theme
        self.setFocusPolicy(Qt.FocusPolicy.StrongFocus)
        self.selected = 1  # inner boundary the arrow keys move

        self.auto_button = QPushButton("Auto")
        self.auto_button.setToolTip("One GPU when the model fits on one (a split only adds a hop), "
                                    "else every GPU, with the boundaries of most headroom")
        self.auto_button.clicked.connect(lambda: self.model.pick_devices("auto"))
        self.spread_button = QPushButton("Spread")
        self.spread_button.setToolTip("Every GPU, with the boundaries of most headroom")
        self.spread_button.clicked.connect(lambda: self.model.pick_devices("spread"))
        self.even_button = QPushButton("Even")
        self.even_button.setToolTip("The same number of layers on every GPU")
        self.even_button.clicked.connect(self._on_even)
        self.hint = QLabel("Drag a boundary to move layers between GPUs · ←/→ nudge the selected "
                           "boundary (Shift: 5 layers) · ↑/↓ select another")
        # a MoE model: per GPU, the layers whose experts live in host memory (a strip along the
        # bottom) and a dashed line at their start that drags
        self.host_hint = QLabel("Dashed line: where a GPU's layers start keeping their experts "
                                "in host memory (the strip below); drag it to keep more or fewer "
                                "in VRAM")
        self.host_hint.setObjectName("muted")
        self.hint.setObjectName("muted")
        self.use_label = QLabel("Use GPU")
        self.use_label.setObjectName("muted")
        self.use_row = QHBoxLayout()
        self.use_row.setSpacing(10)
        self._use_boxes: list[QCheckBox] = []

        self.plot = static_plot("splitPlot", "layer")
        pi = self.plot.getPlotItem()
        self.plot.setFixedHeight(96)
        self.stages = pg.BarGraphItem(x0=[0], width=[0], y0=[0], height=[1], brushes=["#888"])
        pi.addItem(self.stages)
        self.ticks = pg.PlotDataItem(connect="pairs")  # thin marks at every layer boundary
        pi.addItem(self.ticks)
        self.hosts = pg.BarGraphItem(x0=[0], width=[0], y0=[0], height=[HOST_STRIP],
                                     brushes=["#888"])
        self.hosts.setZValue(2)
        pi.addItem(self.hosts)
        # no model: a sentence in place of the strip, and no layer axis with nothing on it
        self.placeholder = pg.TextItem("Open a model to see its layers split between the GPUs",
                                       anchor=(0.5, 0.5), color=theme.muted)
        pi.addItem(self.placeholder)
        self._lines: list[pg.InfiniteLine] = []
        self._host_lines: list[pg.InfiniteLine] = []  # one per stage (hidden without experts)
        self._labels: list[pg.TextItem] = []
        self._syncing = False

        top = QHBoxLayout()
        top.addWidget(self.auto_button)
        top.addWidget(self.spread_button)
        top.addWidget(self.even_button)
        top.addSpacing(12)
        top.addWidget(self.use_label)
        top.addLayout(self.use_row)
        top.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(4)
        layout.addLayout(top)
        layout.addWidget(self.plot)
        layout.addWidget(self.hint)
        layout.addWidget(self.host_hint)

        model.events.split.connect(self._on_split)
        model.events.devices.connect(self._on_devices)
        model.events.model.connect(lambda *_: self._on_split())
        model.events.layout.connect(lambda *_: self._on_hosts())
        self._on_devices()

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self._rebuild_lines(len(self.model.split) - 1)
        self._on_split()

    # -- mirror the model --------------------------------------------------------------------
    def _on_devices(self, *_: object) -> None:
        while self.use_row.count():
            w = self.use_row.takeAt(0).widget()
            if w is not None:
                w.deleteLater()
        self._use_boxes = []
        for pos, dev in enumerate(self.model.devices):
            box = QCheckBox("CPU" if dev.index < 0 else str(dev.index))
            box.setToolTip(f"use GPU {dev.index} ({dev.name}) in this plan")
            box.setChecked(pos not in self.model.excluded)
            box.toggled.connect(lambda on, p=pos: self.model.set_excluded(p, not on))
            self.use_row.addWidget(box)
            self._use_boxes.append(box)
        multi = len(self.model.devices) > 1
        for box in self._use_boxes:
            box.setVisible(multi)
        self.use_label.setVisible(multi)
        self.spread_button.setVisible(multi)
        self._on_split()

    def _on_split(self, *_: object) -> None:
        split = self.model.split
        n_layer = self.model.n_layer
        pi = self.plot.getPlotItem()
        n_stage = max(0, len(split) - 1)
        if n_stage and n_stage != len(self.model.active_devices()):
            return  # mid-change (devices first, split next): the split event follows
        if len(self._labels) != n_stage:
            self._rebuild_lines(n_stage)
        empty = n_stage == 0
        self.placeholder.setVisible(empty)
        self.hint.setVisible(n_stage > 1)  # there is a boundary to drag
        pi.showAxis("bottom", not empty)
        if empty:  # no bar, and no outline of a zero-width one at x = 0 either
            self.stages.setOpts(x0=[0], width=[0], y0=[0], height=[1], pens=[pg.mkPen(None)])
            self.ticks.setData([], [])
            self.placeholder.setColor(self.theme.muted)
            self.placeholder.setPos(0.5, 0.5)
            pi.setRange(xRange=(0, 1), yRange=(0, 1), padding=0)
            return
        s = np.asarray(split, dtype=float)
        active = self.model.active_devices()
        positions = [self.model.devices.index(d) for d in active]
        brushes = [stage_color(self.theme, p) for p in positions]
        self.stages.setOpts(x0=s[:-1], width=np.diff(s), y0=np.zeros(n_stage),
                            height=np.ones(n_stage), brushes=brushes, pens=[pg.mkPen(self.theme.panel)] * n_stage)
        xs = np.repeat(np.arange(1, n_layer, dtype=float), 2)
        ys = np.tile([0.0, 0.12], max(0, n_layer - 1))
        self.ticks.setData(xs, ys, pen=pg.mkPen(self.theme.panel, width=1))
        self._syncing = True
        try:
            for i, line in enumerate(self._lines, start=1):
                line.setBounds(self.model.boundary_bounds(i))
                if line.value() != split[i]:
                    line.setValue(split[i])
                line.setPen(self._line_pen(i == self.selected))
        finally:
            self._syncing = False
        px_per_layer = max(1.0, self.plot.width() - 20) / max(1, n_layer)
        cuts = self._host_cuts()
        for k, label in enumerate(self._labels):
            dev = active[k]
            n = split[k + 1] - split[k]
            name = "CPU" if dev.index < 0 else f"GPU {dev.index}"
            wide = n * px_per_layer >= 70  # room for the long label, else just the GPU number
            label.setText(f"{name}\n{split[k]}–{split[k + 1] - 1} ({n})" if wide
                          else str(dev.index))
            # above the host strip and its dashed line where the stage has one
            up = cuts[k] is not None
            label.setPos((split[k] + split[k + 1]) / 2, 0.66 if up else 0.5)
        pi.setRange(xRange=(0, max(1, n_layer)), yRange=(0, 1), padding=0.01)
        self._on_hosts(cuts)

    def _host_cuts(self) -> list[int | None]:
        """Per stage shown, its first layer whose experts live in host memory (None: no MoE)."""
        return [self.model.host_cut(i) for i in range(len(self._labels))]

    def _on_hosts(self, cuts: list[int | None] | None = None) -> None:
        """The host strips and dashed lines from the priced plan (Auto's placement included);
        ``cuts``: `_host_cuts`, when the caller has them."""
        split = self.model.split
        if cuts is None:
            cuts = self._host_cuts()
        x0, width = [], []
        self._syncing = True
        try:
            for i, line in enumerate(self._host_lines):
                cut = cuts[i] if i < len(cuts) else None
                line.setVisible(cut is not None)
                if cut is None:
                    continue
                moe = self.model.moe_layers(i)
                line.setBounds((moe[0], split[i + 1]))
                if line.value() != cut:
                    line.setValue(cut)
                if cut < split[i + 1]:
                    x0.append(cut)
                    width.append(split[i + 1] - cut)
        finally:
            self._syncing = False
        self.host_hint.setVisible(any(c is not None for c in cuts))
        colour = self.theme.terms.get("host_experts", self.theme.muted)
        self.hosts.setOpts(x0=x0 or [0], width=width or [0], y0=[0] * max(1, len(x0)),
                           height=[HOST_STRIP] * max(1, len(x0)),
                           brushes=[colour] * max(1, len(x0)),
                           pens=[pg.mkPen(None)] * max(1, len(x0)))

    def _rebuild_lines(self, n_stage: int) -> None:
        pi = self.plot.getPlotItem()
        for item in self._lines + self._labels + self._host_lines:
            pi.removeItem(item)
        self._lines, self._labels, self._host_lines = [], [], []
        for i in range(1, n_stage):
            line = pg.InfiniteLine(pos=0, angle=90, movable=True, pen=self._line_pen(False),
                                   hoverPen=pg.mkPen(self.theme.text, width=5))
            line.setZValue(10)
            line.setCursor(Qt.CursorShape.SizeHorCursor)
            line.sigPositionChanged.connect(lambda ln, i=i: self._on_line_moved(i, ln))
            line.sigClicked.connect(lambda *_, i=i: self._select(i))
            pi.addItem(line)
            self._lines.append(line)
        for i in range(n_stage):
            label = pg.TextItem(anchor=(0.5, 0.5), color="#ffffff")
            label.setZValue(5)
            pi.addItem(label)
            self._labels.append(label)
            # over the boundaries' lower part: a cut at a stage's end is still grabbed here
            host = pg.InfiniteLine(pos=0, angle=90, movable=True, span=(0, HOST_LINE_SPAN),
                                   pen=pg.mkPen(self.theme.text, width=3,
                                                style=Qt.PenStyle.DashLine),
                                   hoverPen=pg.mkPen(self.theme.text, width=5))
            host.setZValue(11)
            host.setCursor(Qt.CursorShape.SizeHorCursor)
            host.setToolTip("drag: the layers right of this line keep their experts in host "
                            "memory")
            host.sigPositionChanged.connect(lambda ln, i=i: self._on_host_moved(i, ln))
            host.setVisible(False)
            pi.addItem(host)
            self._host_lines.append(host)
        self.selected = min(max(1, self.selected), max(1, n_stage - 1))

    def _line_pen(self, selected: bool) -> pg.QtGui.QPen:
        return pg.mkPen(self.theme.text, width=4 if selected else 3)

    # -- write back --------------------------------------------------------------------------
    def _on_line_moved(self, i: int, line: pg.InfiniteLine) -> None:
        if self._syncing:
            return
        self.selected = i
        snapped = self.model.set_boundary(i, line.value())
        if line.value() != snapped:  # show the snapped layer, not the raw cursor position
            self._syncing = True
            try:
                line.setValue(snapped)
            finally:
                self._syncing = False

    def _on_host_moved(self, i: int, line: pg.InfiniteLine) -> None:
        if self._syncing:
            return
        snapped = self.model.set_host_cut(i, line.value())
        if line.value() != snapped:  # the cut sits on a whole MoE layer
            self._syncing = True
            try:
                line.setValue(snapped)
            finally:
                self._syncing = False

    def _select(self, i: int) -> None:
        self.selected = i
        self.setFocus()
        self._on_split()

    def _on_even(self) -> None:
        from app.models.plan_model import even_split

        self.model.set_split(even_split(self.model.n_layer, len(self.model.active_devices())))

    def keyPressEvent(self, event: QKeyEvent) -> None:
        n_inner = len(self.model.split) - 2
        if n_inner < 1:
            return super().keyPressEvent(event)
        step = 5 if event.modifiers() & Qt.KeyboardModifier.ShiftModifier else 1
        key = event.key()
        if key in (Qt.Key.Key_Left, Qt.Key.Key_Right):
            self.model.nudge_boundary(self.selected, -step if key == Qt.Key.Key_Left else step)
        elif key in (Qt.Key.Key_Up, Qt.Key.Key_Down):
            d = -1 if key == Qt.Key.Key_Up else 1
            self._select((self.selected - 1 + d) % n_inner + 1)
        else:
            return super().keyPressEvent(event)
        event.accept()

    def resizeEvent(self, event) -> None:
        super().resizeEvent(event)
        self._on_split()  # stage labels pick their length from the pixels each stage has

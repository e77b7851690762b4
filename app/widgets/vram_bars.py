"""Live VRAM bars: one horizontal bar per GPU, mirroring ``DeviceBoard``.

pyqtgraph's "update, don't rebuild" habit: one ``BarGraphItem`` per segment kind holds every
GPU's segment; a refresh is ``setOpts`` with new x0/width arrays (allocated once per device count),
so the 4 Hz poll costs a few hundred microseconds.
"""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel, QSizePolicy, QVBoxLayout, QWidget

from app.models.device_board import HOST_KEY, OUR_TERMS, DeviceBoard
from app.models.model_summary import human_bytes
from app.theme import Theme
from app.widgets.static_plot import static_plot

GIB = float(1 << 30)
BAR_H = 0.46  # of the 1.0 row pitch; the rest holds the row's caption


class VramBars(QWidget):
    def __init__(self, board: DeviceBoard, theme: Theme, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.board = board
        self.theme = theme
        self.plot = static_plot("vramPlot", "GiB")
        item = self.plot.getPlotItem()
        item.getViewBox().invertY(True)
        self.plot.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Expanding)
        self.legend = QLabel()
        self.legend.setObjectName("legend")
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        # eleven swatches are wider than the plan pane at 1280x800: they wrap between entries
        # (never inside one) rather than widen the pane past the window
        self.legend.setWordWrap(True)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(2)
        layout.addWidget(self.plot, 1)
        layout.addWidget(self.legend)
        self._n = -1
        self._items: dict[str, pg.BarGraphItem] = {}
        self._captions: list[pg.TextItem] = []
        self._ghost_outline: pg.BarGraphItem | None = None
        board.events.rows.connect(self._on_rows)
        board.events.values.connect(self._on_values)
        self.apply_theme(theme)

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        item = self.plot.getPlotItem()
        for name in ("bottom",):
            axis = item.getAxis(name)
            axis.setPen(pg.mkPen(theme.grid))
            axis.setTextPen(pg.mkPen(theme.muted))
        swatches = [("others & driver", theme.others)] + [
            (label, theme.terms[key]) for key, label in OUR_TERMS
        ] + [("free", theme.free)]
        # within an entry's label only non-breaking spaces; between entries a space the line
        # may break at
        entries = [f"<span style='color:{c}; font-size:14px'>■</span>&nbsp;"
                   f"{label.replace(' ', '&nbsp;')}" for label, c in swatches]
        entries.append(f"<span style='color:{theme.verdict['fits']}'>▭</span>&nbsp;"
                       "plan&nbsp;(by&nbsp;verdict)")
        self.legend.setText(" &nbsp;".join(entries))
        self._n = -1
        self._on_rows()

    # -- mirror the board --------------------------------------------------------------------
    def _on_rows(self) -> None:
        """The set of devices changed: build the items for this many rows (rare)."""
        n = len(self.board.rows)
        if n == self._n:
            self._on_values()
            return
        self._n = n
        pi = self.plot.getPlotItem()
        for it in list(self._items.values()) + self._captions:
            pi.removeItem(it)
        if self._ghost_outline is not None:
            pi.removeItem(self._ghost_outline)
        self._items.clear()
        self._captions.clear()
        self._ghost_outline = None
        if n == 0:
            return
        y = np.arange(n, dtype=float) + 0.5 + BAR_H / 2  # bar centres, below each caption
        zeros = np.zeros(n)
        t = self.theme
        kinds = [("free", t.free), ("others", t.others)] + [(k, t.terms[k]) for k, _ in OUR_TERMS]
        for z, (key, colour) in enumerate(kinds):
            bar = pg.BarGraphItem(x0=zeros, width=zeros, y=y, height=BAR_H, brush=colour, pen=None)
            bar.setZValue(z)
            pi.addItem(bar)
            self._items[key] = bar
        ghost = pg.BarGraphItem(x0=zeros, width=zeros, y=y, height=BAR_H, brush=None, pen=None)
        ghost.setZValue(20)
        pi.addItem(ghost)
        self._ghost_outline = ghost
        for i in range(n):
            cap = pg.TextItem(anchor=(0, 1), color=t.text)
            cap.setPos(0, y[i] - BAR_H / 2 - 0.02)
            pi.addItem(cap)
            self._captions.append(cap)
        self.plot.setFixedHeight(int(52 + 46 * max(1, n)))  # 8 GPUs still fit at 1280x800
        self._on_values()

    def _on_values(self) -> None:
        rows = self.board.rows
        n = len(rows)
        if n != self._n:
            self._on_rows()
            return
        if n == 0:
            return
        total = np.array([r.total for r in rows], dtype=float) / GIB
        others = np.array([r.others for r in rows], dtype=float) / GIB
        self._items["free"].setOpts(x0=np.zeros(n), width=total)
        self._items["others"].setOpts(x0=np.zeros(n), width=others)
        x = others.copy()
        for key, _ in OUR_TERMS:
            w = np.array([r.ours.get(key, 0) for r in rows], dtype=float) / GIB
            self._items[key].setOpts(x0=x.copy(), width=w)
            x += w
        planned = np.array([0 if self.board.launched else r.planned for r in rows], float) / GIB
        brushes, pens = [], []
        for r, w in zip(rows, planned):
            c = pg.mkColor(self.theme.verdict.get(r.verdict, self.theme.verdict[""]))
            fill = pg.mkColor(c)
            fill.setAlpha(90)
            brushes.append(pg.mkBrush(fill))
            pens.append(pg.mkPen(c, width=2) if w > 0 else pg.mkPen(None))  # no sliver at 0
        self._ghost_outline.setOpts(x0=x.copy(), width=planned, brushes=brushes, pens=pens)
        for cap, r in zip(self._captions, rows):
            cap.setText(self._caption(r), color=self.theme.muted if r.excluded else self.theme.text)
        right = max(float(total.max()), float((x + planned).max())) * 1.02
        self.plot.getPlotItem().setRange(xRange=(0, right), yRange=(0, n + 0.1), padding=0)

    @staticmethod
    def _caption(r) -> str:
        label = "Host" if r.key == HOST_KEY else "CPU" if r.index < 0 else f"GPU {r.index}"
        parts = [f"{label}  {r.name}", f"{human_bytes(r.total)} total", f"{human_bytes(r.free)} free"]
        if r.temperature is not None:
            parts.append(f"{r.temperature} °C")
        if r.utilization is not None:
            parts.append(f"{r.utilization} % busy")
        if r.ours and r.key == HOST_KEY:
            parts.append(f"Carve pins {human_bytes(r.ours_total)}")
        elif r.ours:
            parts.append(f"engine {human_bytes(r.ours_total)}")
        elif r.planned:
            parts.append(f"plan {human_bytes(r.planned)} · {r.verdict}")
        if r.excluded:
            parts.append("excluded")
        if r.simulated and r.index >= 0:  # the CPU row is this machine's RAM, never simulated
            parts.append("simulated")
        return "   ·   ".join(parts)

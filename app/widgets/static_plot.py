"""A pyqtgraph plot that only displays: no context menu, no auto-range button, no mouse pan or
zoom, no left axis. The VRAM bars and the split strip are both drawn on one."""

from __future__ import annotations

import pyqtgraph as pg


def static_plot(object_name: str, x_label: str) -> pg.PlotWidget:
    plot = pg.PlotWidget(background=None)
    plot.setObjectName(object_name)  # the style sheets address it by name
    item = plot.getPlotItem()
    item.setMenuEnabled(False)
    item.hideButtons()
    item.setMouseEnabled(False, False)
    item.hideAxis("left")
    item.getAxis("bottom").setLabel(x_label)
    return plot

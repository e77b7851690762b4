"""At the default 1280x800 the plan tab's content is no wider than its pane: the pane scrolls
only vertically, so anything wider is cut off at the window's right edge (the VRAM legend's
eleven swatches did that to the "Plan for" picker, the bars and the fit table)."""

from __future__ import annotations

from PySide6.QtWidgets import QScrollArea

from app.theme import LIGHT
from app.window_main import MainWindow


def test_the_plan_tab_fits_its_pane_at_1280x800(qtbot):
    w = MainWindow(LIGHT, live_poll=False, remember=False)
    qtbot.addWidget(w)
    w.resize(1280, 800)
    w.show()
    qtbot.waitExposed(w)
    w.set_rig("2x24GiB")  # a rig with GPUs: the legend, captions and table all in play
    qtbot.wait(50)
    pane = w.tabs.widget(0)
    assert isinstance(pane, QScrollArea)
    content = pane.widget()
    assert content.minimumSizeHint().width() <= pane.viewport().width(), (
        f"the plan tab needs {content.minimumSizeHint().width()} px and has "
        f"{pane.viewport().width()}")
    legend = w.vram.legend
    assert legend.wordWrap() and legend.width() <= pane.viewport().width()

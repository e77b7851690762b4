"""The window's menu bar: File (open, recent, quit) and View (light or dark look)."""

from __future__ import annotations

from PySide6.QtGui import QAction, QActionGroup, QKeySequence

from app.theme import THEMES


def build_menu(window) -> None:
    bar = window.menuBar()
    file_menu = bar.addMenu("&File")
    open_action = QAction("&Open model…", window)
    open_action.setShortcut(QKeySequence.StandardKey.Open)
    open_action.triggered.connect(window.model_panel._on_open)
    file_menu.addAction(open_action)
    file_menu.addMenu(window.model_panel.recent_menu).setText("Open &recent")
    find_action = QAction("&Find models in the usual folders", window)
    find_action.triggered.connect(window.model_panel._on_scan)
    file_menu.addAction(find_action)
    file_menu.addSeparator()
    quit_action = QAction("&Quit", window)
    quit_action.setShortcut(QKeySequence.StandardKey.Quit)
    quit_action.triggered.connect(window.close)
    file_menu.addAction(quit_action)

    view_menu = bar.addMenu("&View")
    group = QActionGroup(window)
    for name in THEMES:
        action = QAction(f"{name.capitalize()} theme", window, checkable=True)
        action.setChecked(name == window.theme.name)
        action.triggered.connect(lambda _=False, n=name: window.apply_theme(THEMES[n]))
        group.addAction(action)
        view_menu.addAction(action)
    window.theme_actions = group

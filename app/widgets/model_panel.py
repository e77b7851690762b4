"""Model panel: open a GGUF (dialog, recent files, folder scan; drops land via the window) and its
summary. Emits ``open_requested(path)``; the window opens the file and reports errors."""

from __future__ import annotations

from pathlib import Path

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QListWidget,
    QMenu,
    QPushButton,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.model_scanner import ModelScanner
from app.models.model_summary import ModelSummary, human_bytes


class ModelPanel(QWidget):
    open_requested = Signal(str)

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.title = QLabel("No model")
        self.title.setObjectName("modelTitle")
        self.title.setWordWrap(True)
        self.path = QLabel("Open a .gguf file, or drop one onto the window.")
        self.path.setObjectName("muted")
        self.path.setWordWrap(True)
        self.path.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)

        self.open_button = QPushButton("Open…")
        self.open_button.clicked.connect(self._on_open)
        self.recent_button = QToolButton()
        self.recent_button.setText("Recent")
        self.recent_button.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        self.recent_menu = QMenu(self)
        self.recent_button.setMenu(self.recent_menu)
        self.scan_button = QPushButton("Find models")
        self.scan_button.setToolTip("Look in the Hugging Face cache, LM Studio's folders and ~/models")
        self.scan_button.clicked.connect(self._on_scan)
        buttons = QHBoxLayout()
        buttons.addWidget(self.open_button)
        buttons.addWidget(self.recent_button)
        buttons.addWidget(self.scan_button)
        buttons.addStretch(1)

        self.found = QListWidget()
        self.found.setObjectName("foundModels")
        self.found.setMaximumHeight(120)
        self.found.hide()
        self.found.itemActivated.connect(lambda item: self.open_requested.emit(item.toolTip()))
        self.scan_status = QLabel()
        self.scan_status.setObjectName("muted")
        self.scan_status.hide()

        self.form = QFormLayout()
        self.form.setContentsMargins(0, 4, 0, 0)
        self.form.setHorizontalSpacing(14)
        self._values: dict[str, QLabel] = {}

        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(6)
        layout.addWidget(self.title)
        layout.addWidget(self.path)
        layout.addLayout(buttons)
        layout.addWidget(self.scan_status)
        layout.addWidget(self.found)
        layout.addLayout(self.form)

        self.scanner = ModelScanner(self)
        self.scanner.found.connect(self._on_found)
        self.scanner.finished.connect(self._on_scan_finished)

    def set_recent(self, paths: list[str]) -> None:
        self.recent_menu.clear()
        for p in paths:
            action = self.recent_menu.addAction(Path(p).name)
            action.setToolTip(p)
            action.triggered.connect(lambda _=False, p=p: self.open_requested.emit(p))
        self.recent_button.setEnabled(bool(paths))

    def show_summary(self, summary: ModelSummary | None) -> None:
        while self.form.rowCount():
            self.form.removeRow(0)
        self._values = {}
        if summary is None:
            self.title.setText("No model")
            return
        self.title.setText(summary.name)
        self.path.setText(summary.path)
        for label, value in summary.rows():
            v = QLabel(value)
            v.setWordWrap(True)
            v.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
            self._values[label] = v
            self.form.addRow(label, v)

    def show_error(self, message: str) -> None:
        self.path.setText(f"<span style='color:#d64545'>{message}</span>")

    def _on_open(self) -> None:
        path, _ = QFileDialog.getOpenFileName(self, "Open a GGUF model", str(Path.home()),
                                              "GGUF models (*.gguf);;All files (*)")
        if path:
            self.open_requested.emit(path)

    def _on_scan(self) -> None:
        self.found.clear()
        dirs = self.scanner.start()
        self.scan_status.setText("searching " + ", ".join(str(d) for d in dirs) if dirs
                                 else "none of the usual model folders exist here")
        self.scan_status.show()

    def _on_found(self, path: str) -> None:
        try:
            size = human_bytes(Path(path).stat().st_size)
        except OSError:
            size = "?"
        self.found.addItem(f"{Path(path).name}  ({size})")
        self.found.item(self.found.count() - 1).setToolTip(path)
        self.found.show()

    def _on_scan_finished(self, n: int) -> None:
        self.scan_status.setText(f"{n} model file(s) found — double-click to open" if n
                                 else "no .gguf files found in the usual folders")

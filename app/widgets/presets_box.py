"""Save and load a launch configuration per model (JSON in the user's config folder)."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QInputDialog, QPushButton, QWidget

from app.models.presets import PresetStore


class PresetsBox(QWidget):
    load_requested = Signal(dict)

    def __init__(self, store: PresetStore, settings_source, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.store = store
        self.settings_source = settings_source  # () -> dict, the plan model's current settings
        self.model_path = ""
        self.combo = QComboBox()
        self.combo.setPlaceholderText("no presets yet")
        self.combo.activated.connect(self._on_pick)
        self.save_button = QPushButton("Save…")
        self.save_button.clicked.connect(self._on_save)
        self.delete_button = QPushButton("Delete")
        self.delete_button.clicked.connect(self._on_delete)
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.combo, 1)
        layout.addWidget(self.save_button)
        layout.addWidget(self.delete_button)
        self.set_model("")

    def set_model(self, path: str) -> None:
        self.model_path = path
        self._refresh()

    def _refresh(self, select: str = "") -> None:
        self.combo.clear()
        names = sorted(self.store.presets(self.model_path)) if self.model_path else []
        self.combo.addItems(names)
        self.combo.setCurrentIndex(names.index(select) if select in names else -1)
        for w in (self.combo, self.save_button):
            w.setEnabled(bool(self.model_path))
        self.delete_button.setEnabled(bool(names))

    def save_as(self, name: str) -> None:
        self.store.save_preset(self.model_path, name, self.settings_source())
        self._refresh(select=name.strip())

    def _on_save(self) -> None:
        name, ok = QInputDialog.getText(self, "Save preset", "Preset name:",
                                        text=self.combo.currentText() or "default")
        if ok and name.strip():
            self.save_as(name)

    def _on_pick(self, *_: object) -> None:
        data = self.store.presets(self.model_path).get(self.combo.currentText())
        if data:
            self.load_requested.emit(data)

    def _on_delete(self) -> None:
        self.store.delete_preset(self.model_path, self.combo.currentText())
        self._refresh()

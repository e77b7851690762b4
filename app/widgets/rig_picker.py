"""Which devices to plan for: this machine's GPUs (live) or a simulated rig typed or picked."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QWidget

LIVE = "This machine (live)"
LIVE_CPU = "This machine (CPU)"  # the same entry where NVML finds no NVIDIA GPU
RIGS = ("rtx4090,rtx4090", "1x24GiB", "2x24GiB", "4x24GiB", "rtx3090,rtx3090,a6000", "2xa100-80",
        "4xh100", "8xh100", "h200", "cpu")


class RigPicker(QWidget):
    rig_chosen = Signal(str)  # "auto" for the live GPUs, else a rig text for engine.hardware.rigs.parse_rig

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.banner = QLabel()
        self.banner.setObjectName("banner")
        self.banner.hide()
        self.combo = QComboBox()
        self.combo.setEditable(True)
        self.combo.setMinimumWidth(180)
        self.combo.setToolTip('A rig to plan for: "4x24GiB", "rtx4090,rtx4090,a6000", "2xh100", "cpu"')
        self.combo.addItem(LIVE)
        self.combo.addItems(RIGS)
        self.combo.lineEdit().editingFinished.connect(self._on_edited)
        self.combo.activated.connect(lambda *_: self._on_edited())
        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addWidget(self.banner, 1)
        layout.addWidget(QLabel("Plan for"))
        layout.addWidget(self.combo)
        self._last = ""

    def set_current(self, rig: str) -> None:
        self._last = rig
        self.combo.setCurrentText(self.combo.itemText(0) if rig == "auto" else rig)

    def set_no_gpu(self, reason: str) -> None:
        """No driver / no GPU: say so plainly; the live entry is then the CPU (and plans for GPUs
        when one appears)."""
        self.banner.setText("⚠ No NVIDIA GPU found — this machine runs models on the CPU"
                            if reason else "")
        self.banner.setToolTip(reason)
        self.banner.setVisible(bool(reason))
        self.combo.setItemText(0, LIVE_CPU if reason else LIVE)

    def _on_edited(self) -> None:
        text = self.combo.currentText().strip()
        rig = "auto" if text in ("", LIVE, LIVE_CPU) else text
        if rig != self._last:
            self._last = rig
            self.rig_chosen.emit(rig)

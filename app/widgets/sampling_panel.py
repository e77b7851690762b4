"""Sampling settings form; validated by ``SamplingSettings`` (Qt-free) on every change."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QDoubleSpinBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QSpinBox,
    QWidget,
)

from app.models.chat_model import SamplingSettings
from spec.errors import CarveError


def _dspin(lo: float, hi: float, step: float, decimals: int = 2) -> QDoubleSpinBox:
    s = QDoubleSpinBox()
    s.setRange(lo, hi)
    s.setSingleStep(step)
    s.setDecimals(decimals)
    return s


def _ispin(lo: int, hi: int, step: int = 1) -> QSpinBox:
    s = QSpinBox()
    s.setRange(lo, hi)
    s.setSingleStep(step)
    return s


class SamplingPanel(QWidget):
    changed = Signal()

    def __init__(self, settings: SamplingSettings | None = None, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.settings = settings or SamplingSettings()
        self.temperature = _dspin(0.0, 5.0, 0.05)
        self.temperature.setToolTip("0 = greedy (always the most likely token)")
        self.top_p = _dspin(0.0, 1.0, 0.01)
        self.top_k = _ispin(0, 1000)
        self.top_k.setToolTip("0 = off")
        self.min_p = _dspin(0.0, 1.0, 0.01)
        self.repeat_penalty = _dspin(0.5, 3.0, 0.05)
        self.max_tokens = _ispin(1, 131072, 64)
        self.seed_on = QCheckBox("fixed")
        self.seed = _ispin(0, 2**31 - 1)
        seed_row = QHBoxLayout()
        seed_row.addWidget(self.seed_on)
        seed_row.addWidget(self.seed, 1)
        self.problem = QLabel()
        self.problem.setObjectName("error")
        self.problem.setWordWrap(True)
        self.problem.hide()
        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.addRow("Temperature", self.temperature)
        form.addRow("Top-p", self.top_p)
        form.addRow("Top-k", self.top_k)
        form.addRow("Min-p", self.min_p)
        form.addRow("Repeat penalty", self.repeat_penalty)
        form.addRow("Max tokens", self.max_tokens)
        form.addRow("Seed", seed_row)
        form.addRow(self.problem)
        self._show(self.settings)
        for w in (self.temperature, self.top_p, self.min_p, self.repeat_penalty):
            w.valueChanged.connect(self._write)
        for w in (self.top_k, self.max_tokens, self.seed):
            w.valueChanged.connect(self._write)
        self.seed_on.toggled.connect(self._write)

    def _show(self, s: SamplingSettings) -> None:
        self.temperature.setValue(s.temperature)
        self.top_p.setValue(s.top_p)
        self.top_k.setValue(s.top_k)
        self.min_p.setValue(s.min_p)
        self.repeat_penalty.setValue(s.repeat_penalty)
        self.max_tokens.setValue(s.max_tokens)
        self.seed_on.setChecked(s.seed is not None)
        self.seed.setValue(s.seed or 0)
        self.seed.setEnabled(s.seed is not None)

    def _write(self, *_: object) -> None:
        self.seed.setEnabled(self.seed_on.isChecked())
        try:
            self.settings = SamplingSettings(
                temperature=self.temperature.value(),
                top_k=self.top_k.value(),
                top_p=self.top_p.value(),
                min_p=self.min_p.value(),
                repeat_penalty=self.repeat_penalty.value(),
                repeat_last_n=self.settings.repeat_last_n,
                seed=self.seed.value() if self.seed_on.isChecked() else None,
                max_tokens=self.max_tokens.value(),
            )
        except CarveError as err:
            self.problem.setText(str(err))
            self.problem.show()
            return
        self.problem.hide()
        self.changed.emit()

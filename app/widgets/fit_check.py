"""Fit check: per device the priced terms, free VRAM now, headroom and a verdict; when it does not
fit, the pricing model's sentence and one-click fixes (each already checked by pricing)."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtGui import QColor
from PySide6.QtWidgets import (
    QAbstractItemView,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QPushButton,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.cli_plan import host_lines, torch_on_gpu
from app.models.device_board import short_gpu_name
from app.models.model_summary import human_bytes
from app.models.plan_model import PlanModel
from app.theme import Theme, stage_color
from engine.planning.rules import Verdict

COLUMNS = (
    ("Device", None),
    ("Weights", "weights"),
    ("Experts", "experts"),  # shown for mixture-of-experts models only
    ("KV", "kv"),
    ("Buffers", "buffers"),
    ("Cache", "expert_cache"),  # the VRAM expert cache, when it has slots
    ("Dequant", "dequant_cache"),
    ("Overhead", "overhead"),
    ("Rounding", "rounding"),
    ("Total", None),
    ("Free", None),
    ("Headroom", None),
    ("Verdict", None),
)
_EXPERTS = next(i for i, (_, key) in enumerate(COLUMNS) if key == "experts")
_CACHE = next(i for i, (_, key) in enumerate(COLUMNS) if key == "expert_cache")
_TERM_END = next(i for i, (label, _) in enumerate(COLUMNS) if label == "Total")  # term columns end


class FitCheck(QWidget):
    def __init__(self, model: PlanModel, theme: Theme, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self.theme = theme
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setObjectName("fitTable")
        self.table.setHorizontalHeaderLabels([c for c, _ in COLUMNS])
        self.table.verticalHeader().setVisible(False)
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.NoSelection)
        self.table.setFocusPolicy(Qt.FocusPolicy.NoFocus)
        self.table.setShowGrid(False)
        self.table.setAlternatingRowColors(True)
        header = self.table.horizontalHeader()
        header.setSectionResizeMode(QHeaderView.ResizeMode.ResizeToContents)
        header.setSectionResizeMode(0, QHeaderView.ResizeMode.Stretch)
        header.setDefaultAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
        self.table.verticalHeader().setDefaultSectionSize(26)
        self.table.horizontalHeaderItem(0).setTextAlignment(
            Qt.AlignmentFlag.AlignLeft | Qt.AlignmentFlag.AlignVCenter)

        self.summary = QLabel()
        self.summary.setObjectName("fitSummary")
        self.advice = QLabel()
        self.advice.setObjectName("advice")
        self.advice.setWordWrap(True)
        self.advice.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.fix_row = QHBoxLayout()
        self.fix_row.setSpacing(6)
        self.fix_buttons: list[QPushButton] = []
        self.timing = QLabel()
        self.timing.setObjectName("muted")
        self.skipped = QLabel()  # layers the file declares and the model does not run
        self.skipped.setObjectName("muted")
        self.skipped.hide()

        top = QHBoxLayout()
        top.addWidget(self.summary, 1)
        top.addWidget(self.timing)
        fixes = QHBoxLayout()
        fixes.addLayout(self.fix_row)
        fixes.addStretch(1)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.setSpacing(6)
        layout.addLayout(top)
        layout.addWidget(self.table)
        layout.addWidget(self.skipped)
        layout.addWidget(self.advice)
        layout.addLayout(fixes)

        # Fixes are found by pricing alternatives (a dozen prices): once dragging pauses.
        self._fix_timer = QTimer(self)
        self._fix_timer.setSingleShot(True)
        self._fix_timer.setInterval(150)
        self._fix_timer.timeout.connect(self._update_fixes)
        model.events.layout.connect(self._on_layout)
        self._on_layout(model.layout)

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self._on_layout(self.model.layout)

    def _on_layout(self, layout: object) -> None:
        m = self.model
        rows = list(layout.devices) if layout is not None else []
        if self.table.rowCount() != len(rows):
            self.table.setRowCount(len(rows))
            for r in range(len(rows)):
                for c in range(len(COLUMNS)):
                    item = QTableWidgetItem()
                    align = Qt.AlignmentFlag.AlignVCenter | (
                        Qt.AlignmentFlag.AlignLeft if c == 0 else Qt.AlignmentFlag.AlignRight)
                    item.setTextAlignment(align)
                    self.table.setItem(r, c, item)
        for r, d in enumerate(rows):
            dev = d.device
            pos = next((i for i, x in enumerate(m.devices) if x == dev), r)
            label = "CPU" if dev.index < 0 else f"GPU {dev.index}"
            cells = [f"■ {label}"]  # the card's name is in the tooltip and on the VRAM bar
            cells += [human_bytes(d.terms.get(key, 0)) for _, key in COLUMNS[1:_TERM_END]]
            cells += [human_bytes(d.total), human_bytes(dev.free), human_bytes(d.headroom), d.verdict]
            for c, text in enumerate(cells):
                self.table.item(r, c).setText(text)
            self.table.item(r, 0).setForeground(QColor(stage_color(self.theme, pos)))
            self.table.item(r, 0).setToolTip(short_gpu_name(dev.name))
            verdict_item = self.table.item(r, len(COLUMNS) - 1)
            verdict_item.setForeground(QColor(self.theme.verdict.get(d.verdict, self.theme.text)))
            verdict_item.setToolTip(d.advice or "")
        self.table.setColumnHidden(_EXPERTS, not any(d.terms.get("experts") for d in rows))
        self.table.setColumnHidden(_CACHE, not any(d.terms.get("expert_cache") for d in rows))
        header_h = self.table.horizontalHeader().sizeHint().height()
        self.table.setFixedHeight(header_h + 26 * len(rows) + 6)

        verdict = m.verdict()
        colour = self.theme.verdict.get(verdict, self.theme.muted)
        if m.error:
            self.summary.setText(f"<span style='color:{colour}'>●</span> {m.error}")
        elif layout is None:
            self.summary.setText("Open a model to see whether it fits.")
        elif verdict == Verdict.DOES_NOT_FIT and layout.bottleneck():
            self.summary.setText(
                f"<span style='color:{colour}; font-size:15px'>●</span> "
                f"<b>{verdict.capitalize()}</b> — {layout.bottleneck().split(': ', 1)[1]}")
        elif verdict == Verdict.DOES_NOT_RUN:
            self.summary.setText(
                f"<span style='color:{colour}; font-size:15px'>●</span> "
                f"<b>{verdict.capitalize()}</b> — {m.reason()}")
        else:
            worst = min((d.headroom for d in rows), default=0)
            self.summary.setText(
                f"<span style='color:{colour}; font-size:15px'>●</span> "
                f"<b>{verdict.capitalize()}</b> — tightest headroom {human_bytes(worst)}")
        self.timing.setText(f"priced in {m.price_ms:.2f} ms" if layout is not None else "")
        skipped = layout.skipped_line() if layout is not None else ""
        self.skipped.setText(skipped)
        self.skipped.setVisible(bool(skipped))
        notes = [f"<b>{'CPU' if d.device.index < 0 else f'GPU {d.device.index}'}:</b> {d.advice}"
                 for d in rows if d.advice and d.verdict != Verdict.FITS]
        if layout is not None and layout.host is not None:  # experts in host memory
            notes += host_lines(layout, m.gguf)
        why = torch_on_gpu(layout.plan, m.gguf) if layout is not None and m.gguf else None
        if why:  # slower than the Triton kernels, and every expert stays in VRAM
            notes.append(f"<b>Runs on the torch engine</b>, on the GPU: {why}")
        self.advice.setText("<br>".join(notes))
        self.advice.setVisible(bool(notes))
        self._fix_timer.start()

    def _update_fixes(self) -> None:
        for b in self.fix_buttons:
            self.fix_row.removeWidget(b)
            b.deleteLater()
        self.fix_buttons = []
        for fix in self.model.fixes():
            button = QPushButton(fix.label)
            button.setObjectName("fixButton")
            button.clicked.connect(fix.apply)
            self.fix_row.addWidget(button)
            self.fix_buttons.append(button)

"""The bar along the bottom: verdict, Launch (refused when a GPU does not fit unless overridden,
when the plan does not run here, with the reason, and on a simulated rig, saying how to launch;
"Launch on CPU" when the CPU engine runs it),
load progress with GB, GB/s and time left, Cancel, Unload, and the loaded report."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QProgressBar,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.models.launch_target import SIMULATED, LaunchTarget
from app.models.load_progress import LoadProgress
from app.models.model_summary import human_bytes
from engine.planning.rules import Verdict


class LaunchBar(QWidget):
    launch_requested = Signal()
    cancel_requested = Signal()
    unload_requested = Signal()

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("launchBar")
        self.setAttribute(Qt.WidgetAttribute.WA_StyledBackground, True)  # so the QSS paints it
        self.progress_model = LoadProgress()
        self.status = QLabel("")
        self.status.setObjectName("launchStatus")
        self.status.setWordWrap(True)
        self.override = QCheckBox("Launch anyway")
        self.override.setToolTip("Launch although the fit check says a GPU will run out of memory")
        self.override.toggled.connect(lambda *_: self._update())
        self.progress = QProgressBar()
        self.progress.setRange(0, 1000)
        self.progress.setTextVisible(False)
        self.progress.setFixedWidth(220)
        self.progress.hide()
        self.launch_button = QPushButton("Launch")
        self.launch_button.setObjectName("primary")
        self.launch_button.clicked.connect(self.launch_requested)
        self.cancel_button = QPushButton("Cancel")
        self.cancel_button.clicked.connect(self.cancel_requested)
        self.unload_button = QPushButton("Unload")
        self.unload_button.clicked.connect(self.unload_requested)
        self.report = QLabel("")
        self.report.setObjectName("muted")
        self.report.setWordWrap(True)
        self.report.hide()

        row = QHBoxLayout()
        row.addWidget(self.status, 1)
        row.addWidget(self.progress)
        row.addWidget(self.override)
        row.addWidget(self.cancel_button)
        row.addWidget(self.unload_button)
        row.addWidget(self.launch_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        layout.setSpacing(4)
        layout.addLayout(row)
        layout.addWidget(self.report)
        self.verdict = ""
        self.reason = ""  # why the plan does not run here
        self.target = LaunchTarget("")  # where a Launch runs it (app.models.launch_target)
        self.engine_state = "stopped"
        self.message = ""
        self._update()

    def set_verdict(self, verdict: str, reason: str = "") -> None:
        self.verdict, self.reason = verdict, reason
        self._update()

    def set_target(self, target: LaunchTarget) -> None:
        self.target = target
        self._update()

    def set_engine_state(self, state: str) -> None:
        self.engine_state = state
        if state == "loading":
            self.progress_model.update("starting", 0, 0, 0.0)
            self.progress.setValue(0)
            self.report.hide()
        self._update()

    def show_message(self, text: str) -> None:
        self.message = text
        self._update()

    def on_progress(self, stage: str, done: int, total: int, rate: float) -> None:
        self.progress_model.update(stage, done, total, rate)
        self.progress.setValue(int(self.progress_model.fraction * 1000))
        self._update()

    def on_loaded(self, devices: list[dict]) -> None:
        lines = []
        for d in devices:
            label = "CPU" if int(d.get("index", 0)) < 0 else f"GPU {d.get('index')}"
            priced, allocated = int(d.get("priced", 0)), int(d.get("allocated", 0))
            same = "= priced" if priced == allocated else f"differs by {human_bytes(allocated - priced)}"
            nvml = d.get("nvml_used")
            nv = f" · NVML {human_bytes(int(nvml))}" if nvml else ""
            over = d.get("overhead_measured")
            if over:  # what the CUDA runtime took beyond our arenas, against what was priced
                nv += (f" · runtime {human_bytes(int(over))} (priced "
                       f"{human_bytes(int(d.get('overhead_priced') or 0))})")
            runner = f" · {d['runner']} kernels" if d.get("runner") else ""
            lines.append(f"<b>{label}</b> priced {human_bytes(priced)} · allocated "
                         f"{human_bytes(allocated)} ({same}){nv}{runner}")
        self.report.setText("Loaded — " + "  |  ".join(lines))
        self.report.setVisible(bool(lines))

    def clear_report(self) -> None:
        self.report.hide()

    def can_launch(self) -> bool:
        if self.verdict == Verdict.DOES_NOT_RUN or self.target.kind == SIMULATED:
            return False
        return bool(self.verdict) and (self.verdict != Verdict.DOES_NOT_FIT or self.override.isChecked())

    def _update(self) -> None:
        state = self.engine_state
        loading = state == "loading"
        loaded = state in ("loaded", "generating")
        self.progress.setVisible(loading)
        self.cancel_button.setVisible(loading)
        self.unload_button.setVisible(loaded)
        self.override.setVisible(self.verdict == Verdict.DOES_NOT_FIT and not loading
                                 and self.target.kind != SIMULATED)
        self.launch_button.setEnabled(not loading and self.can_launch())
        self.launch_button.setText("Relaunch" if loaded else self.target.button)
        self.launch_button.setToolTip(self.target.note)
        if loading:
            text = "Loading — " + self.progress_model.text()
        elif loaded:
            text = "Model loaded — chat on the Chat tab"
        elif self.message:
            text = self.message
        elif self.verdict and self.target.kind == SIMULATED:
            text = self.target.note
        elif self.verdict == Verdict.DOES_NOT_RUN:
            text = f"This plan does not run here: {self.reason}"
        elif self.verdict == Verdict.DOES_NOT_FIT:
            text = "A GPU does not fit this plan: apply a fix above, or tick “Launch anyway”."
        elif self.verdict:
            text = f"Plan {self.verdict} — ready to launch"
            if self.target.note:
                text += f". {self.target.note}"
        else:
            text = "Open a model to plan a launch"
        self.status.setText(text)

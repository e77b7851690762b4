"""The Carve window: plan on the left and the Plan tab, launch along the bottom, chat on its tab.

Started by ``app.window_start.main`` (``carve`` with no subcommand).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from PySide6.QtCore import Qt
from PySide6.QtGui import QCloseEvent, QDragEnterEvent, QDropEvent
from PySide6.QtWidgets import (
    QApplication,
    QGroupBox,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QSplitter,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

import app.pyside_refcount  # noqa: F401  (PySide6 6.12.0 refcount bug: before any Qt call)
from app.demo_assembler import DemoAssembler, demo_installed
from app.engine_client import EngineClient
from app.models.chat_model import ChatHistory
from app.models.device_board import DeviceBoard
from app.models.launch_target import launch_target
from app.models.model_summary import summarize
from app.models.plan_model import PlanModel
from app.models.presets import PresetStore
from app.theme import Theme, style_sheet
from app.window_menu import build_menu
from spec.errors import CarveError


def _group(title: str, *widgets: QWidget, stretch_last: bool = False) -> QGroupBox:
    box = QGroupBox(title)
    layout = QVBoxLayout(box)
    layout.setContentsMargins(12, 14, 12, 12)
    for w in widgets:
        layout.addWidget(w)
    if stretch_last:
        layout.addStretch(1)
    return box


class MainWindow(QMainWindow):
    def __init__(self, theme: Theme, store: PresetStore | None = None,
                 engine_program: list[str] | None = None, live_poll: bool = True,
                 remember: bool = True, lazy_plots: bool = False,
                 prestart_engine: bool = False) -> None:
        super().__init__()
        # Widgets import pyqtgraph; importing them here (not at module top) keeps `carve --help`
        # and the CLIs from paying for it.
        from app.widgets.chat_panel import ChatPanel
        from app.widgets.fit_check import FitCheck
        from app.widgets.launch_bar import LaunchBar
        from app.widgets.launch_settings import LaunchSettings
        from app.widgets.model_panel import ModelPanel
        from app.widgets.presets_box import PresetsBox
        from app.widgets.rig_picker import RigPicker
        from app.widgets.serve_switch import ServeSwitch

        self.setWindowTitle("Carve")
        self.setAcceptDrops(True)
        self.theme = theme
        self.store = store or PresetStore()
        self.plan = PlanModel()
        self.board = DeviceBoard()
        self.history = ChatHistory()
        self.client = EngineClient(engine_program, parent=self)
        self.rig = "auto"
        self.no_gpu = False  # NVML found no NVIDIA GPU: "This machine" is the CPU engine
        self.live_poll = live_poll
        self.launched_layout = None
        self.poller = None
        self.assembler: DemoAssembler | None = None  # the demo model joined on a first start
        self.last_error = ""
        self.remember = remember  # a --snapshot run leaves the user's last session alone
        # start the engine process when a model opens: it imports torch and the kernels while
        # the user looks at the plan, so Launch pays only for the load (no GPU memory is taken
        # before Launch)
        self.prestart_engine = prestart_engine

        self.model_panel = ModelPanel()
        self.presets = PresetsBox(self.store, self.plan.settings)
        self.settings_panel = LaunchSettings(self.plan)
        self.rig_picker = RigPicker()
        self.vram = self.split_editor = None  # pyqtgraph views: see build_plots()
        self.fit = FitCheck(self.plan, theme)
        self.launch_bar = LaunchBar()
        self.chat = ChatPanel(self.history, self.client, theme)
        # the OpenAI-compatible server on the launched model, sharing this engine process
        self.serve = ServeSwitch(self.client, self.history, lambda: (
            self.launched_layout.plan.model if self.launched_layout is not None else None))

        sidebar = QWidget()
        sidebar.setObjectName("sidebar")
        side = QVBoxLayout(sidebar)
        side.setContentsMargins(10, 10, 6, 10)
        side.setSpacing(10)
        side.addWidget(_group("Model", self.model_panel))
        side.addWidget(_group("Preset", self.presets))
        side.addWidget(_group("Launch settings", self.settings_panel))
        side.addStretch(1)
        scroll = QScrollArea()
        scroll.setWidget(sidebar)
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        scroll.setMinimumWidth(330)
        scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)

        plan_tab = QWidget()
        plan_layout = QVBoxLayout(plan_tab)
        plan_layout.setContentsMargins(6, 10, 10, 6)
        plan_layout.setSpacing(10)
        self.gpu_box = _group("GPUs", self.rig_picker)
        self.split_box = _group("Layer split")
        plan_layout.addWidget(self.gpu_box)
        plan_layout.addWidget(self.split_box)
        plan_layout.addWidget(_group("Fit check", self.fit))
        plan_layout.addStretch(1)
        plan_scroll = QScrollArea()  # 8 GPUs on a small screen: scroll rather than squash
        plan_scroll.setWidget(plan_tab)
        plan_scroll.setWidgetResizable(True)
        plan_scroll.setFrameShape(QScrollArea.Shape.NoFrame)
        plan_scroll.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        chat_tab = QWidget()
        chat_layout = QVBoxLayout(chat_tab)
        chat_layout.setContentsMargins(6, 10, 10, 6)
        chat_layout.addWidget(self.serve)
        chat_layout.addWidget(self.chat)
        self.tabs = QTabWidget()
        self.tabs.setDocumentMode(True)
        self.tabs.addTab(plan_scroll, "Plan")
        self.tabs.addTab(chat_tab, "Chat")

        splitter = QSplitter()
        splitter.addWidget(scroll)
        splitter.addWidget(self.tabs)
        splitter.setStretchFactor(1, 1)
        splitter.setSizes([350, 930])
        central = QWidget()
        main = QVBoxLayout(central)
        main.setContentsMargins(0, 0, 0, 0)
        main.setSpacing(0)
        main.addWidget(splitter, 1)
        main.addWidget(self.launch_bar)
        self.setCentralWidget(central)

        self.model_panel.open_requested.connect(self.open_model)
        self.model_panel.set_recent(self.store.recent_files())
        self.presets.load_requested.connect(self.plan.apply_settings)
        self.rig_picker.rig_chosen.connect(self.set_rig)
        self.plan.events.layout.connect(self._on_layout)
        self.launch_bar.launch_requested.connect(self.launch)
        self.launch_bar.cancel_requested.connect(self.client.stop)
        self.launch_bar.unload_requested.connect(self.client.unload)
        self.client.state_changed.connect(self.launch_bar.set_engine_state)
        self.client.progress.connect(self.launch_bar.on_progress)
        self.client.loaded.connect(self._on_loaded)
        self.client.unloaded.connect(self._on_unloaded)
        self.client.error.connect(self._on_engine_error)
        self.client.crashed.connect(self._on_crashed)
        self.client.note.connect(self.launch_bar.show_message)
        build_menu(self)
        self.resize(1280, 800)
        if not lazy_plots:
            self.build_plots()

    def build_plots(self) -> None:
        """Create the pyqtgraph views. Importing pyqtgraph takes ~0.7 s, so `carve` shows the
        window first and calls this right after; they mirror the models, so nothing is lost."""
        if self.vram is not None:
            return
        from app.widgets.split_editor import SplitEditor
        from app.widgets.vram_bars import VramBars

        self.vram = VramBars(self.board, self.theme)
        self.split_editor = SplitEditor(self.plan, self.theme)
        self.gpu_box.layout().addWidget(self.vram)
        self.split_box.layout().addWidget(self.split_editor)

    def apply_theme(self, theme: Theme) -> None:
        """Switch the look at run time: the style sheet, and the colours plots draw with."""
        self.theme = theme
        QApplication.instance().setStyleSheet(style_sheet(theme))
        for view in (self.vram, self.split_editor, self.fit, self.chat.view):
            if view is not None:
                view.apply_theme(theme)
        if self.remember:
            self.store.set_ui(theme=theme.name)

    # -- devices -----------------------------------------------------------------------------
    def set_rig(self, rig: str) -> str:
        """"auto": this machine's GPUs, live, or its CPU when NVML finds no NVIDIA GPU; anything
        else: a rig of engine.hardware.rigs (cards are simulated: planned, never launched)."""
        from engine.hardware.devices import no_gpu_reason, snapshot
        from engine.hardware.rigs import parse_rig

        snaps = snapshot()
        self.no_gpu = not any(s.cuda_index >= 0 for s in snaps)  # CUDA_VISIBLE_DEVICES may hide all
        hidden = "CUDA_VISIBLE_DEVICES hides every GPU"
        self.rig_picker.set_no_gpu("" if not self.no_gpu else hidden if snaps
                                   else no_gpu_reason() or "no NVIDIA GPU found")
        if rig == "auto" and not self.no_gpu:
            self.rig = "auto"
            self.rig_picker.set_current("auto")
            self.board.set_live()
            self.board.set_snapshots(snaps)
            self._plan_live_devices(snaps)
            self._start_polling()
            return ""
        try:  # no GPU: this machine is its CPU, and Launch runs the CPU engine
            specs = parse_rig("cpu" if rig == "auto" else rig)
        except CarveError as err:
            self.launch_bar.show_message(str(err))
            return str(err)
        self.rig = rig
        self.rig_picker.set_current(rig)
        self.board.set_simulated(rig, specs)
        self.plan.set_devices(specs)
        return ""

    def _plan_live_devices(self, snaps: list) -> None:
        own = frozenset({self.client.pid}) if self.client.pid else frozenset()
        specs = [s.to_spec(own_pids=own) for s in sorted(snaps, key=lambda s: s.cuda_index)
                 if s.cuda_index >= 0]
        if self.client.state in ("loading", "loaded", "generating"):
            return  # the plan holds the devices it was launched with; bars still refresh
        self.plan.set_devices(specs)

    def _start_polling(self) -> None:
        if self.poller is not None or not self.live_poll:
            return
        from app.nvml_poller import NvmlPoller

        self.poller = NvmlPoller(parent=self)
        self.poller.snapshots.connect(self._on_snapshots)
        self.poller.start()

    def _on_snapshots(self, snaps: list) -> None:
        if self.rig != "auto" or not snaps:
            return
        self.board.set_snapshots(snaps)
        self._plan_live_devices(snaps)

    # -- model -------------------------------------------------------------------------------
    def open_model(self, path: str) -> bool:
        try:
            self.plan.open_model(path)
        except (CarveError, OSError) as err:
            self.model_panel.show_error(str(err))
            self.last_error = str(err)
            return False
        self.model_panel.show_summary(summarize(self.plan.gguf, self.plan.hparams))
        self.setWindowTitle(f"{Path(path).name} — Carve")  # the open document, as desktop apps do
        self.model_panel.set_recent(self.store.add_recent(path))
        self.presets.set_model(str(path))
        self.chat.ctx_limit = self.plan.ctx
        if self.prestart_engine:
            self.client.start()
        return True

    def _on_layout(self, layout: object) -> None:
        excluded = {d.index for i, d in enumerate(self.plan.devices) if i in self.plan.excluded}
        self.board.set_plan(layout, excluded)
        self.launch_bar.set_target(launch_target(self.plan.devices, self.no_gpu))
        self.launch_bar.set_verdict(self.plan.verdict(), self.plan.reason())

    # -- launch ------------------------------------------------------------------------------
    def launch(self) -> None:
        plan = self.plan.plan()
        if plan is None or not self.launch_bar.can_launch():
            return
        if self._replanned_for_a_changed_file(plan):
            return
        self.store.save_last_session(plan.model, self.rig, self.plan.settings())
        self.launched_layout = self.plan.layout
        self.chat.ctx_limit = plan.ctx
        self.launch_bar.show_message("")
        self.client.load(plan.to_json())

    def _replanned_for_a_changed_file(self, plan: Any) -> bool:
        """The model file changed on disk since it was opened (another size or time: a new
        download, a copy over it): open it again and plan for it as it is now, keeping the
        settings that still apply, and say so instead of launching a plan made for other bytes
        (the engine would refuse it). True when it re-planned (or the file is gone)."""
        changed = []
        for stamp, path in zip(plan.identity, self.plan.gguf.paths):
            try:
                st = os.stat(path)
            except OSError:
                st = None
            if st is None or (st.st_size, st.st_mtime_ns) != (stamp.size, stamp.mtime_ns):
                changed.append(path)
        if not changed:
            return False
        settings = self.plan.settings()
        if not self.open_model(str(self.plan.gguf.paths[0])):
            self.launch_bar.show_message(f"⚠ {self.last_error}")
            return True
        self.plan.apply_settings(settings)
        self.launch_bar.show_message(
            f"⚠ {Path(changed[0]).name} changed on disk since it was opened: re-planned for the "
            "file as it is now; check the plan and Launch again")
        return True

    def _on_loaded(self, devices: list) -> None:
        self.board.set_launched(self.launched_layout)
        self.launch_bar.on_loaded(devices)
        self.tabs.setCurrentIndex(1)
        self.chat.input.setFocus()

    def _on_unloaded(self) -> None:
        self.board.set_launched(None)
        self.launch_bar.clear_report()
        self.launch_bar.show_message("Unloaded — the GPUs are free")

    def _on_engine_error(self, message: str, fatal: bool) -> None:
        if self.history.streaming:
            return  # the chat panel shows it under the transcript
        self.launch_bar.show_message(f"⚠ {message}")

    def _on_crashed(self, text: str) -> None:
        self.board.set_launched(None)
        self.launch_bar.clear_report()
        if self.history.streaming:
            self.history.finish({"reason": "error"})
        self.launch_bar.show_message("⚠ " + text.splitlines()[0] + " Launch again to restart it.")
        box = QMessageBox(QMessageBox.Icon.Warning, "The engine stopped", text.splitlines()[0],
                          QMessageBox.StandardButton.Ok, self)
        box.setDetailedText(text)
        box.setModal(False)
        box.show()  # not exec(): the app keeps running and painting
        self.crash_box = box

    # -- window ------------------------------------------------------------------------------
    def dragEnterEvent(self, event: QDragEnterEvent) -> None:
        urls = event.mimeData().urls()
        if urls and urls[0].toLocalFile().endswith(".gguf"):
            event.acceptProposedAction()

    def dropEvent(self, event: QDropEvent) -> None:
        urls = event.mimeData().urls()
        if urls:
            self.open_model(urls[0].toLocalFile())

    def _assemble_demo(self) -> None:
        self.assembler = DemoAssembler(self)
        self.assembler.progress.connect(
            lambda done, total: self.launch_bar.show_message(_assembling(done, total)))
        self.assembler.finished.connect(self._on_demo_assembled)
        self.assembler.failed.connect(lambda m: self.launch_bar.show_message(f"⚠ {m}"))
        self.launch_bar.show_message(_assembling(0, 0).split(":")[0] + "…")
        self.assembler.start()

    def _on_demo_assembled(self, path: str) -> None:
        self.launch_bar.show_message("")
        if self.plan.gguf is None:  # the user has not opened another model meanwhile
            self.open_model(path)

    def closeEvent(self, event: QCloseEvent) -> None:
        if self.assembler is not None:
            self.assembler.wait()  # a QThread must not be destroyed while it runs
        if self.plan.gguf is not None and self.remember:
            self.store.save_last_session(str(self.plan.gguf.paths[0]), self.rig,
                                         self.plan.settings())
        self.serve.stop()  # before the engine: a request in flight is stopped, not orphaned
        self.client.close_blocking()  # quitting ends the engine: no orphan holds VRAM
        if self.poller is not None:
            self.poller.stop()
        super().closeEvent(event)

    def restore(self, model: str | None, rig: str | None, assemble_demo: bool = False) -> str:
        """Startup: the model asked for, else the last one, else the demo model if assembled
        (``assemble_demo``: else the demo model once its installed chunks are joined, off the
        GUI thread); the rig asked for, else the last one, else this machine (its CPU if NVML
        finds no GPU). Returns what went wrong with a model or rig the user named ("" if nothing)."""
        last = self.store.last_session()
        problem = self.set_rig(rig or last.get("rig") or "auto")
        if problem and rig:
            return problem
        if problem:  # a remembered rig that no longer parses: plan for this machine
            self.set_rig("auto")
        path = model or last.get("model") or _demo_model()
        if not path:
            if assemble_demo and demo_installed():
                self._assemble_demo()
            return ""
        if not self.open_model(path):
            return self.last_error if model else ""
        same = last.get("model") and Path(last["model"]).name == Path(path).name
        if same and isinstance(last.get("settings"), dict):
            self.plan.apply_settings(last["settings"])
        return ""


def _assembling(done: int, total: int) -> str:
    return f"Assembling the demo model (first start): {done / 1e6:,.0f} of {total / 1e6:,.0f} MB"


def _demo_model() -> str | None:
    """The demo model's path if it is already assembled (never assembles at GUI start)."""
    try:
        from engine.gguf.demo import demo_model_path

        return str(demo_model_path(assemble=False))
    except (CarveError, ImportError, OSError):
        return None

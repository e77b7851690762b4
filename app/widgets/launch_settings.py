"""Launch settings: context, KV type, dequant-cache reserve, arena mode, prefill chunk, and for
mixture-of-experts models the experts kept in VRAM per GPU, where the others run (copied to the
GPU, or computed by the CPU) and the expert-cache slots.

Every control writes to ``PlanModel`` at once (which re-prices); the model's ``settings`` event
writes the values back, so presets and one-click fixes show up here too.
"""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer
from PySide6.QtWidgets import (
    QComboBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QSlider,
    QSpinBox,
    QWidget,
)

from app.models.model_summary import human_bytes
from app.models.plan_model import PlanModel
from engine.planning.plan import parse_counts
from engine.planning.rules import MIB, MIN_CTX, ArenaKind, ArenaMode, KvType, parse_arena
from spec.errors import CarveError

# the host-compute choices: (shown, Plan.host_compute)
HOST_CHOICES = (("Auto", "auto"), ("GPU (read over PCIe when routed)", "gpu"),
                ("CPU (where they lie)", "cpu"), ("Both (decode split CPU + GPU)", "both"))


class LaunchSettings(QWidget):
    def __init__(self, model: PlanModel, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model = model
        self._syncing = False

        self.ctx_slider = QSlider(Qt.Orientation.Horizontal)
        self.ctx_slider.setSingleStep(1)
        self.ctx_slider.setPageStep(8)
        self.ctx_spin = QSpinBox()
        self.ctx_spin.setSingleStep(MIN_CTX)
        self.ctx_spin.setGroupSeparatorShown(True)
        self.ctx_spin.setKeyboardTracking(False)
        self.ctx_spin.setMinimumWidth(92)
        ctx_row = QHBoxLayout()
        ctx_row.addWidget(self.ctx_slider, 1)
        ctx_row.addWidget(self.ctx_spin)

        self.kv_combo = QComboBox()
        self.kv_combo.addItems(list(KvType))
        self.kv_combo.setToolTip("q8_0 stores the KV cache in 34 bytes per 32 values (about half of f16)")

        self.reserve_spin = QSpinBox()
        self.reserve_spin.setRange(0, 1 << 20)
        self.reserve_spin.setSingleStep(256)
        self.reserve_spin.setSuffix(" MiB")
        self.reserve_spin.setGroupSeparatorShown(True)
        self.reserve_spin.setKeyboardTracking(False)
        self.reserve_spin.setToolTip("VRAM kept free after everything; the dequant cache gets the rest")

        self.arena_combo = QComboBox()
        self.arena_combo.addItems(list(ArenaKind))
        self.chunk_spin = QSpinBox()
        self.chunk_spin.setRange(2, 1 << 16)
        self.chunk_spin.setValue(512)
        self.chunk_spin.setSuffix(" MiB")
        self.chunk_spin.setKeyboardTracking(False)
        arena_row = QHBoxLayout()
        arena_row.addWidget(self.arena_combo, 1)
        arena_row.addWidget(self.chunk_spin)
        self.waste = QLabel()
        self.waste.setObjectName("muted")
        self.waste.setWordWrap(True)

        self.prefill_spin = QSpinBox()
        self.prefill_spin.setRange(16, 16384)
        self.prefill_spin.setSingleStep(128)
        self.prefill_spin.setSuffix(" tokens")
        self.prefill_spin.setKeyboardTracking(False)

        self.resident_edit = QLineEdit()
        self.resident_edit.setPlaceholderText("auto")
        self.resident_edit.setToolTip(
            "Per GPU, how many of its MoE layers keep their experts in VRAM (its first ones), "
            "e.g. 24,48; the rest stay in pinned host memory. auto: all when they fit, else "
            "the most that fit")
        self.host_combo = QComboBox()
        for text, where in HOST_CHOICES:
            self.host_combo.addItem(text, where)
        self.host_combo.setToolTip(
            "Experts kept in host memory: read by the GPU over PCIe when routed (decode "
            "gathers only the chosen experts, prefill moves whole layers), "
            "computed by this machine's CPU where they lie (decode "
            "moves no experts over PCIe; they are held in the CPU's own layouts, which can take "
            "more host RAM than the file), or both: decode splits each token's experts between "
            "the CPU and the GPU (the share timed at load), prefill copies them to the GPU. "
            "Auto: both where this machine's native CPU kernel reads the experts' types from "
            "the file's bytes (no more host RAM than GPU), else GPU; expert slots mean GPU")
        self.slots_spin = QSpinBox()
        self.slots_spin.setRange(0, 1 << 16)
        self.slots_spin.setToolTip("VRAM expert-cache slots per GPU, one expert each, filled "
                                   "from host memory")

        form = QFormLayout(self)
        form.setContentsMargins(0, 0, 0, 0)
        form.setLabelAlignment(Qt.AlignmentFlag.AlignLeft)
        form.addRow("Context", ctx_row)
        form.addRow("KV cache", self.kv_combo)
        form.addRow("Cache reserve", self.reserve_spin)
        form.addRow("Arena", arena_row)
        form.addRow("", self.waste)
        form.addRow("Prefill chunk", self.prefill_spin)
        self._moe_rows = [("Experts in VRAM", self.resident_edit),
                          ("Host experts on", self.host_combo), ("Expert slots", self.slots_spin)]
        for label, w in self._moe_rows:
            form.addRow(label, w)
        self._form = form

        # Pricing the three arena modes takes three prices; do it once the user pauses.
        self._waste_timer = QTimer(self)
        self._waste_timer.setSingleShot(True)
        self._waste_timer.setInterval(120)
        self._waste_timer.timeout.connect(self._update_waste)

        self.ctx_slider.valueChanged.connect(lambda v: self._write(self.model.set_ctx, v * MIN_CTX))
        self.ctx_spin.valueChanged.connect(lambda v: self._write(self.model.set_ctx, v))
        self.kv_combo.currentTextChanged.connect(lambda t: self._write(self.model.set_kv_type, t))
        self.reserve_spin.valueChanged.connect(
            lambda v: self._write(self.model.set_cache_reserve, v * MIB))
        self.arena_combo.currentTextChanged.connect(lambda *_: self._write_arena())
        self.chunk_spin.valueChanged.connect(lambda *_: self._write_arena())
        self.prefill_spin.valueChanged.connect(lambda v: self._write(self.model.set_prefill_chunk, v))
        self.resident_edit.editingFinished.connect(self._write_resident)
        self.slots_spin.valueChanged.connect(lambda v: self._write(self.model.set_expert_slots, v))
        self.host_combo.currentIndexChanged.connect(
            lambda i: self._write(self.model.set_host_compute, self.host_combo.itemData(i)))

        model.events.settings.connect(self._on_settings)
        model.events.model.connect(lambda *_: self._on_settings())
        model.events.layout.connect(lambda *_: self._waste_timer.start())
        model.events.layout.connect(lambda *_: self._show_auto())
        self._on_settings()
        self._show_auto()

    def _show_auto(self) -> None:
        """The Auto item says what Auto chose for the plan priced now ("Auto: both")."""
        lay = self.model.layout
        where = "" if lay is None or lay.host is None else lay.plan.host_compute
        label = dict((v, t.split(" (")[0]) for t, v in HOST_CHOICES).get(where)
        self.host_combo.setItemText(0, f"Auto: {label}" if label else "Auto")

    def _write(self, setter, value) -> None:
        if not self._syncing:
            setter(value)

    def _write_resident(self) -> None:
        text = self.resident_edit.text().strip().lower()
        try:
            counts = None if text in ("", "auto") else parse_counts("Experts in VRAM", text)
        except CarveError as err:
            self.resident_edit.setToolTip(str(err))
            return
        self._write(self.model.set_experts_resident, counts)

    def _chunked(self) -> str:
        return ArenaMode(ArenaKind.CHUNKED, self.chunk_spin.value() * MIB).text

    def _write_arena(self) -> None:
        kind = ArenaKind(self.arena_combo.currentText())
        self.chunk_spin.setEnabled(kind == ArenaKind.CHUNKED)
        self._write(self.model.set_arena, self._chunked() if kind == ArenaKind.CHUNKED else kind)

    def _on_settings(self) -> None:
        m = self.model
        self._syncing = True
        try:
            self.ctx_slider.setRange(1, max(1, m.max_ctx // MIN_CTX))
            self.ctx_slider.setValue(m.ctx // MIN_CTX)
            self.ctx_spin.setRange(MIN_CTX, m.max_ctx)
            self.ctx_spin.setValue(m.ctx)
            self.kv_combo.setCurrentText(m.kv_type)
            self.reserve_spin.setValue(m.cache_reserve // MIB)
            mode = parse_arena(m.arena)
            self.arena_combo.setCurrentText(mode.kind)
            if mode.kind == ArenaKind.CHUNKED:
                self.chunk_spin.setValue(mode.chunk // MIB)
            self.chunk_spin.setEnabled(mode.kind == ArenaKind.CHUNKED)
            self.prefill_spin.setValue(m.prefill_chunk)
            r = m.experts_resident
            self.resident_edit.setText("" if r is None else ",".join(map(str, r)))
            self.slots_spin.setValue(m.expert_slots)
            self.host_combo.setCurrentIndex(self.host_combo.findData(m.host_compute))
            # the slots feed the GPU's kernels: none when the CPU computes host experts
            self.slots_spin.setEnabled(m.host_compute in ("gpu", "auto"))
            moe = bool(getattr(m.hparams, "n_expert", 0))
            for _, w in self._moe_rows:  # mixture-of-experts models only
                self._form.setRowVisible(w, moe)
        finally:
            self._syncing = False

    def _update_waste(self) -> None:
        modes = (ArenaKind.PACKED, ArenaKind.PER_TENSOR, self._chunked())
        waste = self.model.rounding_by_arena(tuple(str(m) for m in modes))
        if not waste:
            self.waste.setText("")
            return
        parts = []
        for mode, nbytes in waste.items():
            text = f"{mode} {human_bytes(nbytes)}"
            parts.append(f"<b>{text}</b>" if mode == self.model.arena else text)
        self.waste.setText("rounding waste: " + " · ".join(parts))

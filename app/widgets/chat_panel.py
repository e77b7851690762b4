"""Chat tab: transcript, input, Send/Stop/Regenerate/New chat, system prompt, sampling, speed.

Wires ``EngineClient`` events into ``ChatHistory`` (tokens append, done finishes); the transcript
view mirrors the history and coalesces rendering per frame, so input stays responsive at 500 t/s.
"""

from __future__ import annotations

import itertools

from PySide6.QtCore import Qt
from PySide6.QtGui import QKeyEvent
from PySide6.QtWidgets import (
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app.engine_client import EngineClient
from app.models.chat_model import ChatHistory, ReplyMeter
from app.theme import Theme
from app.widgets.chat_view import ChatView
from app.widgets.sampling_panel import SamplingPanel
from spec.errors import CarveError


class _Input(QPlainTextEdit):
    """Enter sends, Shift+Enter is a new line."""

    def __init__(self, on_send) -> None:
        super().__init__()
        self._on_send = on_send

    def keyPressEvent(self, event: QKeyEvent) -> None:
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not (
            event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        ):
            self._on_send()
            return
        super().keyPressEvent(event)


class ChatPanel(QWidget):
    def __init__(self, history: ChatHistory, client: EngineClient, theme: Theme,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.history = history
        self.client = client
        self.ctx_limit = 0
        self._ids = itertools.count(1)
        self._gen_id = ""
        self._waiting = False  # a message sent while the engine answers a Serve request

        self.system = QLineEdit()
        self.system.setPlaceholderText("System prompt (optional), e.g. “You are a concise coding assistant.”")
        self.system.textChanged.connect(lambda t: setattr(self.history, "system_prompt", t.strip()))
        self.new_button = QPushButton("New chat")
        self.new_button.clicked.connect(self.new_chat)
        top = QHBoxLayout()
        top.addWidget(self.system, 1)
        top.addWidget(self.new_button)

        self.view = ChatView(history, theme)
        self.meter = ReplyMeter()
        self.stats = QLabel("no model loaded")
        self.stats.setObjectName("muted")
        self.input = _Input(self.send)
        self.input.setObjectName("chatInput")
        self.input.setPlaceholderText("Message the model — Enter sends, Shift+Enter for a new line")
        self.input.setFixedHeight(72)
        self.send_button = QPushButton("Send")
        self.send_button.setObjectName("primary")
        self.send_button.clicked.connect(self.send)
        self.stop_button = QPushButton("Stop")
        self.stop_button.clicked.connect(self.stop)
        self.regen_button = QPushButton("Regenerate")
        self.regen_button.clicked.connect(self.regenerate)
        buttons = QVBoxLayout()
        buttons.addWidget(self.send_button)
        buttons.addWidget(self.stop_button)
        buttons.addWidget(self.regen_button)
        bottom = QHBoxLayout()
        bottom.addWidget(self.input, 1)
        bottom.addLayout(buttons)

        left = QVBoxLayout()
        left.addLayout(top)
        left.addWidget(self.view, 1)
        left.addWidget(self.stats)
        left.addLayout(bottom)

        self.sampling = SamplingPanel()
        box = QGroupBox("Sampling")
        box_layout = QVBoxLayout(box)
        box_layout.addWidget(self.sampling)
        box_layout.addStretch(1)
        box.setFixedWidth(250)

        layout = QHBoxLayout(self)
        layout.setContentsMargins(0, 0, 0, 0)
        layout.addLayout(left, 1)
        layout.addWidget(box)

        client.token.connect(self._on_token)
        client.done.connect(self._on_done)
        client.error.connect(self._on_error)
        client.state_changed.connect(self._update_buttons)
        client.state_changed.connect(self._on_state)
        history.events.finished.connect(lambda *_: self._update_buttons())
        self._update_buttons()

    # -- actions -----------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText()
        if (self.client.state not in ("loaded", "generating") or self.history.streaming
                or self._waiting or not text.strip()):  # fmt: skip
            return
        try:
            self.history.add_user(text)
        except CarveError as err:
            self.stats.setText(str(err))
            return
        self.input.clear()
        if self.client.state == "generating":  # the engine answers a Serve request: queue
            self._waiting = True
            self.stats.setText("waiting for the server's request to finish…")
            self._update_buttons()
            return
        self._generate()

    def stop(self) -> None:
        if self._waiting:  # never reached the engine
            self._waiting = False
            self.stats.setText("not sent: stopped while the server's request ran")
            self._update_buttons()
        else:
            self.client.stop()

    def _on_state(self, state: str) -> None:
        if self._waiting and state == "loaded":
            self._waiting = False
            self._generate()
        elif self._waiting and state != "generating":
            self._waiting = False
            self._update_buttons()

    def regenerate(self) -> None:
        if self.client.state != "loaded" or not self.history.can_regenerate():
            return
        self.history.drop_last_reply()
        self._generate()

    def new_chat(self) -> None:
        if self.history.streaming:
            self.client.stop()
            self.history.finish({"reason": "cancelled"})
        self._waiting = False
        self.history.new_chat()
        self._update_buttons()

    def _generate(self) -> None:
        messages = self.history.request_messages()
        self.history.begin_reply()
        self._gen_id = f"chat-{next(self._ids)}"
        self.meter.begin()
        s = self.sampling.settings.to_dict()
        self.client.generate(messages, s, self._gen_id, max_tokens=s["max_tokens"])
        self.stats.setText("reading the prompt…")  # until the first token: not "ready"
        self._update_buttons()

    # -- engine events -----------------------------------------------------------------------
    def _on_token(self, _id: int, text: str) -> None:
        if not self.history.streaming:
            return  # a Serve request's reply
        self.history.append(text)
        if self.meter.token():
            self.stats.setText(self.meter.text(self.history.context_used, self.ctx_limit or 0))

    def _on_done(self, stats: dict) -> None:
        if stats.get("request") not in (None, "", self._gen_id):
            return  # a Serve request's reply
        self.history.finish(stats)
        used = int(stats.get("ctx_used") or self.history.context_used)
        self.history.context_used = used
        parts = [f"{stats.get('decode_tps', 0.0):.1f} tokens/s"]
        if stats.get("prefill_tps"):
            parts.append(f"prompt {stats['prefill_tps']:.0f} tokens/s")
        limit = f" / {self.ctx_limit:,}" if self.ctx_limit else ""
        parts.append(f"context {used:,}{limit} tokens")
        self.stats.setText("  ·  ".join(parts))

    def _on_error(self, message: str, _fatal: bool) -> None:
        if self.history.streaming:
            self.history.finish({"reason": "error", "error": message})
            self.stats.setText(f"⚠ {message}")

    def _update_buttons(self, *_: object) -> None:
        loaded = self.client.state in ("loaded", "generating")
        streaming = self.history.streaming
        self.send_button.setEnabled(loaded and not streaming and not self._waiting)
        self.stop_button.setEnabled(streaming or self._waiting)
        self.regen_button.setEnabled(loaded and self.history.can_regenerate())
        self.view.set_loaded(loaded)
        if not loaded and not streaming:
            self.stats.setText("no model loaded — launch one on the Plan tab")
        elif loaded and self.stats.text().startswith("no model"):
            self.stats.setText("ready")

"""The window's Serve switch: the OpenAI-compatible server (app/serve) on the model the window
has loaded, sharing its engine process.

``WindowLink`` puts the server's requests on the window's ``EngineClient``: a server request is
sent only while the window's chat is idle, and while it runs the client is "generating", so the
chat waits for it (and the server for a chat reply). uvicorn runs on a ``QThread``; requests
cross to the GUI thread through a queued signal, events go back through ``EngineTurns.feed``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, Qt, QThread, QTimer, Signal
from PySide6.QtWidgets import QHBoxLayout, QLabel, QPushButton, QWidget

from app.engine_client import EngineClient
from app.models.chat_model import ChatHistory
from app.serve.engine_turns import EngineTurns
from app.serve.http import HttpServer, build_app
from app.serve.openai_api import model_id
from engine.process import protocol as p
from spec.errors import CarveError

DEFAULT_PORT = 8080


class WindowLink(QObject):
    """The server's turns on the window's engine client (GUI thread)."""

    _requests = Signal(object)  # from the server's thread; delivered on the GUI thread

    def __init__(self, client: EngineClient, history: ChatHistory,
                 parent: QObject | None = None) -> None:  # fmt: skip
        super().__init__(parent)
        self.client, self.history = client, history
        self.turns = EngineTurns(self._requests.emit)
        self._held: list[p.Generate] = []  # the server's generate, waiting for the chat
        self._running = ""  # id of the server's generate the engine is running
        self._requests.connect(self._on_request, Qt.ConnectionType.QueuedConnection)
        client.event.connect(self._on_event)
        client.state_changed.connect(self._try_send)
        client.exited.connect(self._on_exited)
        history.events.finished.connect(lambda *_: self._try_send())

    def close(self) -> None:
        if self._running:  # the server's reply in the engine now has no reader
            self.client.stop()
        self.client.event.disconnect(self._on_event)
        self.client.state_changed.disconnect(self._try_send)
        self.client.exited.disconnect(self._on_exited)
        self.turns.engine_gone("serving was switched off in the window")

    def _on_request(self, request: p.Request) -> None:
        if isinstance(request, p.Generate):
            self._held.append(request)
            self._try_send()
        elif isinstance(request, p.Stop):
            if self._running:
                self.client.stop()
            elif self._held:  # never reached the engine: it ends here
                dropped = self._held.pop(0)
                self.turns.feed(p.Done("cancelled", 0, 0, request=dropped.id))

    def _try_send(self, *_: object) -> None:
        if not self._held or self._running or self.history.streaming:
            return
        if self.client.state != "loaded":
            return
        req = self._held.pop(0)
        self._running = req.id
        self.client.generate(req.messages, req.sampling, req.id, req.max_tokens,
                             prompt=req.prompt, exact_max_tokens=req.exact_max_tokens)  # fmt: skip

    def _on_event(self, event: object) -> None:
        if not self._running:
            return  # the window's own reply, or nothing of the server's
        if isinstance(event, (p.Token, p.Note)):
            self.turns.feed(event)
        elif isinstance(event, (p.Done, p.Error)) and event.request in ("", self._running):
            self._running = ""
            self.turns.feed(event)

    def _on_exited(self) -> None:
        self._running = ""
        self._held.clear()
        self.turns.engine_gone("the engine process exited; launch the model again")


class ServeThread(QThread):
    """uvicorn's event loop, off the GUI thread."""

    def __init__(self, server: HttpServer, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.server = server

    def run(self) -> None:
        self.server.run()


class ServeSwitch(QWidget):
    """A "Serve" toggle, the URL it serves at and how many requests it answered."""

    def __init__(self, client: EngineClient, history: ChatHistory,
                 loaded_model: Callable[[], str | None], parent: QWidget | None = None,
                 port: int = DEFAULT_PORT) -> None:  # fmt: skip
        super().__init__(parent)
        self.client, self.history, self.loaded_model = client, history, loaded_model
        self.host, self.port = "127.0.0.1", port
        self.link: WindowLink | None = None
        self.thread: ServeThread | None = None
        self.url = ""
        self.button = QPushButton("Serve")
        self.button.setCheckable(True)
        self.button.setToolTip("Answer the OpenAI API (/v1/chat/completions, /v1/completions) "
                               "on this machine with the loaded model")  # fmt: skip
        self.status = QLabel("")
        self.status.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        row = QHBoxLayout(self)
        row.setContentsMargins(0, 0, 0, 0)
        row.addWidget(self.button)
        row.addWidget(self.status, 1)
        self._tick = QTimer(self)
        self._tick.setInterval(500)
        self._tick.timeout.connect(self._show_count)
        self.button.toggled.connect(self._on_toggled)
        client.state_changed.connect(self._on_state)
        self._on_state(client.state)

    @property
    def serving(self) -> bool:
        return self.thread is not None

    def _on_state(self, state: str) -> None:
        loaded = state in ("loaded", "generating")
        if not loaded and self.serving:
            self.stop()
            self.status.setText("stopped serving: the model is no longer loaded")
        self.button.setEnabled(loaded)

    def _on_toggled(self, on: bool) -> None:
        if on and not self.serving:
            self.start()
        elif not on and self.serving:
            self.stop()

    def start(self) -> bool:
        path = self.loaded_model()
        if not path or self.client.state not in ("loaded", "generating"):
            self._refuse("launch a model first; Serve shares the loaded one")
            return False
        link = WindowLink(self.client, self.history, self)
        try:
            server = HttpServer(build_app(link.turns, model_id(Path(path).name)), self.host,
                                self.port, on_exit=lambda: link.turns.close(
                                    "serving was switched off in the window"))  # fmt: skip
        except CarveError as err:
            link.close()
            link.deleteLater()
            self._refuse(str(err))
            return False
        self.link, self.url = link, server.url
        self.thread = ServeThread(server, self)
        self.thread.start()
        self._tick.start()
        self._show_count()
        return True

    def stop(self) -> None:
        """Stop serving; waits for the server's thread (a request in flight is stopped)."""
        if self.thread is None:
            return
        self.thread.server.stop()
        self.thread.wait()
        self.thread.deleteLater()
        self.thread = None
        self._tick.stop()
        if self.link is not None:
            self.link.close()
            self.link.deleteLater()
            self.link = None
        with _blocked(self.button):
            self.button.setChecked(False)
        self.status.setText("")

    def served(self) -> int:
        return self.link.turns.served if self.link is not None else 0

    def _show_count(self) -> None:
        n = self.served()
        self.status.setText(f"serving at {self.url}  ·  {n} request{'s' * (n != 1)} served")

    def _refuse(self, message: str) -> None:
        with _blocked(self.button):
            self.button.setChecked(False)
        self.status.setText(f"⚠ {message}")


class _blocked:
    def __init__(self, widget: QWidget) -> None:
        self.widget = widget

    def __enter__(self) -> None:
        self._was = self.widget.blockSignals(True)

    def __exit__(self, *exc: object) -> None:
        self.widget.blockSignals(self._was)

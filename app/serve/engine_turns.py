"""Requests take turns on the one engine: the asyncio side of the server.

The engine runs one generate at a time and its token events carry no request id, so the server
sends a generate only when the one before it is finished (its done or error event came back).
Whoever owns the engine process feeds every event of the server's requests to ``feed`` (from any
thread) and ``send`` writes a request to the engine (called on the server's event loop thread).

A request whose client went away is abandoned: the engine is sent ``stop`` and the turn stays
the engine's until the done event of that generate comes back, so the next request starts on an
idle engine.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

from engine.process import protocol as p


class EngineGone(Exception):
    """The engine process has exited; the server cannot answer until it is started again."""


class Turn:
    """One generate on the engine: its events, in order, end with a Done or an Error."""

    def __init__(self, request: p.Generate) -> None:
        self.request = request
        self.events: asyncio.Queue[p.Event | EngineGone] = asyncio.Queue()
        self.started = False  # sent to the engine
        self.finished = False  # its done/error came back, or the engine is gone
        self.abandoned = False  # its client went away: stop sent, events dropped
        self.stop_sent = False

    async def next_event(self, timeout: float | None = None) -> p.Event | None:
        """The next event; None after `timeout` seconds; EngineGone once the engine exited."""
        try:
            item = await asyncio.wait_for(self.events.get(), timeout)
        except TimeoutError:
            return None
        if isinstance(item, EngineGone):
            raise item
        return item


class EngineTurns:
    def __init__(self, send: Callable[[p.Request], None]) -> None:
        self._send = send
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: collections.deque[Turn] = collections.deque()  # waiting, in arrival order
        self._current: Turn | None = None
        self._ids = itertools.count(1)
        self.gone: str | None = None  # why the engine can not answer any more
        self.served = 0  # requests answered to the end (any finish reason)
        self.waiting = 0  # requests queued or running

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The loop the server runs on; events fed from other threads are handed to it."""
        self._loop = loop

    # ------------------------------------------------------------ the owner's side (any thread)

    def feed(self, event: p.Event | p.ProtocolError) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_event, event)

    def engine_gone(self, why: str) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_gone, why)

    def close(self, why: str) -> None:
        """The server is stopping: stop the engine's generation and answer everyone `why`."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._on_close, why)

    # ------------------------------------------------------------ the server's side (its loop)

    async def begin(self, request: p.Generate) -> Turn:
        """Wait for the engine to be free, then send `request` (its id is set here)."""
        if self.gone:
            raise EngineGone(self.gone)
        turn = Turn(dataclasses.replace(request, id=f"serve-{next(self._ids)}"))
        self._queue.append(turn)
        self.waiting += 1
        self._next()
        return turn

    def abandon(self, turn: Turn) -> None:
        """The client went away: stop its generation (or drop it before it starts)."""
        if turn.finished or turn.abandoned:
            return
        turn.abandoned = True
        if not turn.started:
            self._queue.remove(turn)
            self._finish(turn)
            self._next()
        else:
            self.stop(turn)

    def stop(self, turn: Turn) -> None:
        """End `turn`'s generation early (a stop string came); its done event still comes."""
        if turn.started and not turn.finished and not turn.stop_sent and not self.gone:
            turn.stop_sent = True
            self._send(p.Stop())

    def _next(self) -> None:
        if self._current is not None or not self._queue or self.gone:
            return
        turn = self._current = self._queue.popleft()
        turn.started = True
        try:
            self._send(turn.request)
        except Exception as err:  # noqa: BLE001 - a closed pipe: the engine is gone
            self._on_gone(str(err) or type(err).__name__)

    def _finish(self, turn: Turn) -> None:
        if not turn.finished:
            turn.finished = True
            self.waiting -= 1
            if not turn.abandoned:
                self.served += 1

    def _on_event(self, event: Any) -> None:
        turn = self._current
        if turn is None or isinstance(event, p.ProtocolError):
            return
        if isinstance(event, (p.Done, p.Error)):
            if event.request not in ("", turn.request.id):
                return  # not the server's generate (a window reply, an old request)
            self._current = None
            self._finish(turn)
            if isinstance(event, p.Error) and event.fatal:
                self.gone = f"the engine stopped: {event.message}"
        if not turn.abandoned:
            turn.events.put_nowait(event)
        self._next()

    def _on_close(self, why: str) -> None:
        if self._current is not None:
            self.stop(self._current)
        self._on_gone(why)

    def _on_gone(self, why: str) -> None:
        self.gone = self.gone or why
        for turn in [*([self._current] if self._current else []), *self._queue]:
            self._finish(turn)
            turn.events.put_nowait(EngineGone(self.gone))
        self._current = None
        self._queue.clear()

"""A minimal Qt-free event group, after napari's ``EmitterGroup``: ``model.events.name.connect(cb)``.

Models emit plain Python callbacks so they can be used and tested without a QApplication; the
widgets connect their ``_on_<name>`` slots to them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Emitter:
    """One named event: a list of callbacks called in connection order."""

    __slots__ = ("_blocked", "_callbacks", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._callbacks: list[Callable[..., Any]] = []
        self._blocked = 0

    def connect(self, callback: Callable[..., Any]) -> Callable[..., Any]:
        if callback not in self._callbacks:
            self._callbacks.append(callback)
        return callback

    def disconnect(self, callback: Callable[..., Any]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def emit(self, *args: Any) -> None:
        if self._blocked:
            return
        for callback in list(self._callbacks):
            callback(*args)

    def blocked(self) -> _Blocker:
        return _Blocker(self)


class _Blocker:
    def __init__(self, emitter: Emitter) -> None:
        self._emitter = emitter

    def __enter__(self) -> None:
        self._emitter._blocked += 1

    def __exit__(self, *exc: object) -> None:
        self._emitter._blocked -= 1


class Events:
    """A group of emitters named at construction: ``Events("layout", "split").layout.connect``."""

    def __init__(self, *names: str) -> None:
        for name in names:
            setattr(self, name, Emitter(name))

    def __getattr__(self, name: str) -> Emitter:  # only reached for names never declared
        raise AttributeError(f"no event named {name!r}")

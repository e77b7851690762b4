"""The PySide6 6.12.0 emit workaround keeps the True singleton's reference count steady."""

from __future__ import annotations

import sys

from PySide6.QtCore import QObject, Signal

import app.signal_refcount as fix


class _Emitter(QObject):
    text = Signal(str)


def test_thousands_of_emits_leave_true_alone():
    e = _Emitter()
    got = []
    e.text.connect(got.append)
    before = sys.getrefcount(True)
    for _ in range(5000):
        e.text.emit("t")
    assert len(got) == 5000
    assert abs(sys.getrefcount(True) - before) < 10
    assert not fix.emit_steals_a_reference()  # patched (or never broken)

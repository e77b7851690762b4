"""Work around PySide6 6.12.0's ``SignalInstance.emit`` returning a borrowed ``True``.

In PySide6 6.12.0 every ``signal.emit(...)`` made from Python hands back ``True`` without taking
a reference to it, so each emit drops one reference from the ``True`` singleton. After a few
thousand emits (a second or two of tokens at 500 t/s, or a few minutes of NVML polling and
pyqtgraph drags) CPython aborts with "Fatal Python error: bool_dealloc: deallocating True or
False". We probe for the bug once at import and, only if it is there, wrap ``emit`` so the
reference it forgot is taken. pyqtgraph's own emits go through the same method, so they are
covered too. Import this module before any signal is emitted (app.widgets and the Qt-side app
modules import it).
"""

from __future__ import annotations

import ctypes
import gc
import sys

from PySide6.QtCore import QObject, Signal, SignalInstance

_incref = ctypes.pythonapi.Py_IncRef
_incref.argtypes = [ctypes.py_object]
_incref.restype = None


class _Probe(QObject):
    ping = Signal()


def emit_steals_a_reference() -> bool:
    """True when ``emit`` drops a reference of the bool it returns (the PySide6 6.12.0 bug)."""
    probe = _Probe()
    before = sys.getrefcount(True)
    for _ in range(8):
        probe.ping.emit()
    stolen = sys.getrefcount(True) < before
    if stolen:  # give back what the probe itself took
        for _ in range(before - sys.getrefcount(True)):
            _incref(True)
    return stolen


def install() -> bool:
    """Patch ``SignalInstance.emit`` if (and only if) it has the bug; returns whether it did."""
    if getattr(SignalInstance, "_carve_refcount_fix", False):
        return True
    if not emit_steals_a_reference():
        return False
    # The type is immutable from Python; its __dict__ proxy's backing dict is not.
    type_dict = gc.get_referents(SignalInstance.__dict__)[0]
    original = type_dict["emit"]

    def emit(self: SignalInstance, *args: object) -> object:
        result = original(self, *args)
        if result is True or result is False:
            _incref(result)
        return result

    type_dict["emit"] = emit
    type_dict["_carve_refcount_fix"] = True
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(SignalInstance))
    return True


INSTALLED = install()

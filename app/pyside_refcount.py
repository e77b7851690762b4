"""Work around PySide6 6.12.0 handing back borrowed references to None, True and False.

In PySide6 6.12.0 (with CPython 3.11) every call of a C++ method that returns void (``setText``,
``update``, ``processEvents``, ``QTimer.start`` ...) drops one reference from ``None`` without
having taken it, and every ``signal.emit(...)`` does the same to ``True``. A GUI makes thousands
of such calls a second (pyqtgraph's ``setOpts``, streamed tokens, NVML refreshes), so after a
few seconds to minutes CPython aborts with "Fatal Python error: none_dealloc: deallocating
None" (or ``bool_dealloc``).

CPython 3.12 made these singletons immortal (PEP 683) so that their count no longer matters; on
3.11 we do the same by hand: once, at import, if (and only if) the bug is detected, each of the
three gets 2**40 extra references, far more than any session can leak (a million leaked
references a second would take 12 days). Import this module before the GUI runs
(app.widgets and the Qt-side app modules import it).
"""

from __future__ import annotations

import ctypes
import sys

from PySide6.QtCore import QObject, Signal

EXTRA = 1 << 40
_SINGLETONS = (None, True, False)


class _Probe(QObject):
    ping = Signal()


def leaks() -> dict[str, bool]:
    """Which borrowed-reference bugs this PySide6 has: void methods (None), emit (True)."""
    probe = _Probe()
    none, true = sys.getrefcount(None), sys.getrefcount(True)
    for _ in range(8):
        probe.setObjectName("probe")  # a void method
    void_leak = sys.getrefcount(None) < none
    for _ in range(8):
        probe.ping.emit()
    emit_leak = sys.getrefcount(True) < true
    return {"void": void_leak, "emit": emit_leak}


def _add_references(obj: object, n: int) -> None:
    # ob_refcnt is the first field of every PyObject (CPython 3.11: a Py_ssize_t).
    ctypes.c_ssize_t.from_address(id(obj)).value += n


def install() -> bool:
    """Make None/True/False effectively immortal if this PySide6 leaks them; idempotent."""
    if sys.version_info >= (3, 12) or getattr(sys, "_carve_pyside_refcount_fix", False):
        return False  # immortal already, or done
    found = leaks()
    if not any(found.values()):
        return False
    for obj in _SINGLETONS:
        _add_references(obj, EXTRA)
    sys._carve_pyside_refcount_fix = True
    return True


INSTALLED = install()

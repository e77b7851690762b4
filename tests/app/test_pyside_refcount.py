"""The PySide6 6.12.0 borrowed-reference workaround keeps None/True/False alive for good."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import app.pyside_refcount as fix

ROOT = Path(__file__).resolve().parents[2]


def test_singletons_have_headroom_once_installed():
    if not fix.leaks()["void"] and not fix.leaks()["emit"]:
        return  # a PySide6 without the bug: nothing to protect
    assert sys.getrefcount(None) > fix.EXTRA // 2
    assert sys.getrefcount(True) > fix.EXTRA // 2 and sys.getrefcount(False) > fix.EXTRA // 2
    assert fix.install() is False  # idempotent: a second import adds nothing


def test_a_long_session_of_void_calls_and_emits_survives():
    # without the fix, 300k void calls and emits abort CPython ("deallocating None")
    code = """
import app.pyside_refcount
from PySide6.QtCore import QObject, Signal
class E(QObject):
    s = Signal(str)
e = E()
for _ in range(300_000):
    e.setObjectName("x")
    e.s.emit("t")
print("alive")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT), QT_QPA_PLATFORM="offscreen")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=False)
    assert out.returncode == 0 and "alive" in out.stdout, out.stderr[-500:]

"""Thin Qt views over the Qt-free models in app/models."""

import app.pyside_refcount  # noqa: F401  (PySide6 6.12.0 refcount bug: before any Qt call)

"""Thin Qt views over the Qt-free models in app/models."""

import app.signal_refcount  # noqa: F401  (PySide6 6.12.0 emit refcount bug; before any emit)

"""Thin Qt views over the Qt-free models in app/models."""

"""Carve desktop app and CLI. Never imports torch or triton."""

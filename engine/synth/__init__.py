"""Synthetic models (pure Python): real shapes (``shapes``) written as GGUF files with random,
well-formed quantized blocks (``gen``, `carve gen`), for speed and memory work."""

"""Carve engine: reads, prices, loads and runs GGUF models. Never imports Qt."""

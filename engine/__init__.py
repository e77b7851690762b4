"""Carve engine: reads, prices, loads and runs GGUF models. Never imports Qt.

Pure Python (the window imports these): ``gguf`` (file format, hyper-parameters), ``planning``
(plan, pricing, split), ``hardware`` (GPUs, rigs, calibration), ``text`` (tokenizer, chat
templates), ``process`` (protocol and client of the engine process), ``synth`` (synthetic
models). The torch half: ``runtime`` (the engine process, CPU and GPU runners)."""

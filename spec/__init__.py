"""Facts the engine and the kernels both build on, and nothing of ours beneath them: the GGUF
tensor-type table (``quant_types``), the kernels' launch shapes that pricing reserves buffers for
(``launch``) and the one error type a person sees (``errors``). Pure Python; imports neither
``engine`` nor ``carve_kernels`` nor torch."""

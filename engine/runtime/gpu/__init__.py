"""The GPU runner: loading a Layout onto GPUs, one stage per device, decode captured in CUDA
graphs, measured memory."""

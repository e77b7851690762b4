"""One shared-memory carveout for every Triton kernel this process loads (trial ``carveout``).

An SM splits its 256 KiB between L1 and shared memory per kernel configuration; two kernels
whose carveouts differ cannot be resident on one SM at once, so a decode kernel launched early
under PDL (carve_kernels/pdl.py) may wait for the SM to drain before it can be placed. Setting
the same preference on every kernel (``CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT``,
percent of the most shared memory) is the experiment.
"""

from __future__ import annotations

import ctypes

_PREFERRED_SHARED_MEMORY_CARVEOUT = 9  # CUfunction_attribute
_installed: list[int] = []


def install(percent: int) -> None:
    """Set ``percent`` as the carveout preference of every kernel loaded from now on."""
    import torch
    from triton.compiler import compiler

    if not torch.cuda.is_available():
        return  # nothing loads a CUDA kernel here
    if _installed:
        _installed[0] = percent
        return
    _installed.append(percent)
    libcuda = ctypes.CDLL("libcuda.so.1")
    original = compiler.CompiledKernel._init_handles

    def init_handles(self):
        fresh = self.module is None
        original(self)
        if fresh and self.function:
            rc = libcuda.cuFuncSetAttribute(ctypes.c_void_p(self.function),
                                            _PREFERRED_SHARED_MEMORY_CARVEOUT,
                                            ctypes.c_int(_installed[0]))
            if rc != 0:
                raise RuntimeError(f"cuFuncSetAttribute(carveout) of {self.name}: CUDA error {rc}")

    compiler.CompiledKernel._init_handles = init_handles

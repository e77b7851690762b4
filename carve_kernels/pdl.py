"""Programmatic dependent launch (PDL, sm_90 and later) for the kernels of the decode step.

A kernel launched with ``launch_pdl`` may start while the kernel before it in the stream is
still running: its programs become resident as soon as every program of the one before has
passed ``gdc_launch_dependents``, run up to ``gdc_wait`` (which returns once that kernel has
finished and its writes are visible) and only then read what it wrote. In a CUDA graph of
~230 small launches per token this hides the launch gap and the previous kernel's tail.

Every kernel that takes ``PDL`` calls ``start(PDL)`` before its first read of another
kernel's output, and writes nothing before it; what no kernel writes (a norm's weights) may be
read before it. Off under the interpreter, on GPUs below sm_90, and where the caller passes
``use_pdl=False`` (every kernel wrapper takes it; the engine passes its RunnerOptions.pdl).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def enabled(t: torch.Tensor, use_pdl: bool) -> bool:
    """PDL for kernels writing ``t``: asked for, and ``t`` a CUDA tensor on sm_90+."""
    if not use_pdl or not t.is_cuda:
        return False
    return _capable(t.device.index if t.device.index is not None
                    else torch.cuda.current_device())


def opts(t: torch.Tensor, use_pdl: bool) -> dict:
    """The ``PDL`` constexpr and launch option for a kernel writing ``t`` (no launch option
    when off: the interpreter knows none)."""
    return {"PDL": True, "launch_pdl": True} if enabled(t, use_pdl) else {"PDL": False}


@triton.jit
def start(PDL: tl.constexpr):
    # wait for the kernel before (its writes visible), then let the next one become resident
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    # ``start``'s wait alone: the kernel lets the next one become resident later (``release``)
    if PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def release(PDL: tl.constexpr):
    # let the next kernel become resident (after ``wait``: a kernel whose programs should not
    # share their SMs with the next one's waiting programs while they work)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()

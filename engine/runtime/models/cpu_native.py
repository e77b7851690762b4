"""A decode row's routed experts multiplied on the CPU straight from the file's blocks, by the
host's native kernel (engine/hardware/native.py builds and loads it; DESIGN.md "Experts in
host memory").

torch has no CPU product over GGUF's blocks, so `cpu_experts` repacks the experts into layouts
it has (int4, or 16-bit floats for Q6_K: 2.4x the file's bytes) and runs one torch call per
product: three a routed expert, each waking the thread pool. The kernel takes a layer's whole
share of a row in one call (gate/up of every chosen expert shared among the threads, then the
down rows; x and the GLU's output quantized to int8 per 256 values, or per 32 where every
matrix has blocks of 32, as llama.cpp's CPU does; each block summed in integers), reading
Q4_0 to Q8_0, Q2_K to Q6_K, the IQ1 / IQ2 / IQ3 / IQ4 types and MXFP4 blocks where they lie
(the host span the GPU reads in place; gpt-oss's biases and clamped SwiGLU too). A plan priced
where it is available keeps no CPU layout for a layer it covers.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from engine.hardware.native import ACTS, ROW_TYPES, ServeLayer, build, library, supported
from spec.errors import CarveError

__all__ = ["ACTS", "NativeExperts", "StepServer", "build", "library", "supported"]


class NativeExperts:
    """One layer's routed experts as the library reads them: the file's bytes of gate, up and
    down ([n_expert * rows, row bytes] uint8 host tensors) and their types, and (gpt-oss)
    their biases (float32 [n_expert, rows] each) and SwiGLU clamp; ``run`` computes a row's
    share into y. Holds its scratch, so a layer's calls allocate nothing."""

    def __init__(self, lib: Any, mats: list[torch.Tensor], types: tuple[int, int, int],
                 n_embd: int, n_ff: int, n_expert: int, k: int, act: str,
                 limit: float = 0.0, biases: list[torch.Tensor] | None = None) -> None:
        if not supported(types, act, n_embd, n_ff):
            raise ValueError(f"native experts: types {types} / {act} not multiplied")
        if not all(m.is_contiguous() for m in [*mats, *(biases or [])]):
            raise ValueError("native experts: the expert bytes must be contiguous")
        if biases is not None and (
                [tuple(b.shape) for b in biases] != [(n_expert, n_ff)] * 2 + [(n_expert, n_embd)]
                or any(b.dtype != torch.float32 for b in biases)):
            raise ValueError("native experts: biases are float32 [n_expert, rows] per matrix")
        self.lib, self.mats, self.types = lib, mats, types
        self.n_embd, self.n_ff, self.n_expert = n_embd, n_ff, n_expert
        self.act, self.limit = (2 if limit else ACTS[act]), float(limit)
        self.biases = biases
        self.k = k
        # (64-byte aligned: torch's CPU allocations are)
        self.scratch = torch.empty(int(lib.carve_scratch_bytes(n_embd, n_ff, k)),
                                   dtype=torch.uint8)

    def run(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, y: torch.Tensor,
            threads: int | None = None) -> None:
        """y [n_embd] float32 = sum_j w[j] * expert ids[j] of x [n_embd] float32 (ids int32,
        w float32 [c], all contiguous CPU tensors)."""
        c = ids.numel()
        if (x.dtype != torch.float32 or ids.dtype != torch.int32 or w.dtype != torch.float32
                or y.dtype != torch.float32 or c > self.k
                or not all(t.is_contiguous() for t in (x, ids, w, y))):
            raise ValueError("native experts: x, w, y float32, ids int32, contiguous, "
                             "at most k of them")
        g, u, d = self.mats
        gb, ub, db = (b.data_ptr() for b in self.biases) if self.biases else (None,) * 3
        rc = self.lib.carve_experts(
            self.n_embd, self.n_ff, self.n_expert, c, x.data_ptr(), ids.data_ptr(), w.data_ptr(),
            g.data_ptr(), self.types[0], u.data_ptr(), self.types[1], d.data_ptr(),
            self.types[2], self.act, self.limit, gb, ub, db, self.scratch.data_ptr(),
            y.data_ptr(), threads or torch.get_num_threads())
        if rc != 0:
            raise ValueError("native experts: " + ("an expert id beyond the layer's "
                             f"{self.n_expert}" if rc == -2 else "types or sizes refused"))

    def serve_layer(self, flags: torch.Tensor, x: torch.Tensor, ids: torch.Tensor,
                    w: torch.Tensor, y: torch.Tensor, xf: torch.Tensor, c: int) -> ServeLayer:
        """This layer as `StepServer` answers it: the ticket words ``flags`` (int32), the
        published row ``x`` [n_embd] (float32, float16 or bfloat16), the first ``c`` of
        ``ids`` / ``w``, the sum into ``y`` [n_embd] float32, x as float in ``xf``."""
        row = str(x.dtype).removeprefix("torch.")
        if (c < 1 or c > self.k or y.dtype != torch.float32 or xf.dtype != torch.float32
                or row not in ROW_TYPES
                or min(x.numel(), y.numel(), xf.numel()) < self.n_embd):
            raise ValueError("native experts: a split layer's buffers or share do not fit")
        g, u, d = self.mats
        gb, ub, db = (b.data_ptr() for b in self.biases) if self.biases else (None,) * 3
        return ServeLayer(flags.data_ptr(), x.data_ptr(), ROW_TYPES[row],
                          ids.data_ptr(), w.data_ptr(), y.data_ptr(), xf.data_ptr(), c,
                          self.n_embd, self.n_ff, self.n_expert, self.act, self.limit,
                          g.data_ptr(), u.data_ptr(), d.data_ptr(), *self.types, gb, ub, db,
                          self.scratch.data_ptr())


class StepServer:
    """A decode step's split layers (host_compute "both") answered in one call of the
    library's ``carve_serve``: every thread spins on the next layer's ticket itself, so no
    thread sleeps or wakes between layers and no Python runs between a ticket and its answer
    (`HostExperts.serve` is the same answer one layer at a time, in Python). ``layers``: the
    `NativeExperts.serve_layer` of each, in the order the graph raises their tickets;
    ``report(i, wait_s, cpu_s)`` takes each layer's seconds after a call."""

    def __init__(self, lib: Any, layers: list[ServeLayer], keep: list[torch.Tensor],
                 report: Any) -> None:
        self.lib, self.n = lib, len(layers)
        self.layers = (ServeLayer * self.n)(*layers)
        self.keep = keep  # the tensors the structures point into
        self.times = (ctypes.c_double * (2 * self.n))()
        self.failed = ctypes.c_int(-1)
        self.report = report

    def serve(self, timeout_s: float = 60.0, threads: int | None = None) -> None:
        """Answer one replay's tickets, layer by layer; raises CarveError where a ticket did
        not come within ``timeout_s`` or a layer's ids were out of range (that one answered,
        its sum NaN; the rest are the caller's to drain)."""
        ctypes.memset(self.times, 0, ctypes.sizeof(self.times))
        rc = self.lib.carve_serve(self.layers, self.n, threads or torch.get_num_threads(),
                                  timeout_s, self.times, ctypes.byref(self.failed))
        for i in range(self.n):
            self.report(i, self.times[2 * i], self.times[2 * i + 1])
        if rc == -3:
            raise CarveError(f"host experts: the GPU did not publish its row within "
                             f"{timeout_s:.0f} s (the decode step stopped)")
        if rc:
            raise CarveError(f"host experts: the CPU's kernel refused split layer "
                             f"{self.failed.value} of the step (" + (
                                 "an expert id beyond the layer's" if rc == -2
                                 else "types or sizes") + ")")

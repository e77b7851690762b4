"""Routed experts that the CPU multiplies itself, held in a layout torch multiplies at memory
speed (DESIGN.md "Experts in host memory", host_compute "cpu" and "both").

The file's blocks are what the GPU kernels read, but torch has no CPU product over them: the
CPU engine's `ops.linear` dequantizes each routed expert to float32 first, which costs about
forty times the product itself. So a stage whose host layers' experts run on the CPU holds
each expert tensor in the layout `engine.planning.host.tensor_cpu_layout` chose for it:

- "int4" (Q4_0, Q4_1, Q4_K): the 4-bit values unchanged, packed by torch's own int4 weight
  packer, with one (scale, zero) pair in bf16 per 32 values such that a weight is
  ``(q - 8) * scale + zero`` — Q4_0: scale d, zero 0; Q4_1: d, 8d + m; Q4_K: d * sc, 8 d * sc -
  dmin * m. The product is torch's int4 matrix kernel on bf16 inputs. Exact but for the bf16
  rounding of scale and zero (and of x and the result);
- "half" (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, F16, BF16): each expert dequantized once, at load, to a
  16-bit float matrix, multiplied by torch's GEMM in that type: f16 or bf16, whichever this
  CPU's torch multiplies faster (`half_dtype`, timed once per process: f16 ran 1.9x faster on
  a Zen 4, ten times slower on an older Xeon). In f16, x is scaled by a power of two into
  f16's range first and the result scaled back (exact), and a weight beyond f16's range is a
  load error; a product that overflows anyway is redone in float32;
- "file": the file's bytes, dequantized per routed expert as the CPU engine does (every other
  type, and the biases).

Per expert matrix the span holds, for "int4", the experts' packed values one after another
([rows, cols / 2] bytes each, as torch packs one expert), then their scale/zero pairs (bf16
[n_expert, cols / 32, rows, 2]); for "half", [n_expert * rows, cols] of the 16-bit type.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from carve_kernels.dequant import dequantize_to
from engine.planning.host import CPU_GROUP, tensor_cpu_layout
from engine.runtime.models import ops
from spec import quant_types as qt
from spec.errors import CarveError

# experts repacked per step at load: bounds the temporary copy of their file bytes
LOAD_EXPERTS = 8
# the "half" layout's type on this machine (`half_dtype`), decided once per process
_HALF: list[torch.dtype] = []
# f16 must beat bf16 by this factor to be chosen (bf16 needs no scaling of x)
HALF_MARGIN = 0.8
# rounds of that timing
HALF_ROUNDS = 5


def half_dtype() -> torch.dtype:
    """The 16-bit float of the "half" layout: f16 where this CPU's torch multiplies a
    [768, 2048] matrix by a row clearly faster in it than in bf16, else bf16. Timed once per
    process (a few milliseconds), so the load and every product agree: the two types in
    turns, HALF_ROUNDS rounds after one untimed each, the best round of each compared (timed
    one after the other, the first paid for the thread pool waking: an H100 host's Xeon took
    f16 although bf16 multiplied 1.3x faster there)."""
    if not _HALF:
        w32, x32 = torch.randn(768, 2048), torch.randn(1, 2048)
        pairs = {dt: (w32.to(dt), x32.to(dt)) for dt in (torch.bfloat16, torch.float16)}
        took = dict.fromkeys(pairs, math.inf)
        for w, x in pairs.values():
            F.linear(x, w)
        for _ in range(HALF_ROUNDS):
            for dt, (w, x) in pairs.items():
                t = time.perf_counter()
                for _ in range(4):
                    F.linear(x, w)
                took[dt] = min(took[dt], time.perf_counter() - t)
        fast = took[torch.float16] < HALF_MARGIN * took[torch.bfloat16]
        _HALF.append(torch.float16 if fast else torch.bfloat16)
    return _HALF[0]


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The f16 field at byte ``at`` of each block of b [..., block bytes] -> float32 [...]."""
    return b[..., at:at + 2].contiguous().view(torch.float16)[..., 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [..., n] -> [..., 2, n]: the low nibbles, then the high ones."""
    return torch.stack((qs & 15, qs >> 4), dim=-2)


def int4_parts(raw: torch.Tensor, ggml_type: int, rows: int, cols: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q4_1 / Q4_K matrix's bytes (uint8, rows x row bytes) -> (q uint8 [rows, cols],
    0..15; scale and zero float32 [rows, cols / 32]) with weight = (q - 8) * scale + zero."""
    q = qt.quant(ggml_type)
    b = raw.reshape(rows, cols // q.block_size, q.type_size)
    if ggml_type in (qt.Q4_0, qt.Q4_1):
        at = 2 if ggml_type == qt.Q4_0 else 4
        vals = _nibbles(b[..., at:at + 16])  # [rows, nb, 2, 16]: elements j, j + 16
        d = _f16(b, 0)
        zero = torch.zeros_like(d) if ggml_type == qt.Q4_0 else 8 * d + _f16(b, 2)
        return vals.reshape(rows, cols), d, zero
    if ggml_type != qt.Q4_K:
        raise ValueError(f"{qt.type_name(ggml_type)} has no int4 layout")
    d, dmin = _f16(b, 0), _f16(b, 2)
    s = b[..., 4:16].to(torch.int32)
    lo = torch.cat((s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)), -1)
    mins = torch.cat((s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)), -1)
    # qs: four runs of 32 bytes; run c holds sub-block 2c in its low nibbles, 2c + 1 in its high
    vals = _nibbles(b[..., 16:144].reshape(rows, -1, 4, 32))  # [rows, nb, 4, 2, 32]
    scale = d.unsqueeze(-1) * lo.float()  # [rows, nb, 8]
    zero = 8 * scale - dmin.unsqueeze(-1) * mins.float()
    return vals.reshape(rows, cols), scale.reshape(rows, -1), zero.reshape(rows, -1)


def pack_int4(raw: torch.Tensor, ggml_type: int, rows: int, cols: int, packed: torch.Tensor,
              pairs: torch.Tensor) -> None:
    """One expert matrix's file bytes -> ``packed`` (uint8 [rows, cols / 2], torch's int4 layout)
    and ``pairs`` (bf16 [cols / 32, rows, 2], scale and zero)."""
    q, scale, zero = int4_parts(raw, ggml_type, rows, cols)
    packed.copy_(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 1))
    pairs.copy_(torch.stack((scale.T, zero.T), -1))


@dataclass
class PackedExperts:
    """One expert tensor [n_expert, rows, cols] in a CPU layout ("int4" or "half"), in a span
    of host memory (module docstring). ``product(e, x)`` is expert e's x @ W.T."""

    name: str
    layout: str
    n_expert: int
    rows: int
    cols: int
    span: torch.Tensor  # uint8 [cpu bytes]

    def __post_init__(self) -> None:
        e, r, c = self.n_expert, self.rows, self.cols
        if self.layout == "int4":
            n = e * r * c // 2
            self.packed = self.span[:n].view(e, r, c // 2)
            self.pairs = self.span[n:n + e * r * c // 8].view(torch.bfloat16).view(
                e, c // CPU_GROUP, r, 2)
        elif self.layout == "half":
            self.dense = self.span[:e * r * c * 2].view(half_dtype()).view(e, r, c)
        else:
            raise ValueError(f"{self.name}: no CPU layout {self.layout!r}")

    def product(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """x [n, cols] -> float32 [n, rows]: expert e's matrix times x (16-bit inputs)."""
        if self.layout == "int4":
            xb = ops._as_dtype(x, torch.bfloat16)  # gate and up share one cast of x
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                xb, self.packed[e], CPU_GROUP, self.pairs[e]).float()
        w = self.dense[e]
        if w.dtype == torch.bfloat16:
            return F.linear(ops._as_dtype(x, torch.bfloat16), w).float()
        # f16: x's largest value brought to [1/16, 1/8) by a power of two (exact both ways),
        # so that x and the sums stay inside f16's range (65504)
        top = float(x.abs().amax())
        if not 0 < top < math.inf:
            return x.float() @ w.float().T  # zeros (or a non-finite x): float32 as it is
        scale = 2.0 ** (-4 - math.ceil(math.log2(top)))
        y = F.linear((x * scale).to(torch.float16), w).float()
        if not bool(torch.isfinite(y).all()):
            return x.float() @ w.float().T  # overflowed even so: float32
        return y / scale

    def fill(self, raw: torch.Tensor, ggml_type: int, first: int) -> None:
        """Experts first, first + 1, ... from ``raw``, their file bytes (uint8, whole experts),
        into the span."""
        one = qt.tensor_nbytes(ggml_type, self.rows * self.cols)
        for j in range(raw.numel() // one):
            e, src = first + j, raw[j * one:(j + 1) * one]
            if self.layout == "int4":
                pack_int4(src, ggml_type, self.rows, self.cols, self.packed[e], self.pairs[e])
            else:
                dequantize_to(src, ggml_type, (self.cols, self.rows), self.dense.dtype,
                              out=self.dense[e])
                if self.dense.dtype == torch.float16 and not bool(
                        torch.isfinite(self.dense[e]).all()):
                    raise CarveError(
                        f"tensor {self.name}: expert {e} has weights beyond f16's range "
                        "(65504), which the CPU's f16 layout cannot hold; use --host-compute "
                        "gpu for this file")


def load_packed(model: Any, name: str, span: torch.Tensor,
                cancelled: Callable[[], bool] | None = None,
                check: Callable[[torch.Tensor], None] | None = None) -> int:
    """Read expert tensor ``name`` from the file into ``span`` in its CPU layout, LOAD_EXPERTS
    experts at a time (the only temporary: their file bytes), ``check`` (raising) on each run
    of file bytes first. Returns the file bytes read."""
    info = model.tensor(name)
    m = host_matrix(model, name, span)
    if not isinstance(m, PackedExperts):
        raise ValueError(f"{name}: {qt.type_name(info.ggml_type)} has no CPU layout")
    n_expert = m.n_expert
    one = info.nbytes // n_expert
    buf = torch.empty(min(LOAD_EXPERTS, n_expert) * one, dtype=torch.uint8)
    for first in range(0, n_expert, LOAD_EXPERTS):
        if cancelled is not None and cancelled():
            raise CarveError("load cancelled")
        n = min(LOAD_EXPERTS, n_expert - first)
        part = buf[:n * one]
        model.read_into(info, first * one, memoryview(part.numpy()))
        if check is not None:
            check(part)
        m.fill(part, info.ggml_type, first)
    return info.nbytes


def host_matrix(model: Any, name: str, span: torch.Tensor, scratch: torch.Tensor | None = None
                ) -> PackedExperts | ops.QExperts:
    """Expert tensor ``name`` of a host layer as its CPU layout holds it in ``span`` (the
    file's blocks, dequantized into ``scratch``, for a type without one)."""
    info = model.tensor(name)
    cols, rows, n_expert = (int(d) for d in info.shape)  # GGUF order
    layout = tensor_cpu_layout(name, info.ggml_type, (cols, rows, n_expert))
    if layout == "file":
        return ops.QExperts(name, span, info.ggml_type, n_expert, rows, cols, None, scratch)
    return PackedExperts(name, layout, n_expert, rows, cols, span)

"""A decode row's routed experts multiplied on the CPU straight from the file's blocks, by a
small C library (cpu_native.c) built once per machine with its C compiler (the one Triton
needs too) and loaded with ctypes (DESIGN.md "Experts in host memory").

torch has no CPU product over GGUF's blocks, so `cpu_experts` repacks the experts into layouts
it has (int4, or 16-bit floats for Q6_K: 2.4x the file's bytes) and runs one torch call per
product: three a routed expert, each waking the thread pool. This library takes a layer's
whole share of a row in one call (gate/up of every chosen expert shared among the threads,
then the down rows; x and the GLU's output quantized to int8 per 256 values as llama.cpp's CPU
does, each block summed in integers), reading Q4_K, Q5_K, Q6_K and Q8_0 blocks where they lie
(the host span the GPU reads in place), on rows and columns of whole 256s.

The library is built into ``$XDG_CACHE_HOME/carve/native/`` under a name from the source's
and the compiler command's hash (``-O3 -march=native -fopenmp``), so a changed source or a
different machine builds anew. ``CARVE_NATIVE=0`` leaves it unused. Where no compiler is found
or the build fails, `library` says why once in the log and returns None: the caller keeps
torch's path (`ops.experts` on the CPU layouts).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch

from engine.gguf.demo import cache_dir
from spec import quant_types as qt

log = logging.getLogger("carve.engine")

SOURCE = Path(__file__).with_name("cpu_native.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# the types the library multiplies (ggml's numbers, as cpu_native.c's enum)
TYPES = frozenset({qt.Q4_K, qt.Q5_K, qt.Q6_K, qt.Q8_0})
ACTS = {"silu": 0, "gelu": 1}



def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def build(out_dir: Path | None = None) -> Path:
    """The library's path, compiled into ``out_dir`` (default the cache) unless a build of
    this source with this compiler and flags is there. Raises RuntimeError with the
    compiler's message where it fails."""
    cc = _compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (cc, gcc or clang; or set CC)")
    src = SOURCE.read_bytes()
    key = hashlib.sha256(src + "\0".join([cc, *FLAGS]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir() / "native"
    path = out_dir / f"carve_experts_{key}.so"
    if path.exists():
        return path
    out_dir.mkdir(parents=True, exist_ok=True)
    # built beside its final name, then renamed: a concurrent build never loads half a file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        run = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                             text=True, timeout=120)
        if run.returncode != 0:
            raise RuntimeError(f"{Path(cc).name} failed: " +
                               (run.stderr.strip().splitlines() or ["(no message)"])[-1])
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


@functools.cache
def library() -> Any | None:
    """The loaded library, or None where ``CARVE_NATIVE=0``, no compiler is found or the
    build fails (said once in the log). Built and loaded once per process."""
    if os.environ.get("CARVE_NATIVE", "1").strip() == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("host experts: the CPU's native expert kernel is not available (%s); "
                    "torch's path is used instead", e)
        return None
    lib.carve_experts.restype = ctypes.c_int
    lib.carve_experts.argtypes = (
        [ctypes.c_int] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_void_p, ctypes.c_int] * 3
        + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int])
    lib.carve_scratch_bytes.restype = ctypes.c_size_t
    lib.carve_scratch_bytes.argtypes = [ctypes.c_int] * 3
    return lib


def supported(types: tuple[int, int, int], act: str, n_embd: int, n_ff: int,
              clamped: bool = False, biases: bool = False) -> bool:
    """Whether the library multiplies experts of these (gate, up, down) types and sizes with
    this activation: its types, widths of whole 256s (x is quantized per 256, as cpu_native.c's
    ``block_ok`` checks); gpt-oss's clamped SwiGLU and expert biases not."""
    return (all(t in TYPES for t in types) and act in ACTS and not clamped and not biases
            and n_embd % 256 == 0 and n_ff % 256 == 0)


class NativeExperts:
    """One layer's routed experts as the library reads them: the file's bytes of gate, up and
    down ([n_expert * rows, row bytes] uint8 host tensors) and their types; ``run`` computes
    a row's share into y. Holds its scratch, so a layer's calls allocate nothing."""

    def __init__(self, lib: Any, mats: list[torch.Tensor], types: tuple[int, int, int],
                 n_embd: int, n_ff: int, n_expert: int, k: int, act: str) -> None:
        if not supported(types, act, n_embd, n_ff):
            raise ValueError(f"native experts: types {types} / {act} not multiplied")
        if not all(m.is_contiguous() for m in mats):
            raise ValueError("native experts: the expert bytes must be contiguous")
        self.lib, self.mats, self.types = lib, mats, types
        self.n_embd, self.n_ff, self.n_expert, self.act = n_embd, n_ff, n_expert, ACTS[act]
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
        rc = self.lib.carve_experts(
            self.n_embd, self.n_ff, self.n_expert, c, x.data_ptr(), ids.data_ptr(), w.data_ptr(),
            g.data_ptr(), self.types[0], u.data_ptr(), self.types[1], d.data_ptr(),
            self.types[2], self.act, self.scratch.data_ptr(), y.data_ptr(),
            threads or torch.get_num_threads())
        if rc != 0:
            raise ValueError("native experts: " + ("an expert id beyond the layer's "
                             f"{self.n_expert}" if rc == -2 else "types or sizes refused"))

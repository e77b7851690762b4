"""The host CPU's native expert kernel (native_experts.c): built once per machine with its C
compiler (the one Triton needs too) and loaded with ctypes (DESIGN.md "Experts in host
memory"). This half needs no torch, so that a plan can ask whether this machine has the kernel
(`available`) and which layers it multiplies (`supported`): a host layer it covers needs no
CPU layout beside the file's bytes. engine/runtime/models/cpu_native.py runs it on tensors.

The library is built into ``$XDG_CACHE_HOME/carve/native/`` under a name from the source's
and the compiler command's hash (``-O3 -march=native -fopenmp``), so a changed source or a
different machine builds anew; concurrent builds are safe (each under a temporary name,
renamed). ``CARVE_NATIVE=0`` leaves it unused. Where no compiler is found or the build fails,
`library` says why once in the log and returns None.
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
import threading
from pathlib import Path
from typing import Any

from engine.gguf.demo import cache_dir
from spec import quant_types as qt

log = logging.getLogger("carve.engine")

SOURCE = Path(__file__).with_name("native_experts.c")
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
# the types the library multiplies (ggml's numbers, as native_experts.c's enum)
TYPES = frozenset({qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1, qt.Q8_0, qt.Q2_K, qt.Q3_K, qt.Q4_K,
                   qt.Q5_K, qt.Q6_K, qt.IQ1_S, qt.IQ1_M, qt.IQ2_XXS, qt.IQ2_XS, qt.IQ2_S,
                   qt.IQ3_XXS, qt.IQ3_S, qt.IQ4_XS, qt.IQ4_NL, qt.MXFP4})
# the types of 32-value blocks: where every matrix has one, x is quantized per 32, else per 256
SMALL_BLOCKS = frozenset({qt.Q4_0, qt.Q4_1, qt.Q5_0, qt.Q5_1, qt.Q8_0, qt.IQ4_NL, qt.MXFP4})
# the activations (native_experts.c's act; 2: gpt-oss's clamped SwiGLU, given a limit)
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


def disabled() -> bool:
    """``CARVE_NATIVE=0``: the user turned the kernel off."""
    return os.environ.get("CARVE_NATIVE", "1").strip() == "0"


_LOCK = threading.Lock()  # one build and load per process, whichever thread asks first


def _load() -> tuple[Any | None, str]:
    with _LOCK:
        return _load_once()


@functools.cache
def _load_once() -> tuple[Any | None, str]:
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("host experts: the CPU's native expert kernel is not available (%s); "
                    "torch's path is used instead", e)
        return None, str(e)
    lib.carve_experts.restype = ctypes.c_int
    lib.carve_experts.argtypes = (
        [ctypes.c_int] * 4 + [ctypes.c_void_p] * 3 + [ctypes.c_void_p, ctypes.c_int] * 3
        + [ctypes.c_int, ctypes.c_float] + [ctypes.c_void_p] * 5 + [ctypes.c_int])
    # the 4-bit types' values (MXFP4's e2m1, doubled; IQ4_NL's and IQ4_XS's non-linear
    # ones) and the IQ1 / IQ2 / IQ3 grids and sign bytes, from the gguf package's tables
    import numpy as np
    from gguf.quants import IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, MXFP4

    lib.carve_set_values.restype = ctypes.c_int
    lib.carve_set_values.argtypes = [ctypes.c_int, ctypes.c_char_p]
    for t, values in ((qt.MXFP4, MXFP4.kvalues), (qt.IQ4_NL, IQ4_NL.kvalues)):
        if lib.carve_set_values(int(t), bytes(v & 0xFF for v in values)) != 0:
            return None, f"the native kernel took no table for {qt.type_name(t)}"
    lib.carve_set_grid.restype = ctypes.c_int
    lib.carve_set_grid.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p]
    for t, cls in ((qt.IQ2_XXS, IQ2_XXS), (qt.IQ2_XS, IQ2_XS), (qt.IQ2_S, IQ2_S),
                   (qt.IQ3_XXS, IQ3_XXS), (qt.IQ3_S, IQ3_S)):
        cls.init_grid()
        grid = np.ascontiguousarray(cls.grid, dtype=np.float32).astype(np.uint8).tobytes()
        if lib.carve_set_grid(int(t), grid, bytes(IQ2_XXS.ksigns)) != 0:
            return None, f"the native kernel took no grid for {qt.type_name(t)}"
    IQ1_S.init_grid()  # -1, 0, 1, held plus one (IQ1_M's grid is the same)
    grid = (np.ascontiguousarray(IQ1_S.grid, dtype=np.float32) + 1).astype(np.uint8).tobytes()
    if lib.carve_set_grid(int(qt.IQ1_S), grid, bytes(IQ2_XXS.ksigns)) != 0:
        return None, "the native kernel took no grid for IQ1_S"
    lib.carve_scratch_bytes.restype = ctypes.c_size_t
    lib.carve_scratch_bytes.argtypes = [ctypes.c_int] * 3
    lib.carve_serve.restype = ctypes.c_int
    lib.carve_serve.argtypes = [ctypes.POINTER(ServeLayer), ctypes.c_int, ctypes.c_int,
                                ctypes.c_double, ctypes.POINTER(ctypes.c_double),
                                ctypes.POINTER(ctypes.c_int)]
    return lib, ""


_P, _I, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class ServeLayer(ctypes.Structure):
    """native_experts.c's carve_serve_layer: one split layer a decode step answers (the
    stage's ticket words and transfer buffers, its CPU share, its experts and scratch)."""

    _fields_ = [("flags", _P), ("x", _P), ("x_type", _I), ("ids", _P), ("w", _P), ("y", _P),
                ("xf", _P), ("c", _I), ("n_embd", _I), ("n_ff", _I), ("n_expert", _I),
                ("act", _I), ("limit", _F), ("gate", _P), ("up", _P), ("down", _P),
                ("gate_type", _I), ("up_type", _I), ("down_type", _I), ("gate_b", _P),
                ("up_b", _P), ("down_b", _P), ("scratch", _P)]


# carve_serve's x_type by the published row's dtype name
ROW_TYPES = {"float32": 0, "float16": 1, "bfloat16": 2}


def library() -> Any | None:
    """The loaded library, or None where ``CARVE_NATIVE=0``, no compiler is found or the
    build fails (said once in the log). Built and loaded once per process."""
    return None if disabled() else _load()[0]


def prebuild() -> threading.Thread:
    """Build and load the library in a background thread (the window does at start), so that
    the first plan that asks `available` does not wait for the compiler (~1 s)."""
    t = threading.Thread(target=library, name="carve-native-build", daemon=True)
    t.start()
    return t


def available() -> bool:
    """Whether this machine runs the kernel (building it on first ask): what a plan priced
    here assumes of the host it pins experts on."""
    return library() is not None


def why_not() -> str:
    """Why the kernel is not available ("" where it is)."""
    return "CARVE_NATIVE=0" if disabled() else _load()[1]


def group(types: tuple[int, ...]) -> int:
    """The values per scale x is quantized in for these (gate, up, down) types: 32 where every
    one has blocks of 32 (Q4_0 to Q5_1, Q8_0, IQ4_NL, MXFP4), else 256 (a super-block of the
    others)."""
    return 32 if all(t in SMALL_BLOCKS for t in types) else 256


def supported(types: tuple[int, ...], act: str, n_embd: int, n_ff: int) -> bool:
    """Whether the library multiplies experts of these (gate, up, down) types and sizes with
    this activation (SiLU or GELU; gpt-oss's clamped SwiGLU and its expert biases too): its
    types, widths of whole quantization groups of x (`group`, as native_experts.c's
    ``block_ok`` checks)."""
    g = group(types)
    return (len(types) == 3 and all(t in TYPES for t in types) and act in ACTS
            and n_embd % g == 0 and n_ff % g == 0)

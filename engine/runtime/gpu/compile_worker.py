"""The compile workers of a load's precompile (engine/runtime/gpu/precompile.py): what runs in
the worker processes, and their server. Workers fork from a forkserver that imported torch,
Triton, the kernels and the engine's main module once, so neither the server nor a worker has
CUDA; a worker compiles a variant the JIT's hook recorded, for its stated target, into Triton's
cache folder (`build`), and where Triton builds a C launcher per kernel signature it builds
that too (`build_launcher`). The engine then loads them from the folder under the same keys.
"""

from __future__ import annotations

import importlib
import json
import logging
import multiprocessing
import sys
import threading
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from typing import Any

log = logging.getLogger("carve.engine")

# each worker runs the main module's body again by name, as multiprocessing does, after the
# server preloaded it (_preload): runpy then warns, once a worker, that the module was already
# imported. That is intended here; the server imports this module first, so that its workers
# inherit this filter
warnings.filterwarnings("ignore", message=r".* found in sys\.modules after import of package ",
                        category=RuntimeWarning)


def failure(data: str, exc: BaseException) -> str:
    """One line naming the variant's kernel and what went wrong compiling it."""
    name = json.loads(data).get("name", "?") if data.startswith("{") else "?"
    return f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _source(module: str, name: str, data: str, target: tuple) -> tuple[Any, Any, Any]:
    """(Triton's source of the variant, its target, its options) rebuilt from what the JIT's
    hook recorded, as its ``preload`` rebuilds them."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, convert_to_tuple_if_list

    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not isinstance(obj, JITFunction) and hasattr(obj, "fn"):  # autotuner, heuristics
        obj = obj.fn
    spec = json.loads(data)

    def constant(value: Any) -> Any:
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(convert_to_tuple_if_list(value["constexpr"]))
        if isinstance(value, dict):
            raise ValueError(f"a constant this worker cannot rebuild: {value}")
        return convert_to_tuple_if_list(value)

    constexprs = {tuple(k): constant(v)
                  for k, v in zip(spec["constant_keys"], spec["constant_vals"], strict=True)}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"], strict=True)}
    signature = {k: convert_to_tuple_if_list(v) for k, v in spec["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    gpu = GPUTarget(*target)
    return ASTSource(obj, signature, constexprs, attrs), gpu, make_backend(gpu).parse_options(
        options)


def build(module: str, name: str, data: str, target: tuple) -> str | None:
    """In a worker process: compile one variant into Triton's cache folder exactly as the JIT's
    ``preload`` would (the same source, signature, constants, attributes and options, so the
    same cache key) but for a stated target, so no GPU is touched here; the error's text when
    it fails. The loading thread then finds it in the folder."""
    try:
        from triton.compiler.compiler import compile

        src, gpu, options = _source(module, name, data, target)
        compile(src, target=gpu, options=options.__dict__)
        return None
    except Exception as exc:  # noqa: BLE001 - the loading thread compiles it instead
        return failure(data, exc)


def c_launchers() -> bool:
    """Whether this Triton builds a C launcher per kernel signature (gcc, about a second, at
    the kernel's first launch, on the launching thread): Triton 3.6 does, later ones have one
    launcher for every kernel."""
    try:
        from triton.backends.nvidia import driver as nvidia
    except ImportError:
        return False
    return hasattr(nvidia, "make_launcher") and hasattr(nvidia, "compile_module_from_src")


def build_launcher(module: str, name: str, data: str, target: tuple) -> str | None:
    """In a worker process: build the variant's C launcher into Triton's cache folder (it
    depends on the signature and constants alone, so it builds beside the kernel's compile),
    where the kernel's first launch then finds it; the error's text when it fails (the
    launch builds it then, as always)."""
    try:
        from types import SimpleNamespace

        from triton.backends.nvidia import driver as nvidia

        src = _source(module, name, data, target)[0]
        nvidia.CudaLauncher(src, SimpleNamespace(  # what the launcher reads of the metadata
            tensordesc_meta=None, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
            profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
            launch_pdl=False))
        return None
    except Exception as exc:  # noqa: BLE001 - the first launch builds it instead
        return failure(data, exc)


def timed_build(module: str, name: str, data: str, target: tuple) -> tuple[str | None, float]:
    """`build`, and the seconds it took in the worker."""
    t0 = time.perf_counter()
    return build(module, name, data, target), time.perf_counter() - t0


def _preload() -> list[str]:
    """What the workers' server imports once: torch, Triton's compiler and NVIDIA backend, the
    kernels this process has imported, and this process's main module by name (each worker
    runs that module's body again, as multiprocessing does; its imports are then done)."""
    main = getattr(getattr(sys.modules.get("__main__"), "__spec__", None), "name", None)
    return [__name__, "torch", "triton", "triton.compiler.compiler",
            "triton.backends.nvidia.compiler",
            "triton.backends.nvidia.driver",
            *sorted(n for n in list(sys.modules) if n.startswith("carve_kernels.")),
            *([main] if main and not main.endswith("__main__") else [])]


def start_server() -> bool:
    """Start the workers' server (a fresh interpreter that imports _preload() once; workers
    fork from it, so neither has CUDA). Returns at once: the server imports in the
    background."""
    try:
        from multiprocessing import forkserver

        multiprocessing.get_context("forkserver").set_forkserver_preload(_preload())
        forkserver.ensure_running()
        return True
    except (OSError, ValueError, RuntimeError) as exc:
        log.warning("kernel compile workers did not start (%s): compiling on threads", exc)
        return False


def workers(n: int) -> ProcessPoolExecutor | None:
    """``n`` worker processes forked from the server; None where that cannot start (the
    threads then compile)."""
    if not start_server():
        return None
    return ProcessPoolExecutor(n, mp_context=multiprocessing.get_context("forkserver"))


def stop_server(wait: bool = True) -> None:
    """The server outlives its pool, holding torch in memory: stop it (it is started again if
    another load needs workers). Stopping waits for the server to finish its imports, so a
    server started for nothing (a warm cache) is stopped on a thread (``wait`` False). A
    private call: without it the server stays until this process ends."""
    if not wait:
        threading.Thread(target=stop_server, name="carve-compile-stop", daemon=True).start()
        return
    try:
        from multiprocessing import forkserver

        stop = getattr(forkserver._forkserver, "_stop", None)
        if stop is not None:
            stop()
    except Exception as exc:  # noqa: BLE001 - an idle process left behind, nothing worse
        log.debug("stopping the compile workers' server: %s", exc)

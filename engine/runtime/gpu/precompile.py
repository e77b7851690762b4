"""Compile the Triton kernels a load's warm-up needs on several threads before it runs them.

With a cold kernel cache the warm-up compiles each kernel variant the plan uses where it first
launches it, one after another (about 2 s each on a workstation core; 32 variants for a 7B
Q4_K_M file). Here a dry pass runs the warm-up's steps with Triton's JIT cache hook declining
every compile: the variant is recorded, neither compiled nor launched. The stages' working
buffers are zeroed before the dry pass and after it, so a kernel that is already compiled (and
so does run) reads ids and counts of zero, in range, where a skipped kernel would have written
them. The recorded variants then compile on a pool of threads (Triton releases the GIL while
LLVM and ptxas run) into the JIT's own cache and Triton's cache folder, and the real warm-up
finds them there. Anything this cannot do (a Triton without the hook, a variant that fails to
compile here) is left to the warm-up, which compiles it as before: this only saves time. When
the first variant turns out to be in Triton's cache folder already (every launch after the
first), the dry pass stops there and the warm-up loads the kernels from the folder as before.

``CARVE_COMPILE_THREADS``: the pool's size (default: the CPUs this process may use; 0 or 1
turns the dry pass off).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Any

import torch

from spec.errors import CarveError

log = logging.getLogger("carve.engine")


def threads(env: dict[str, str] | None = None) -> int:
    """The pool's size: CARVE_COMPILE_THREADS, else the CPUs this process may run on."""
    env = os.environ if env is None else env
    text = env.get("CARVE_COMPILE_THREADS", "").strip()
    if text:
        try:
            return max(0, int(text))
        except ValueError:
            log.warning("CARVE_COMPILE_THREADS=%r is not a whole number: using the CPU count",
                        text)
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _runtime_knobs() -> Any | None:
    """Triton's runtime knobs when they have the JIT cache hook (Triton 3.4 and later)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    rt = getattr(knobs, "runtime", None)
    return rt if rt is not None and hasattr(rt, "jit_cache_hook") else None


# a first variant that Triton's cache folder already holds loads in a few milliseconds; one
# that compiles takes a second or more
WARM_S = 0.25


class WarmCache(Exception):
    """The dry pass's first variant was in Triton's cache folder: the rest most likely are."""


class Recorder:
    """The JIT cache hook of the dry pass: records each variant a launch would compile and
    declines the compile (Triton then neither compiles nor launches it). The first variant is
    compiled on the spot instead: when that takes under WARM_S (Triton's cache folder had it,
    as on every launch after the first) the dry pass stops (WarmCache), and the warm-up loads
    the rest from the folder as it always did."""

    def __init__(self) -> None:
        self.variants: dict[tuple, tuple[Any, str, Any]] = {}
        self.first_s: float | None = None

    def __call__(self, *, key: Any = None, fn: Any = None, compile: dict | None = None,
                 **_: Any) -> bool:
        jit = getattr(fn, "jit_function", None)
        data = (compile or {}).get("specialization_data")
        if jit is None or data is None:
            return False  # not what this Triton's hook gives: let it compile as usual
        device = (compile or {}).get("device")
        variant = (jit, data, device)
        if self.first_s is None:
            t0 = time.perf_counter()
            failed = _compile(variant, hooked=True)
            self.first_s = time.perf_counter() - t0
            if failed is None and self.first_s < WARM_S:
                raise WarmCache
            if failed is None:
                return True  # compiled: in the JIT's cache now
        self.variants.setdefault((id(jit), str(key), device), variant)
        return True


def _compile(variant: tuple[Any, str, Any], hooked: bool = False) -> str | None:
    """Compile one recorded variant into its JIT's cache; the error's text when it fails.
    ``hooked``: called from within the hook (which Triton's compile would call again)."""
    jit, data, device = variant
    rt = _runtime_knobs() if hooked else None
    hook = rt.jit_cache_hook if rt is not None else None
    try:
        if rt is not None:
            rt.jit_cache_hook = None
        if isinstance(device, int) and torch.cuda.is_available():
            torch.cuda.set_device(device)  # the thread's current device: the JIT's cache key
        jit.preload(data)
        return None
    except Exception as exc:  # noqa: BLE001 - the warm-up compiles it instead, as before
        name = json.loads(data).get("name", "?") if data.startswith("{") else "?"
        return f"{name}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    finally:
        if rt is not None:
            rt.jit_cache_hook = hook


def precompile(steps: Iterable[Callable[[], None]], clear: Callable[[], None],
               sync: Callable[[], None], n_threads: int | None = None,
               on_compiled: Callable[[int, int], None] | None = None,
               cancelled: Callable[[], bool] | None = None) -> dict:
    """Run ``steps`` as a dry pass (``clear`` zeroes the working buffers before and after,
    ``sync`` waits for the devices), then compile what they would have compiled on
    ``n_threads`` threads, calling ``on_compiled(done, total)`` before the first and as each
    finishes. ``cancelled()`` true between two of them: the variants not started are dropped
    and CarveError("load cancelled") raised once the running ones end (a compile cannot be
    interrupted). Returns what it did: variants recorded, compiled, failed, seconds
    (``{"variants": 0}`` when it did not run)."""
    n = threads() if n_threads is None else n_threads
    rt = _runtime_knobs()
    if rt is None or n <= 1:
        return {"variants": 0}
    t0 = time.perf_counter()
    rec = Recorder()
    warm = False
    previous = rt.jit_cache_hook
    clear()
    rt.jit_cache_hook = rec
    try:
        for step in steps:
            try:
                step()
            except WarmCache:
                warm = True
                break
            except Exception as exc:  # noqa: BLE001 - skipped kernels leave garbage behind;
                # the real warm-up runs every step again and compiles what this one missed
                log.debug("precompile dry pass: a step stopped early: %s", exc)
    finally:
        rt.jit_cache_hook = previous
        sync()
        clear()
    dry = time.perf_counter() - t0
    variants = list(rec.variants.values())
    errors: list[str] = []
    if variants:
        if on_compiled is not None:
            on_compiled(0, len(variants))
        with ThreadPoolExecutor(min(n, len(variants)), thread_name_prefix="carve-compile") as ex:
            futures = [ex.submit(_compile, v) for v in variants]
            for done, f in enumerate(as_completed(futures), 1):
                if f.result():
                    errors.append(f.result())
                if on_compiled is not None:
                    on_compiled(done, len(variants))
                if cancelled is not None and cancelled():
                    ex.shutdown(wait=True, cancel_futures=True)
                    raise CarveError("load cancelled")
    for e in errors[:5]:
        log.warning("precompiling a kernel failed (the warm-up compiles it instead): %s", e)
    out = {"variants": len(variants), "compiled": len(variants) - len(errors),
           "failed": len(errors), "threads": min(n, max(1, len(variants))),
           "warm": warm, "first_s": round(rec.first_s or 0.0, 3), "dry_s": round(dry, 3),
           "s": round(time.perf_counter() - t0, 3)}
    if variants:
        log.info("precompiled %d of %d kernel variants on %d threads in %.1f s",
                 out["compiled"], out["variants"], out["threads"], out["s"])
    return out

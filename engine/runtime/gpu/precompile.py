"""Compile the Triton kernels a load needs on every core, before the load runs them.

With a cold kernel cache a load compiles each kernel variant the plan uses where it first
launches it, one after another (1-6 s each; 35 variants for a 7B Q4_K_M file: the
dequant-cache fill's and the warm-up's). Here the load's kernel-launching work runs in rounds,
each first as a dry pass with Triton's JIT cache hook declining every compile: the variant is
recorded, neither compiled nor launched. In a process that has compiled none of our kernels
(`fresh`), the fills' and the warm-up's dry passes are one round; else each fill gets its own,
then the warm-up. The recorded variants compile in worker processes (gpu/compile_worker.py)
into Triton's cache folder, each as soon as the dry pass records it; as each one is done, a
thread of this process loads it from the folder into the JIT's own cache, and the real work
then finds every variant compiled. A variant a worker cannot compile (its kernel not reachable
by name, a worker lost) compiles on those threads instead (Triton releases the GIL for part of
a compile).

What a dry pass may run: a kernel compiled before it launches as usual. The warm-up's round
zeroes the stage's working buffers before and after its dry pass, so such a kernel reads ids
and counts of zero, in range, where a skipped one would have written them; the fill's dry pass
moves no byte into a weight span (`GpuStage.fill_dequant_cache(dry=True)`). Anything this
cannot do (a Triton without the hook, a variant that fails to compile here) is left to the
real work, which compiles it as before: this only saves time. The first variant of a load is
compiled on the spot: when that wrote nothing into Triton's cache folder, the folder had it
(every launch after the first), so no round runs at all and the load reads its kernels from
the folder.

``CARVE_COMPILE_THREADS``: how many variants compile at once (default: the CPUs this process
may use; 0 or 1 turns the rounds off).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import (
    FIRST_COMPLETED,
    Future,
    ProcessPoolExecutor,
    ThreadPoolExecutor,
    wait,
)
from typing import Any

import torch

from engine.runtime.gpu import compile_worker as worker
from spec.errors import CarveError

log = logging.getLogger("carve.engine")


def threads(env: dict[str, str] | None = None) -> int:
    """How many compile at once: CARVE_COMPILE_THREADS, else the CPUs this process may use."""
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


# where Triton's cache folder cannot be listed: a first variant that the folder holds loads in
# a few milliseconds, one that compiles takes a second or more (the process's first compile
# also pays Triton's own start, which is why the folder is asked first)
WARM_S = 0.25


def _entries() -> frozenset[str] | None:
    """The names in Triton's cache folder (one per compiled kernel or launcher), an empty set
    when there is none yet; None when it cannot be listed (a remote cache, an old Triton)."""
    try:
        from triton import knobs

        folder = knobs.cache.dir
    except (ImportError, AttributeError):
        return None
    try:
        return frozenset(os.listdir(folder)) if folder and os.path.isdir(folder) else frozenset()
    except OSError:
        return None


class WarmCache(Exception):
    """The load's first variant was in Triton's cache folder: the rest most likely are."""


Variant = tuple[Any, str, Any]  # (JITFunction, its specialization data, device)


def _compile(variant: Variant, hooked: bool = False) -> str | None:
    """Compile one recorded variant into its JIT's cache in this process (from Triton's cache
    folder when a worker put it there); the error's text when it fails. ``hooked``: called
    from within the hook (which Triton's compile would call again)."""
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
    except Exception as exc:  # noqa: BLE001 - the real work compiles it instead, as before
        return worker.failure(data, exc)
    finally:
        if rt is not None:
            rt.jit_cache_hook = hook


def _timed(variant: Variant) -> tuple[str | None, float]:
    """_compile, and how long it took."""
    t0 = time.perf_counter()
    return _compile(variant), time.perf_counter() - t0


def _dump(job: tuple, seconds: float, failed: str | None) -> None:
    """CARVE_PRECOMPILE_DUMP=FILE: append what a worker compiled (module, kernel, its
    specialization data, target, seconds) as a JSON line, so the variants of a GPU machine's
    load can be compiled and timed again on any machine (`benchmarks/bench_compile.py`)."""
    path = os.environ.get("CARVE_PRECOMPILE_DUMP")
    if not path:
        return
    module, name, data, target = job
    try:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"module": module, "name": name, "data": data,
                                "target": list(target), "seconds": round(seconds, 3),
                                "failed": failed}) + "\n")
    except OSError as exc:
        log.warning("CARVE_PRECOMPILE_DUMP=%s: %s", path, exc)


def job(variant: Variant) -> tuple[str, str, str, tuple] | None:
    """What a worker process needs to compile ``variant``: the kernel's module and name, its
    specialization data and the GPU target; None when a worker could not find the kernel by
    name (one made inside a function) or this Triton keeps its target elsewhere."""
    jit, data, device = variant
    fn = getattr(jit, "fn", None)
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not name or "<" in name:
        return None
    try:
        target = jit.device_caches[device][2]
        return module, name, data, (target.backend, target.arch, target.warp_size)
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def fresh() -> bool:
    """No kernel of ``carve_kernels/`` is compiled in this process yet, so none would launch during
    a dry pass (the first load of an engine process): the dequant-cache fill's and the warm-up's
    dry passes can then run as one round before either runs for real, whose kernels would
    otherwise read weights not yet filled or repacked."""
    try:
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False
    for name, module in list(sys.modules.items()):
        if not name.startswith("carve_kernels."):
            continue
        for obj in list(vars(module).values()):
            while not isinstance(obj, JITFunction) and isinstance(getattr(obj, "fn", None),
                                                                   JITFunction):
                obj = obj.fn  # an autotuner or heuristics around it
            if isinstance(obj, JITFunction) and any(
                    c[0] for c in list(obj.device_caches.values())):
                return False
    return True


class Compiler:
    """One load's precompile, over the rounds of its work (`round`); `close` at the end of the
    load, whatever happens. ``on_compiled(done, total)``: before a round's first variant and as
    each one is ready; ``cancelled()`` true while a round waits: the variants not started are
    dropped and CarveError("load cancelled") raised (a compile under way cannot be stopped).
    ``report``: variants recorded, compiled, failed, seconds, over all rounds; "rebuilt": how
    many a worker compiled that this process compiled again (its cache key differed)."""

    def __init__(self, n: int | None = None,
                 on_compiled: Callable[[int, int], None] | None = None,
                 cancelled: Callable[[], bool] | None = None,
                 processes: bool = True) -> None:
        self.n = threads() if n is None else n
        self.rt = _runtime_knobs()
        self.on_compiled, self.cancelled, self.processes = on_compiled, cancelled, processes
        self.warm: bool | None = None  # unknown until the first variant is compiled on the spot
        self.first_s: float | None = None
        self.procs: ProcessPoolExecutor | None = None
        self.loaders: ThreadPoolExecutor | None = None
        self.report: dict = {"variants": 0}
        self._seen: set[tuple] = set()
        self._pending: dict[Future, Variant] = {}  # in a worker process
        self._jobs: dict[tuple, tuple] = {}  # (jit, data) -> what the worker was given
        self._side: list[Future] = []  # C launchers building in the workers (c_launchers())
        self._side_jobs: list[tuple] = []  # the round's launchers not yet submitted
        self.launchers = processes and worker.c_launchers()
        self._times: list[tuple[float, str]] = []  # (seconds in a worker, kernel)
        self._server = False  # the workers' server started (it outlives the workers)
        self._round: list[Variant] = []

    @property
    def active(self) -> bool:
        return self.rt is not None and self.n > 1 and not self.warm

    def summary(self) -> str:
        """The load timeline's words for what the rounds so far did."""
        r = self.report
        if self.warm:
            return "kernel cache warm"
        if not r["variants"]:
            return "kernels precompiled (none to compile)"
        how = f"{self.n} worker processes" if r.get("workers") else f"{self.n} threads"
        slow = r.get("slowest")
        # where the step's time went: the dry pass (the workers compile meanwhile; in it, the
        # first variant compiled on the spot, which pays Triton's start), then the wait for
        # the last variant and the C launchers
        return (f"kernels precompiled ({r['compiled']} of {r['variants']} variants, {how}, "
                f"dry pass {r.get('dry_s', 0.0):.1f} s (first compile "
                f"{r.get('first_s', 0.0):.1f} s), wait {r.get('wait_s', 0.0):.1f} s"
                + (f", slowest {slow[0][0]} {slow[0][1]:.1f} s" if slow else "")
                + (f", {r['rebuilt']} compiled again here" if r.get("rebuilt") else "") + ")")

    # --- the hook ------------------------------------------------------------------------------
    def __call__(self, *, key: Any = None, fn: Any = None, compile: dict | None = None,
                 **_: Any) -> bool:
        """Triton's JIT cache hook during a dry pass: record the variant and decline it."""
        jit = getattr(fn, "jit_function", None)
        data = (compile or {}).get("specialization_data")
        if jit is None or data is None:
            return False  # not what this Triton's hook gives: let it compile as usual
        device = (compile or {}).get("device")
        variant = (jit, data, device)
        if self.warm is None:
            # the workers' server imports while this compiles: ready when it was cold
            started = self.processes and job(variant) is not None and worker.start_server()
            self._server = started
            folder = _entries()
            t0 = time.perf_counter()
            failed = _compile(variant, hooked=True)
            self.first_s = time.perf_counter() - t0
            if failed is None and (self.first_s < WARM_S if folder is None else
                                   _entries() == folder):
                self.warm = True
                if started:
                    worker.stop_server(wait=False)
                    self._server = False
                raise WarmCache
            self.warm = False
            if failed is None:
                return True  # compiled: in the JIT's cache now
        seen = (id(jit), str(key), device)
        if seen not in self._seen:
            self._seen.add(seen)
            self._round.append(variant)
            self._submit(variant)
        return True

    def _submit(self, variant: Variant) -> None:
        """Start compiling ``variant`` in a worker process (the pool starts with the first)."""
        if not self.processes:
            return
        spec = job(variant)
        if spec is None:
            return
        if self.procs is None:
            self.procs = worker.workers(self.n)
            if self.procs is None:
                self.processes = False
                return
            self._server = True
        try:
            self._pending[self.procs.submit(worker.timed_build, *spec)] = variant
            self._jobs[variant[:2]] = spec
            if self.launchers:  # submitted after all the round's compiles (longer jobs)
                self._side_jobs.append(spec)
        except RuntimeError as exc:  # a broken pool: the threads compile the rest
            log.warning("kernel compile workers stopped (%s): compiling on threads", exc)
            self.processes = False

    # --- a round -------------------------------------------------------------------------------
    def round(self, steps: Iterable[Callable[[], None]], clear: Callable[[], None] | None = None,
              sync: Callable[[], None] | None = None) -> None:
        """Run ``steps`` as a dry pass (``clear`` zeroes the working buffers before and after,
        ``sync`` waits for the devices), then wait until what they would have compiled is in
        the JIT's cache."""
        if not self.active:
            return
        t0 = time.perf_counter()
        self._round = []
        previous = self.rt.jit_cache_hook
        if clear is not None:
            clear()
        self.rt.jit_cache_hook = self
        try:
            for step in steps:
                try:
                    step()
                except WarmCache:
                    break
                except Exception as exc:  # noqa: BLE001 - skipped kernels leave garbage
                    # behind; the real work runs every step again and compiles what this missed
                    log.debug("precompile dry pass: a step stopped early: %s", exc)
        finally:
            self.rt.jit_cache_hook = previous
            if sync is not None:
                sync()
            if clear is not None:
                clear()
        dry = time.perf_counter() - t0
        if self.procs is not None:
            try:
                self._side += [self.procs.submit(worker.build_launcher, *j)
                               for j in self._side_jobs]
            except RuntimeError as exc:  # a broken pool: the first launches build them
                log.debug("compile workers: %s", exc)
        self._side_jobs.clear()
        t1 = time.perf_counter()
        errors = self._finish(self._round)
        r = self.report
        r["rounds"] = r.get("rounds", 0) + 1
        r["variants"] += len(self._round)
        r["compiled"] = r.get("compiled", 0) + len(self._round) - len(errors)
        r["failed"] = r.get("failed", 0) + len(errors)
        r["threads"] = self.n
        r["workers"] = self.procs is not None
        r["warm"] = bool(self.warm)
        r["first_s"] = round(self.first_s or 0.0, 3)
        r["dry_s"] = round(r.get("dry_s", 0.0) + dry, 3)
        r["wait_s"] = round(r.get("wait_s", 0.0) + time.perf_counter() - t1, 3)
        r["s"] = round(r.get("s", 0.0) + time.perf_counter() - t0, 3)
        if self._times:
            r["slowest"] = [[name, round(sec, 2)] for sec, name in sorted(self._times)[-3:][::-1]]
        for e in errors[:5]:
            log.warning("precompiling a kernel failed (the load compiles it instead): %s", e)

    def _finish(self, variants: list[Variant]) -> list[str]:
        """Wait for the workers' variants and load each into the JIT's cache on a thread (one
        no worker compiled compiles there); the errors' texts."""
        if not variants:
            return []
        if self.loaders is None:
            self.loaders = ThreadPoolExecutor(self.n, thread_name_prefix="carve-compile")
        total, done, errors = len(variants), 0, []
        if self.on_compiled is not None:
            self.on_compiled(0, total)
        in_workers = {v[:2] for v in self._pending.values()}
        loading: dict[Future, Variant] = {
            self.loaders.submit(_timed, v): v for v in variants if v[:2] not in in_workers}
        built: set[Future] = set()  # loads of what a worker compiled: from the folder
        while self._pending or loading:
            ready, _ = wait([*self._pending, *loading], timeout=0.25, return_when=FIRST_COMPLETED)
            for f in ready:
                if f in self._pending:
                    v = self._pending.pop(f)
                    failed = f.exception()
                    if failed is None:
                        failed, seconds = f.result()
                        self._times.append((seconds, self._jobs[v[:2]][1]))
                        _dump(self._jobs[v[:2]], seconds, failed)
                    if failed:
                        log.debug("a compile worker failed on %s (this process compiles it)",
                                  failed)
                    load = self.loaders.submit(_timed, v)
                    loading[load] = v
                    if not failed:
                        built.add(load)
                else:
                    loading.pop(f)
                    err, seconds = f.result()
                    if err:
                        errors.append(err)
                    elif f in built and seconds >= WARM_S:  # the folder lacked its key
                        self.report["rebuilt"] = self.report.get("rebuilt", 0) + 1
                    done += 1
                    if self.on_compiled is not None:
                        self.on_compiled(done, total)
            if self.cancelled is not None and self.cancelled():
                self.close(cancel=True)
                raise CarveError("load cancelled")
        for f in self._side:  # a launcher that failed is built at its kernel's first launch
            if f.exception() is None and f.result():
                log.debug("a compile worker could not build a launcher: %s", f.result())
        self._side.clear()
        return errors

    def close(self, cancel: bool = False) -> None:
        """End the workers and threads (``cancel``: drop what has not started)."""
        self._pending.clear()
        self._side.clear()
        if self.procs is not None:
            self.procs.shutdown(wait=not cancel, cancel_futures=True)
            self.procs = None
        if self._server:
            self._server = False
            worker.stop_server()
        if self.loaders is not None:
            self.loaders.shutdown(wait=True, cancel_futures=True)
            self.loaders = None

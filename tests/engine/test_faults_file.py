"""A model file truncated, replaced or deleted after it was planned, or while it loads: one
sentence (CarveError), never a crash. A truncation under a memory-mapped read would end the
process with SIGBUS; the loaders read with pread, so it is a short read and an error."""

from __future__ import annotations

import os
import shutil

import pytest

from spec.errors import CarveError


@pytest.fixture
def planned(synth_model, tmp_path):
    """A copy of the tiny model and a CPU plan made from it."""
    from app.cli_chat import build_plan

    path = tmp_path / "m.gguf"
    shutil.copy(synth_model("llama"), path)
    return path, build_plan(path, "cpu", 128, "f16")


def _load(plan, on_progress=None):
    from engine.runtime.session import Session

    return Session.load(plan, on_progress=on_progress)


def test_truncated_during_the_load_is_an_error_not_sigbus(planned):
    path, plan = planned
    size = path.stat().st_size

    def cut(stage, done, total, rate):
        if stage == "weights" and path.stat().st_size == size:
            os.truncate(path, size // 2)  # under the loader's feet, its file shrinks

    with pytest.raises(CarveError, match=r"m\.gguf: the file is now \d+ bytes, shorter than"):
        _load(plan, cut)


def test_deleted_or_replaced_during_the_load_loads_the_file_as_opened(planned, synth_model):
    path, plan = planned
    other = synth_model("qwen2")

    def swap(stage, done, total, rate):
        if stage == "weights" and path.exists():
            path.unlink()
            shutil.copy(other, path.with_suffix(".new"))
            os.replace(path.with_suffix(".new"), path)  # a different model now has the name

    session = _load(plan, swap)
    try:
        assert session.model.arch == "llama"
    finally:
        session.close()


@pytest.mark.parametrize(("change", "says"), [
    ("delete", r"m\.gguf: no such file"),
    ("truncate-header", r"m\.gguf: (truncated or corrupt GGUF header|header claims)"),
    ("truncate-data", r"m\.gguf: tensor .* beyond the end of the \d+-byte file"),
    ("garbage", r"m\.gguf: not a GGUF file"),
])
def test_changed_after_planning_is_one_sentence(planned, change, says):
    path, plan = planned
    if change == "delete":
        path.unlink()
    elif change == "truncate-header":
        os.truncate(path, 100)
    elif change == "truncate-data":
        os.truncate(path, path.stat().st_size - 4096)
    else:
        path.write_bytes(os.urandom(4096))
    with pytest.raises(CarveError, match=says) as err:
        _load(plan)
    assert "\n" not in str(err.value)


def test_read_into_refuses_bytes_outside_the_tensor(planned):
    from engine.gguf.reader import GGUFModel

    with GGUFModel.open(planned[0]) as model:
        t = model.tensors[0]
        buf = bytearray(t.nbytes)
        model.read_into(t, 0, memoryview(buf))
        assert bytes(buf) == model.tensor_data(t).tobytes()
        with pytest.raises(ValueError):
            model.read_into(t, 1, memoryview(buf))


def test_open_and_closed_models_leave_no_file_descriptors(planned):
    from engine.gguf.reader import GGUFModel

    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        GGUFModel.open(planned[0]).close()
        GGUFModel.open(planned[0])  # dropped without close: collected
    import gc

    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= before + 1

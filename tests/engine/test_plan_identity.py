"""A plan remembers the model file it was made for (size, time, a digest of the header); a
different file at the same path after planning is refused before anything is allocated, in one
sentence naming the file and what changed. The header is read with pread, so a file cut short
while its header is read is an error too, and loading never maps the file (no SIGBUS window)."""

from __future__ import annotations

import os
import shutil
import struct

import pytest

from engine.gguf import header
from engine.gguf.reader import GGUFModel
from engine.planning.plan import Plan
from spec.errors import CarveError


@pytest.fixture
def planned(synth_model, tmp_path):
    """A copy of the tiny model and a CPU plan made from it (carve chat's build_plan)."""
    from app.cli_chat import build_plan

    path = tmp_path / "m.gguf"
    shutil.copy(synth_model("llama"), path)
    return path, build_plan(path, "cpu", 128, "f16")


def _price(plan):
    from engine.planning.price import price

    return price(plan)  # opens plan.model as the engine does, before it allocates


def test_the_plan_keeps_the_files_identity_through_json(planned):
    path, plan = planned
    (stamp,) = plan.identity
    st = path.stat()
    assert (stamp.name, stamp.size, stamp.mtime_ns) == ("m.gguf", st.st_size, st.st_mtime_ns)
    assert len(stamp.header_sha256) == 64
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.identity == plan.identity
    old = plan.to_json()
    del old["identity"]  # a plan written before identities: loads, not checked
    assert Plan.from_json(old).identity == ()
    with pytest.raises(CarveError, match="plan: missing or malformed field"):
        Plan.from_json(plan.to_json() | {"identity": [{"name": "m.gguf"}]})


def test_split_sets_have_one_stamp_per_shard(synth_model):
    from engine.hardware.devices import cpu_spec
    from engine.planning.defaults import default_plan

    model = GGUFModel.open(synth_model("llama", split=3))
    plan = default_plan(model, [cpu_spec()])
    assert [s.name for s in plan.identity] == [p.name for p in model.paths]
    assert len({s.header_sha256 for s in plan.identity}) == 3


def test_another_model_at_the_path_is_refused_naming_the_file(planned, synth_model):
    path, plan = planned
    shutil.copy(synth_model("qwen2"), path)  # a different model now has the name
    with pytest.raises(CarveError) as err:
        _price(plan)
    msg = str(err.value)
    assert msg.startswith("m.gguf: the file changed since the plan was made ("), msg
    assert "bytes then," in msg and msg.endswith("re-plan (reopen the model)"), msg
    assert "\n" not in msg


def test_same_size_other_header_is_refused(planned):
    path, plan = planned
    data = bytearray(path.read_bytes())
    key = b"llama.attention.layer_norm_rms_epsilon"
    at = data.index(key) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 6  # an f32 value follows
    struct.pack_into("<f", data, at + 4, 1e-3)  # another model: same shapes, same size
    path.write_bytes(bytes(data))
    with pytest.raises(CarveError, match=r"^m\.gguf: the file changed since the plan was made "
                       r"\(its header.*differs.*\); re-plan \(reopen the model\)$"):
        _price(plan)


def test_a_copy_of_the_same_file_still_loads(planned):
    """Only the time changed (copied again, touched): everything the plan priced is the same."""
    path, plan = planned
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    os.utime(path, ns=(1, 1))
    assert _price(plan).devices  # priced, no error


def test_the_engine_refuses_before_allocating(planned, synth_model, monkeypatch):
    from engine.runtime import loader
    from engine.runtime.session import Session

    path, plan = planned
    shutil.copy(synth_model("qwen2"), path)
    allocs = []
    real = loader.RecordingAllocator.alloc
    monkeypatch.setattr(loader.RecordingAllocator, "alloc",
                        lambda self, *a, **k: allocs.append(a) or real(self, *a, **k))
    with pytest.raises(CarveError, match=r"^m\.gguf: the file changed since the plan was made"):
        Session.load(Plan.from_json(plan.to_json()))  # as the engine gets it
    assert allocs == []


def test_header_cut_short_while_it_is_read_is_an_error(planned, monkeypatch):
    """The header is read in pieces (here 4 KiB) with pread: a file truncated between two
    reads is a short read, one sentence, where a memory map would have died of SIGBUS."""
    path, _ = planned
    monkeypatch.setattr(header, "HEADER_READ", 4096)
    real = header.Header._pread

    def pread_then_cut(self, start, n):
        got = real(self, start, n)
        if start == 0:
            os.truncate(path, 4096 + 100)
        return got

    monkeypatch.setattr(header.Header, "_pread", pread_then_cut)
    with pytest.raises(CarveError, match=r"^.*m\.gguf: the file is now 4196 bytes, shorter than "
                       r"the \d+ it had when opened .*while its header was read"):
        GGUFModel.open(path)


def test_small_reads_parse_the_same_header(planned, monkeypatch):
    path, _ = planned
    whole = GGUFModel.open(path)
    monkeypatch.setattr(header, "HEADER_READ", 64)  # every entry runs past what was read
    pieces = GGUFModel.open(path)
    assert pieces.metadata == whole.metadata and pieces.tensors == whole.tensors
    assert pieces.stamps == whole.stamps


def _mappings(path) -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if line.rstrip().endswith(str(path)))


def test_opening_planning_and_loading_never_map_the_file(planned):
    """Nothing reads the file through a memory map (a page of a file cut short kills the
    process): the header by pread, the weights by pread, the scale checks on the copy."""
    from engine.runtime.session import Session

    path, plan = planned
    session = Session.load(plan)
    try:
        assert _mappings(path.resolve()) == 0
    finally:
        session.close()


def test_the_windows_plans_carry_the_identity(planned):
    from app.models.plan_model import PlanModel
    from engine.hardware.devices import cpu_spec

    path, _ = planned
    pm = PlanModel()
    pm.open_model(str(path))
    pm.set_devices([cpu_spec()])
    assert pm.plan().identity == GGUFModel.open(path).stamps


def _spans(model):
    import torch

    return {t.name: torch.zeros(t.nbytes, dtype=torch.uint8) for t in model.tensors}


def test_the_gpu_loader_reads_the_file_as_opened_and_a_cut_is_an_error(planned, synth_model):
    """engine/runtime/gpu/load.py (its CPU path, as the interpreter tests run it): a file
    renamed over after the model opened still loads as opened; one cut short while it loads is
    a CarveError naming it."""
    from engine.runtime.gpu.load import load_tensors

    path, _ = planned
    model = GGUFModel.open(path)
    names = [t.name for t in model.tensors]
    want = _spans(model)
    load_tensors(model, names, want, "cpu")
    shutil.copy(synth_model("qwen2"), path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)  # another model has the name now
    got = _spans(model)
    load_tensors(model, names, got, "cpu")
    assert all(bool((got[n] == want[n]).all()) for n in names)

    cut = GGUFModel.open(path)
    size = path.stat().st_size

    def shrink(stage, done, total, rate):
        if path.stat().st_size == size:
            os.truncate(path, cut.tensors[len(cut.tensors) // 2].offset)

    with pytest.raises(CarveError, match=r"m\.gguf: short read at byte \d+; the file is truncated"):
        load_tensors(cut, [t.name for t in cut.tensors], _spans(cut), "cpu", on_progress=shrink)

"""The loader executes the priced Layout: what it allocates is what price() said, byte for byte,
in every arena mode; weights land in their spans; progress and cancellation behave."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf.quants import dequantize as gguf_dequantize

from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.runtime.loader import RecordingAllocator, load_layout
from engine.runtime.session import Session
from spec.errors import CarveError

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)

pytestmark = pytest.mark.usefixtures("one_torch_thread")



def _plan(path, **kw) -> Plan:
    model = GGUFModel.open(path)
    from engine.gguf.hparams import HParams

    n = HParams.from_model(model).n_layer
    base = {"model": str(path), "devices": (CPU,), "split": (0, n), "ctx": 256,
            "prefill_chunk": 32, "cache_reserve": 0}
    base.update(kw)
    return Plan(**base)


@pytest.mark.parametrize("arena", ["packed", "per-tensor", "chunked:1"])
@pytest.mark.parametrize("cache", ["all", "none"])
def test_allocations_equal_layout_byte_for_byte(synth_model, arena: str, cache: str) -> None:
    path = synth_model("gemma3")
    plan = _plan(path, arena=arena, cache_reserve=0 if cache == "all" else 8 * GIB)
    model = GGUFModel.open(path)
    layout = price(plan, model)
    alloc = RecordingAllocator()
    stages = load_layout(layout, model, alloc)
    dl = layout.devices[0]
    want = [("cpu", a.name, a.nbytes) for a in dl.arenas]
    assert [(r.device, r.arena, r.nbytes) for r in alloc.records] == want
    assert sum(r.nbytes for r in alloc.records) == dl.allocated
    assert alloc.live_bytes == dl.allocated
    has_dq = any(a.purpose == "dequant_cache" for a in dl.arenas)
    assert has_dq == (cache == "all")
    if arena == "per-tensor":
        assert len(alloc.records) == sum(len(a.spans) for a in dl.arenas)  # one per span
    st = stages[0]
    # every weight span holds the file's bytes; every cached matrix its dequantized values
    for a in dl.arenas:
        for s in a.spans:
            if s.purpose in ("weights", "globals"):
                src = model.tensor_data(model.tensor(s.name))
                assert np.array_equal(st.spans[s.name].numpy(), src), s.name
            elif s.purpose == "dequant_cache":
                info = model.tensor(s.name[3:])
                ref = gguf_dequantize(model.tensor_data(info), info.ggml_type)
                ref = torch.from_numpy(np.ascontiguousarray(ref)).reshape(s.shape)
                got = st.spans[s.name]
                assert got.dtype == torch.bfloat16  # the CPU's substitute for f16, same bytes
                torch.testing.assert_close(got.float(), ref.to(torch.bfloat16).float())


def test_progress_reports_bytes_and_rate(synth_model) -> None:
    path = synth_model("llama")
    model = GGUFModel.open(path)
    layout = price(_plan(path), model)
    events = []
    load_layout(layout, model, RecordingAllocator(), lambda *e: events.append(e))
    weights = [e for e in events if e[0] == "weights"]
    want = sum(s.nbytes for a in layout.devices[0].arenas for s in a.spans
               if s.purpose in ("weights", "globals"))
    assert weights[0][1] == 0 and weights[-1][1] == weights[-1][2] == want
    assert all(b[1] >= a[1] for a, b in itertools.pairwise(weights))
    assert weights[-1][3] > 0
    assert any(e[0] == "dequant cache" for e in events)


def test_cancel_frees_everything(synth_model) -> None:
    path = synth_model("qwen2")
    model = GGUFModel.open(path)
    layout = price(_plan(path), model)
    alloc = RecordingAllocator()
    calls = []

    def cancelled() -> bool:
        calls.append(1)
        return len(calls) > 3

    with pytest.raises(CarveError, match="cancelled"):
        load_layout(layout, model, alloc, None, cancelled)
    assert alloc.records  # it had started
    assert alloc.live_bytes == 0


def test_session_close_frees_and_reports(synth_model) -> None:
    path = synth_model("qwen3")
    sess = Session.load(_plan(path))
    rep = sess.memory_report()
    assert rep == [{"index": -1, "name": "cpu", "priced": sess.layout.devices[0].allocated,
                    "allocated": sess.layout.devices[0].allocated, "nvml_used": None}]
    sess.close()
    assert sess.allocator.live_bytes == 0


def test_a_plan_that_does_not_fit_allocates_nothing(synth_model) -> None:
    small = DeviceSpec(index=-1, name="cpu", total=1 << 20, free=1 << 20)
    with pytest.raises(CarveError, match="CPU: the plan does not fit"):
        Session.load(_plan(synth_model("llama"), devices=(small,)))

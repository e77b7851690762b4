"""A file with a block whose scale is inf or NaN: both runners refuse it at load with one
sentence naming the file and the tensor, before any forward could pass NaN on (the GPU runner
under TRITON_INTERPRET=1 without a GPU)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.gpu import stage as gpu_stage
from engine.runtime.gpu.session import GpuSession
from engine.runtime.session import Session
from engine.synth.gen import tensor_types, write_model
from engine.synth.shapes import Shape
from spec import quant_types as qt
from spec.errors import CarveError

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
TINY = Shape("qwen2", 2, 256, 2, 1, 256, 320, n_ctx=512)
NO_CACHE = 1 << 50  # a cache reserve beyond the device: nothing cached, f32 activations
MIX = "iq2_xxs-q8attn"  # IQ2_XXS FFN, Q2_K ffn_down (two f16 fields), Q8_0 attention


def _damaged(tmp_path, name: str, block: int, field: int, bits: int) -> str:
    path = write_model(tmp_path / "damaged.gguf", TINY, MIX)[0]
    info = GGUFModel.open(path).tensor(name)
    q = qt.QUANT[info.ggml_type]
    at = info.offset + block * q.type_size + qt.f16_fields(info.ggml_type)[field]
    with open(path, "r+b") as f:
        f.seek(at)
        f.write(bits.to_bytes(2, "little"))
    return str(path)


def _plan(path: str, **kw) -> Plan:
    return Plan(model=path, devices=(CPU,), split=(0, 2), ctx=64, prefill_chunk=8,
                **{"cache_reserve": 0, "logits_rows": 1, **kw})


@pytest.mark.parametrize(("name", "field", "bits"), [
    ("blk.1.ffn_up.weight", 0, 0x7C00),  # IQ2_XXS d = +inf
    ("blk.0.ffn_down.weight", 1, 0xFE00),  # Q2_K dmin = NaN
])
def test_both_runners_name_the_tensor_at_load(tmp_path, monkeypatch, name, field, bits) -> None:
    types = tensor_types(TINY, MIX)
    assert (types["blk.1.ffn_up.weight"], types["blk.0.ffn_down.weight"]) == (qt.IQ2_XXS,
                                                                               qt.Q2_K)
    path = _damaged(tmp_path, name, 5, field, bits)
    kind = qt.type_name(types[name])
    want = (f"{path}: tensor {name} has a block whose {kind} scale is not finite (inf or NaN): "
            "the file is damaged; download or convert it again")
    with pytest.raises(CarveError) as e:  # the torch engine
        Session.load(_plan(path))
    assert str(e.value) == want
    arenas: list[weakref.ref] = []

    def new_arena(nbytes, device):
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        arenas.append(weakref.ref(t))
        return t

    monkeypatch.setattr(gpu_stage, "new_arena", new_arena)
    with pytest.raises(CarveError) as e:  # the GPU runner: its scan on the device
        GpuSession.load(_plan(path), devices=[DEV], remember=False)
    assert str(e.value) == want
    gc.collect()
    assert arenas and not any(r() is not None for r in arenas)  # nothing kept allocated


def test_an_undamaged_low_bit_file_runs_as_on_the_cpu_engine(tmp_path) -> None:
    # the GPU runner's GEMVs (GGUF order: prefill chunks of up to 8 rows and decode) on IQ
    # and Q2_K matrices, their tables read from the priced lookup buffer, against the CPU
    # engine on the same file; f32 activations, nothing cached
    path = str(write_model(tmp_path / "ok.gguf", TINY, MIX)[0])
    assert len(set(tensor_types(TINY, MIX).values())) >= 4
    prompt = torch.randint(3, 300, (3,), generator=torch.Generator().manual_seed(1)).tolist()
    pl = _plan(path, cache_reserve=NO_CACHE)
    g = GpuSession.load(pl, devices=[DEV], remember=False)
    c = Session.load(pl)
    try:
        lg, lc = g.logits(prompt), c.logits(prompt)
        # float32 sums in another order (measured 1.5e-4 of the largest logit)
        assert (lg.float() - lc.float()).abs().max() <= 2e-3 * lc.abs().max()
        dg = g.forward([7], len(prompt), "last")
        dc = c.forward([7], len(prompt), "last")
        assert (dg.float() - dc.float()).abs().max() <= 2e-3 * dc.abs().max()
    finally:
        g.close()
        c.close()

"""price(plan) on synthetic GGUFs: every term, the allocator replay, verdicts, advice, errors."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.hardware import calibration
from engine.hardware.devices import DeviceSpec
from engine.planning.arena import device_bytes
from engine.planning.buffers import activation_buffers
from engine.planning.carve import carve, model_index
from engine.planning.layout import PURPOSES, Layout
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.planning.rules import TIGHT
from engine.planning.stage import stage_key, stage_need
from engine.synth.header import HeaderModel
from engine.synth.shapes import Shape
from spec.errors import CarveError

MIB = 1 << 20
GIB = 1 << 30


def gpu(free: int, index: int = 0, name: str = "test gpu", reserve: int = 0) -> DeviceSpec:
    return DeviceSpec(
        index=index, name=name, total=free + GIB, free=free, simulated=True, reserve=reserve
    )


def cpu(free: int = 64 * GIB) -> DeviceSpec:
    return DeviceSpec(index=-1, name="cpu", total=free, free=free)


def open_model(path: Path) -> GGUFModel:
    return GGUFModel.open(path)


def reader_meta(path: Path) -> dict[str, Any]:
    """Hyper-parameters read by gguf's own reader, not ours."""
    r = gguf.GGUFReader(path)
    arch = r.fields["general.architecture"].contents()
    return {
        k.split(".", 1)[1]: f.contents() for k, f in r.fields.items() if k.startswith(arch + ".")
    }


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("arena", ["packed", "per-tensor", "chunked:1"])
@pytest.mark.parametrize("where", ["gpu", "cpu"])
def test_terms_are_the_spans_and_allocated_is_the_allocator_replay(
    synth_model: Any, arch: str, arena: str, where: str
) -> None:
    model = open_model(synth_model(arch))
    n = HParams.from_model(model).n_layer
    devs = (gpu(2 * GIB), gpu(2 * GIB, 1)) if where == "gpu" else (cpu(),)
    split = (0, n // 2, n) if where == "gpu" else (0, n)
    plan = Plan(
        str(model.paths[0]),
        devs,
        split,
        ctx=512,
        arena=arena,
        prefill_chunk=64,
        act_dtype="bf16" if where == "gpu" else "f32",
        cache_reserve=MIB,
    )
    layout = price(plan, model)
    for d in layout.devices:
        for p in PURPOSES:
            assert d.terms[p] == sum(s.nbytes for a in d.arenas for s in a.spans if s.purpose == p)
        assert device_bytes(d.arenas, on_gpu=where == "gpu") == d.allocated
        assert d.terms["rounding"] == d.allocated - sum(d.terms[p] for p in PURPOSES)
        assert d.total == d.allocated + d.terms["overhead"]
        assert d.headroom == d.device.free - d.device.reserve - d.total
        names = [s.name for a in d.arenas for s in a.spans]
        assert len(names) == len(set(names))
        if where == "cpu":
            assert d.terms["overhead"] == 0 and d.terms["rounding"] == (
                0 if arena != "chunked:1" else d.terms["rounding"]
            )


@pytest.mark.parametrize("kv", ["f16", "q8_0"])
def test_kv_bytes_per_layer(synth_model: Any, kv: str) -> None:
    path = synth_model("llama")
    meta = reader_meta(path)
    n_kv, n_head, n_embd = (
        meta["attention.head_count_kv"],
        meta["attention.head_count"],
        meta["embedding_length"],
    )
    head_dim = n_embd // n_head
    model = open_model(path)
    ctx = 768
    layout = price(Plan(str(path), (cpu(),), (0, meta["block_count"]), ctx=ctx, kv_type=kv), model)
    d = layout.devices[0]
    per_layer = (
        2 * n_kv * head_dim * ctx * 2 if kv == "f16" else 2 * (n_kv * head_dim * ctx // 32) * 34
    )
    assert d.terms["kv"] == meta["block_count"] * per_layer
    _, k0 = d.span("kv.0.k")
    assert k0.shape == ((ctx, n_kv, head_dim) if kv == "f16" else (per_layer // 2,))


def test_sliding_window_layers_hold_the_window_only(synth_model: Any) -> None:
    path = synth_model("gemma3")
    meta = reader_meta(path)
    window, n = meta["attention.sliding_window"], meta["block_count"]
    model = open_model(path)
    hp = HParams.from_model(model)
    ctx = 1024
    assert window < ctx
    d = price(Plan(str(path), (cpu(),), (0, n), ctx=ctx), model).devices[0]
    cells = [d.span(f"kv.{i}.k")[1].shape[0] for i in range(n)]
    assert cells == [window if hp.swa_layers[i] else ctx for i in range(n)]
    assert set(cells) == {window, ctx}  # both kinds present in the tiny gemma3


def test_tied_embeddings_last_stage_keeps_its_own_copy(synth_model: Any) -> None:
    path = synth_model("qwen2")  # tied: no output.weight
    model = open_model(path)
    assert "output.weight" not in {t.name for t in model.tensors}
    emb = model.tensor("token_embd.weight")
    two = price(Plan(str(path), (gpu(2 * GIB), gpu(2 * GIB, 1)), (0, 2, 4), ctx=256), model)
    first, last = two.devices
    assert [s.name for a in first.arenas if a.purpose == "globals" for s in a.spans] == [
        "token_embd.weight"
    ]
    assert {s.name for a in last.arenas if a.purpose == "globals" for s in a.spans} == {
        "token_embd.weight",
        "output_norm.weight",
    }
    one = price(Plan(str(path), (cpu(),), (0, 4), ctx=256), model).devices[0]
    assert (
        one.terms["globals"] == emb.nbytes + model.tensor("output_norm.weight").nbytes
    )  # one copy


def test_dequant_cache_takes_what_is_left_above_the_reserve(synth_model: Any) -> None:
    path = synth_model("llama")
    model = open_model(path)
    idx = model_index(model)
    cacheable = idx.cache_prefix[-1]
    plan = Plan(str(path), (gpu(4 * GIB),), (0, 4), ctx=256, act_dtype="bf16", cache_reserve=MIB)
    roomy = price(plan, model).devices[0]
    assert roomy.terms["dequant_cache"] == cacheable  # all of it, never more
    dq = [s for a in roomy.arenas if a.purpose == "dequant_cache" for s in a.spans]
    for s in dq:
        t = model.tensor(s.name.removeprefix("dq."))
        assert s.dtype == "bf16" and s.shape == (t.shape[1], t.shape[0])
        assert t.layer is not None or t.name == "output.weight"  # layer matrices and the head
    assert any(s.name == "dq.output.weight" for s in dq)
    assert not any(
        s.name == "buf.dequant" for a in roomy.arenas for s in a.spans
    )  # nothing left to dequantize

    need = stage_need(idx, stage_key(plan, 0))
    for extra in (0, 3 * MIB, 9 * MIB):
        reserve = 4 * MIB
        tight = price(
            Plan(
                str(path),
                (gpu(need + reserve + extra),),
                (0, 4),
                ctx=256,
                act_dtype="bf16",
                cache_reserve=reserve,
            ),
            model,
        ).devices[0]
        assert 0 <= tight.terms["dequant_cache"] <= cacheable
        assert tight.headroom >= reserve  # the cache never eats the reserve
        if tight.terms["dequant_cache"] == 0:
            _, buf = tight.span("buf.dequant")  # uncached matrices are dequantized into the scratch
            assert buf.shape[0] == max(
                t.n_elements for t in model.tensors if t.layer is not None and len(t.shape) == 2
            )


def test_dequant_cache_is_sized_after_kv(synth_model: Any) -> None:
    path = synth_model("llama")
    model = open_model(path)
    base = Plan(str(path), (cpu(),), (0, 4), ctx=256, cache_reserve=MIB)
    idx = model_index(model)
    need = stage_need(idx, stage_key(base, 0))
    dev = cpu(need + 4 * MIB)  # CPU: no allocator grain, so the cache shrinks byte by byte
    small = price(Plan(str(path), (dev,), (0, 4), ctx=256, cache_reserve=MIB), model).devices[0]
    big = price(Plan(str(path), (dev,), (0, 4), ctx=1024, cache_reserve=MIB), model).devices[0]
    assert big.terms["kv"] == 4 * small.terms["kv"]  # KV is exact whatever the cache
    assert 0 < big.terms["dequant_cache"] < small.terms["dequant_cache"]
    assert big.headroom >= MIB and small.headroom >= MIB


def test_verdicts(synth_model: Any) -> None:
    path = synth_model("llama")
    model = open_model(path)
    idx = model_index(model)
    base = Plan(str(path), (gpu(GIB),), (0, 4), ctx=256, cache_reserve=0)
    need = stage_need(idx, stage_key(base, 0))

    # no cacheable room matters here: cache_reserve larger than the slack keeps the cache at 0
    def verdict(free: int, reserve: int = 0) -> tuple[str, int]:
        d = price(
            Plan(str(path), (gpu(free, reserve=reserve),), (0, 4), ctx=256, cache_reserve=GIB),
            model,
        ).devices[0]
        return d.verdict, d.headroom

    assert verdict(need + TIGHT) == ("fits", TIGHT)
    assert verdict(need + TIGHT - 1) == ("tight", TIGHT - 1)
    assert verdict(need) == ("tight", 0)
    assert verdict(need - 1) == ("does not fit", -1)
    assert verdict(need + TIGHT, reserve=MIB) == ("tight", TIGHT - MIB)  # the user's reserve counts


# big enough that layers and KV outweigh the allocator's 2/20 MiB segments; header only
MID = Shape("llama", 8, 2048, 16, 4, 5632, 32000, n_ctx=8192)


def test_advice_names_the_term_and_what_fits() -> None:
    model = HeaderModel(MID)
    idx = model_index(model)
    at = {
        ctx: stage_need(idx, stage_key(Plan("m", (gpu(GIB),), (0, 8), ctx=ctx), 0))
        for ctx in (2048, 4096)
    }
    dev = gpu((at[2048] + at[4096]) // 2)
    d = price(Plan("m", (dev,), (0, 8), ctx=4096), model).devices[0]
    assert d.verdict == "does not fit"
    assert d.advice.startswith("over by ") and "KV cache (" in d.advice
    ctx = int(re.search(r"--ctx (\d+)", d.advice).group(1))
    assert ctx % 256 == 0 and 2048 <= ctx < 4096
    assert price(Plan("m", (dev,), (0, 8), ctx=ctx), model).devices[0].verdict != "does not fit"
    assert (
        price(Plan("m", (dev,), (0, 8), ctx=ctx + 256), model).devices[0].verdict == "does not fit"
    )
    assert "--kv q8_0" in d.advice
    assert (
        price(Plan("m", (dev,), (0, 8), ctx=4096, kv_type="q8_0"), model).devices[0].verdict
        != "does not fit"
    )


def test_advice_moves_a_boundary_to_the_neighbour_with_room() -> None:
    model = HeaderModel(MID)
    idx = model_index(model)
    probe = Plan("m", (gpu(GIB), gpu(GIB, 1)), (0, 5, 8), ctx=2048)
    small = stage_need(idx, stage_key(probe, 1))  # GPU 1 holding layers 5-7
    plan = Plan("m", (gpu(8 * GIB), gpu(small + MIB, 1)), (0, 2, 8), ctx=2048)
    layout = price(plan, model)
    assert layout.devices[0].verdict == "fits" and layout.devices[1].verdict == "does not fit"
    m = re.search(r"--split boundary 1 moved \+(\d+)", layout.devices[1].advice)
    assert m, layout.devices[1].advice
    k = int(m.group(1))
    assert k <= 3
    assert price(Plan("m", plan.devices, (0, 2 + k, 8), ctx=2048), model).fits
    assert not price(
        Plan("m", plan.devices, (0, 1 + k, 8), ctx=2048), model
    ).fits  # the smallest move


def test_nothing_helps_says_so() -> None:
    model = HeaderModel(MID)
    d = price(Plan("m", (gpu(850 * MIB),), (0, 8), ctx=4096), model).devices[0]
    assert d.verdict == "does not fit" and "no single change fits it" in d.advice
    assert ": weights (" in d.advice  # the 825 MiB overhead comes first, the weights overflow


def test_errors_that_need_the_model(synth_model: Any) -> None:
    path = synth_model("llama")
    model = open_model(path)
    with pytest.raises(CarveError, match=r"--split: .*\(4\), got 3"):
        price(Plan(str(path), (cpu(),), (0, 3), ctx=256), model)
    with pytest.raises(CarveError, match=r"--ctx: 4096 is above the 2048"):
        price(Plan(str(path), (cpu(),), (0, 4), ctx=4096), model)


def test_price_opens_the_model_itself_and_json_round_trips(synth_model: Any) -> None:
    path = synth_model("qwen2")
    plan = Plan(
        str(path), (gpu(GIB), gpu(GIB, 1)), (0, 1, 4), ctx=256, kv_type="q8_0", arena="chunked:2"
    )
    layout = price(plan)
    data = json.loads(json.dumps(layout.to_json()))
    back = Layout.from_json(data)
    assert back.plan == plan
    assert back.devices == layout.devices


def test_overhead_comes_from_a_calibration_record(synth_model: Any) -> None:
    path = synth_model("llama")
    model = open_model(path)
    dev = gpu(2 * GIB, name="NVIDIA Test Card")
    plan = Plan(str(path), (dev,), (0, 4), ctx=256)
    assert (
        price(plan, model).devices[0].terms["overhead"] == calibration.DEFAULT_OVERHEAD == 825 * MIB
    )
    calibration.remember("NVIDIA Test Card", "580.1", calibration.torch_version(), 555 * MIB)
    d = price(plan, model).devices[0]
    assert d.terms["overhead"] == 555 * MIB and d.overhead_source.startswith("calibrated")
    other = price(Plan(str(path), (gpu(2 * GIB, name="Other"),), (0, 4), ctx=256), model).devices[0]
    assert other.terms["overhead"] == 825 * MIB
    assert (
        price(Plan(str(path), (cpu(),), (0, 4), ctx=256), model).devices[0].terms["overhead"] == 0
    )


def test_moving_one_boundary_reprices_only_its_two_stages(synth_model: Any) -> None:
    path = synth_model("gemma3")  # 6 layers
    model = open_model(path)
    devs = tuple(gpu(GIB, i) for i in range(4))
    a = price(Plan(str(path), devs, (0, 1, 2, 4, 6), ctx=256), model)
    b = price(Plan(str(path), devs, (0, 1, 3, 4, 6), ctx=256), model)
    assert a.devices[0] is b.devices[0] and a.devices[3] is b.devices[3]
    assert a.devices[1] is not b.devices[1] and b.devices[1].layers == (1, 3)


def test_buffers_are_the_one_list(synth_model: Any) -> None:
    path = synth_model("llama")
    model = open_model(path)
    hp = HParams.from_model(model)
    d = price(
        Plan(str(path), (cpu(),), (0, 4), ctx=256, prefill_chunk=32, logits_rows=32), model
    ).devices[0]
    spans = [s for a in d.arenas if a.purpose == "buffers" for s in a.spans]
    scratch = next((s.shape[0] for s in spans if s.name == "buf.dequant"), 0)
    expected = activation_buffers(hp, 32, "f32", 32, scratch)
    assert [(s.name, s.shape, s.dtype) for s in spans] == [
        (f"buf.{b.name}", b.shape, b.dtype) for b in expected
    ]
    sizes = {b.name: b.shape for b in expected}
    assert sizes["logits"] == (32, hp.n_vocab) and sizes["hidden"] == (32, hp.n_embd)
    assert sizes["qkv"] == (32, (hp.n_head + 2 * hp.n_head_kv) * hp.head_dim)
    assert sizes["ffn_up"] == (32, 2 * hp.n_ff)
    assert "logits" not in {b.name for b in activation_buffers(hp, 32, "f32", 0)}


def test_demo_model_full_range_prices_every_tensor_byte(demo_model_path: Path) -> None:
    model = open_model(demo_model_path)
    n = HParams.from_model(model).n_layer
    d = price(Plan(str(demo_model_path), (cpu(),), (0, n), ctx=4096), model).devices[0]
    # bytes from gguf's own type table (GGUFReader on this vocabulary takes ~10 s; the header
    # reader is held equal to it in the GGUF tests)
    sizes = gguf.constants.GGML_QUANT_SIZES
    expected = 0
    for t in model.tensors:
        block, type_size = sizes[gguf.GGMLQuantizationType(t.ggml_type)]
        expected += t.n_elements // block * type_size
    assert d.terms["weights"] + d.terms["globals"] == expected
    assert len(carve(model, 0, n, True, True)) == len(model.tensors)
    assert expected == model.file_size - min(t.offset for t in model.tensors) - sum(
        -t.nbytes % model.alignment for t in model.tensors[:-1]
    )  # the data section, minus padding


def test_bench_price_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.bench_price import main

    assert main(["--gpus", "2x80GiB", "--repeat", "3"]) == 0
    out = capsys.readouterr().out
    assert "1443 tensors" in out and "re-price after one boundary move" in out


@settings(max_examples=60, deadline=None)
@given(
    st.integers(-8 * MIB, 64 * MIB),
    st.sampled_from(["packed", "per-tensor", "chunked:4"]),
    st.sampled_from([0, MIB, 5 * MIB]),
)
def test_the_cache_never_eats_the_reserve(
    synth_model: Any, extra: int, arena: str, reserve: int
) -> None:
    path = synth_model("llama")
    model = open_model(path)
    idx = model_index(model)
    probe = Plan(str(path), (gpu(GIB),), (0, 4), ctx=256, arena=arena, act_dtype="bf16")
    need = stage_need(idx, stage_key(probe, 0))
    plan = Plan(
        str(path),
        (gpu(need + extra),),
        (0, 4),
        ctx=256,
        arena=arena,
        act_dtype="bf16",
        cache_reserve=reserve,
    )
    d = price(plan, model).devices[0]
    assert device_bytes(d.arenas, on_gpu=True) == d.allocated
    if d.terms["dequant_cache"] > 0:
        assert d.headroom >= reserve
    assert (d.verdict == "does not fit") == (extra < 0)

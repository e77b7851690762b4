"""Pricing mixture-of-experts files: experts with their layer and as their own term, the router
as the file has it, NextN layers skipped and said so, bad expert shapes, and the split search
on MoE shapes (brute force on random rigs)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from app.cli_plan import main as plan_main
from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.carve import is_expert, model_index, parameter_counts
from engine.planning.layout import PURPOSES, TERMS, Layout
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.planning.split import GRAIN, auto_split
from engine.planning.stage import stage_key, stage_need
from engine.synth.gen import write_model
from engine.synth.header import HeaderModel
from engine.synth.shapes import SHAPES, Shape
from spec.errors import CarveError

MIB, GIB = 1 << 20, 1 << 30
MOE_FILES = [("qwen3moe-tiny", "q4_k_m"), ("gpt-oss-tiny", "mxfp4_moe"), ("glm4moe-tiny", "q4_k_m")]


def gpu(i: int, free_mib: int) -> DeviceSpec:
    return DeviceSpec(i, f"card{i}", (free_mib + 600) * MIB, free_mib * MIB, simulated=True)


def _bytes(model: Any, pick: Any) -> int:
    return sum(t.nbytes for t in model.tensors if pick(t))


@pytest.mark.parametrize(("shape", "mix"), MOE_FILES)
def test_every_split_bills_each_stages_experts_at_their_file_bytes(synth_model, shape, mix):
    model = GGUFModel.open(synth_model(shape, mix))
    n = SHAPES[shape].n_layer
    devices = (gpu(0, 4000), gpu(1, 4000))
    for cut in range(1, n):
        layout = price(Plan("m", devices, (0, cut, n), ctx=256, act_dtype="bf16"), model)
        for d in layout.devices:
            lo, hi = d.layers
            mine = lambda t, lo=lo, hi=hi: t.layer is not None and lo <= t.layer < hi  # noqa: E731
            experts = _bytes(model, lambda t, mine=mine: mine(t) and is_expert(t.name))
            dense_only = hi <= SHAPES[shape].n_layer_dense_lead  # GLM's leading dense layer
            assert d.terms["experts"] == experts and (experts == 0) == dense_only
            assert d.terms["weights"] == _bytes(model, lambda t, mine=mine: mine(t)) - experts
            spans = {s.name: (a, s) for a in d.arenas for s in a.spans}
            for t in model.tensors:
                if t.layer is None:
                    continue
                if not mine(t):  # a stage never holds another stage's experts
                    assert t.name not in spans
                    continue
                arena, span = spans[t.name]  # experts live in the weights arena, as file bytes
                assert (arena.purpose, span.purpose, span.nbytes) == ("weights", "weights", t.nbytes)
                assert tuple(span.shape) == tuple(t.shape)
                assert ("dq." + t.name in spans) is False or not is_expert(t.name)
            if not dense_only:
                router = spans[f"blk.{hi - 1}.ffn_gate_inp.weight"][1]
                assert router.dtype == "F32"  # the router stays f32, as in the file
            by_purpose = {p: sum(s.nbytes for a in d.arenas for s in a.spans if s.purpose == p)
                          for p in PURPOSES}
            assert by_purpose["weights"] == d.terms["weights"] + d.terms["experts"]
            for p in PURPOSES[1:]:
                assert by_purpose[p] == d.terms[p]
            assert d.terms["rounding"] == d.allocated - sum(d.terms[p] for p in TERMS)


def test_experts_get_no_dequant_cache_and_the_scratch_holds_one_expert(synth_model):
    model = GGUFModel.open(synth_model("qwen3moe-tiny"))
    layout = price(Plan("m", (gpu(0, 8000),), (0, 4), ctx=256, act_dtype="bf16"), model)
    d = layout.devices[0]
    dq = [s.name for a in d.arenas for s in a.spans if s.purpose == "dequant_cache"]
    assert dq and not [x for x in dq if is_expert(x)]
    assert "dq.blk.0.ffn_gate_inp.weight" not in dq  # f32: nothing to dequantize
    # everything else is cached here; the scratch serves one expert (256 x 256) or the f32 router
    scratch = d.span("buf.dequant")[1]
    assert scratch.shape == (256 * 256,)


def test_nextn_layer_is_neither_priced_nor_loaded_and_the_bill_says_so(synth_model):
    model = GGUFModel.open(synth_model("glm4moe-tiny"))
    idx = model_index(model)
    assert (idx.n_layer, idx.n_skipped_layers) == (3, 1)
    nextn = [t for t in model.tensors if t.layer == 3]
    assert any(t.name == "blk.3.nextn.eh_proj.weight" for t in nextn)
    plan = Plan("m", (gpu(0, 2000), gpu(1, 2000)), (0, 1, 3), ctx=256)
    layout = price(plan, model)
    held = {s.name for d in layout.devices for a in d.arenas for s in a.spans}
    assert not [s for s in held if s.startswith("blk.3.") or ".3.k" in s or "kv.3." in s]
    assert layout.skipped_layers == 1 and layout.skipped_bytes == sum(t.nbytes for t in nextn)
    kib = layout.skipped_bytes / 1024
    assert layout.skipped_line() == f"skipped: 1 next-token-prediction layer, {kib:.1f} KiB"
    again = Layout.from_json(json.loads(json.dumps(layout.to_json())))
    assert (again.skipped_layers, again.skipped_bytes) == (1, layout.skipped_bytes)
    # the dense leading layer is priced as a dense layer, the others with experts
    assert layout.devices[0].terms["experts"] == 0 and layout.devices[1].terms["experts"] > 0
    # all the run layers and globals of the file, and nothing of the NextN layer
    total = sum(d.terms[t] for d in layout.devices for t in ("weights", "experts"))
    assert total == _bytes(model, lambda t: t.layer is not None and t.layer < 3)
    with pytest.raises(CarveError, match=r"layer count of .* \(3\), got 4"):
        price(Plan("m", (gpu(0, 2000),), (0, 4), ctx=256), model)
    run, active = parameter_counts(model, idx.hp)
    assert run == sum(t.n_elements for t in model.tensors if t.layer != 3)
    experts = sum(t.n_elements for t in model.tensors if is_expert(t.name) and t.layer != 3)
    assert active == run - experts // 2  # 2 of 4 experts; the shared expert in full


def test_carve_plan_shows_experts_and_the_skipped_layer(synth_model, capsys):
    path = str(synth_model("glm4moe-tiny"))
    code = plan_main(["plan", path, "--gpus", "2x24GiB", "--ctx", "256", "--split", "0,2,3"])
    out = capsys.readouterr().out
    assert code == 0
    experts = next(x for x in out.splitlines() if x.startswith("experts "))
    weights = next(x for x in out.splitlines() if x.startswith("weights "))
    assert len(experts.split()) == 5 and len(weights.split()) == 5  # a figure per GPU
    assert "skipped: 1 next-token-prediction layer, " in out
    assert plan_main(["plan", path, "--gpus", "2x24GiB", "--ctx", "256", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert all(d["terms"]["experts"] > 0 for d in data["devices"][1:])
    assert data["skipped"]["layers"] == 1 and data["plan"]["split"][-1] == 3
    dense = str(synth_model("qwen3"))
    assert plan_main(["plan", dense, "--gpus", "1x24GiB", "--ctx", "256"]) == 0
    out = capsys.readouterr().out
    assert "experts" not in out and "skipped" not in out


def _edit(key: str, value: int):
    def edit(meta):
        return [(k, t, value if k == key else v) for k, t, v in meta]

    return edit


@pytest.mark.parametrize(("key", "value", "message"), [
    ("qwen3moe.expert_count", 5, "tensor blk.0.ffn_gate_inp.weight has shape [256, 4]"),
    ("qwen3moe.expert_used_count", 6, "expert_used_count is 6"),
])
def test_bad_expert_metadata_is_one_sentence_and_exit_2(tmp_path, capsys, key, value, message):
    path = write_model(tmp_path / "bad.gguf", "qwen3moe-tiny", edit=_edit(key, value))[0]
    assert plan_main(["plan", str(path), "--gpus", "1x24GiB", "--ctx", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"carve: {path}: ") and message in err and err.count("\n") == 1


def test_a_stacked_expert_tensor_with_the_wrong_expert_count(tmp_path, capsys, monkeypatch):
    import engine.synth.gen as gen

    table = gen.tensor_table

    def odd_table(s):  # layer 1's down experts stack 3 experts, the metadata says 4
        return [(n, (d[0], d[1], 3) if n == "blk.1.ffn_down_exps.weight" else d)
                for n, d in table(s)]

    monkeypatch.setattr(gen, "tensor_table", odd_table)
    path = write_model(tmp_path / "odd.gguf", "qwen3moe-tiny")[0]
    monkeypatch.undo()
    assert plan_main(["plan", str(path), "--gpus", "1x24GiB", "--ctx", "256"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"carve: {path}: tensor blk.1.ffn_down_exps.weight holds 3 experts")
    assert err.count("\n") == 1


# --- the split search on MoE shapes ----------------------------------------------------------

# MoE layers much larger than the leading dense ones (GLM); a NextN layer the search must ignore
GLM = HeaderModel(Shape("glm4moe", 8, 1024, 8, 2, 2048, 8000, head_dim=128, n_ctx=16384,
                        n_expert=32, n_expert_used=4, n_ff_exp=512, n_expert_shared=1,
                        n_layer_dense_lead=2, n_nextn=1, rope_dim=64), name="glm8.gguf")
QWEN = HeaderModel(Shape("qwen3moe", 8, 1024, 8, 2, 2816, 8000, head_dim=128, n_ctx=16384,
                         n_expert=32, n_expert_used=4, n_ff_exp=512), name="qwen8.gguf")
CTX = 8192


def slacks(model: Any, plan: Plan) -> list[int]:
    idx = model_index(model)
    return [d.free - d.reserve - stage_need(idx, stage_key(plan, i))
            for i, d in enumerate(plan.devices)]


def brute_best(model: Any, devices: tuple[DeviceSpec, ...], **kw: Any) -> int:
    n = model_index(model).n_layer
    return max(
        min(slacks(model, Plan("m", devices, (0, *cuts, n), ctx=CTX, **kw)))
        for cuts in itertools.combinations(range(1, n), len(devices) - 1)
    )


def test_moe_layers_outweigh_the_dense_ones():
    idx = model_index(GLM)
    per = [idx.layer_raw_prefix[i + 1] - idx.layer_raw_prefix[i] for i in range(idx.n_layer)]
    assert idx.n_layer == 8 and min(per[2:]) > 2 * max(per[:2])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(700, 2600), min_size=1, max_size=4),
       st.sampled_from([GLM, QWEN]), st.sampled_from(["packed", "per-tensor", "chunked:16"]))
# rigs where the rounding charged per device swung the search between two splits and it kept
# the worse (72 and 69 MiB below the best), once in ~3,000 draws
@example([876, 700, 919], GLM, "chunked:16")
@example([1023, 750, 977], GLM, "chunked:16")
def test_spread_on_moe_shapes_is_the_brute_force_max_min(rig: list[int], model: Any,
                                                         arena: str) -> None:
    devices = tuple(gpu(i, f) for i, f in enumerate(rig))
    plan = auto_split(model, devices, prefer="spread", ctx=CTX, arena=arena, act_dtype="bf16")
    idx = model_index(model)
    assert plan.devices == devices and plan.split[0] == 0 and plan.split[-1] == idx.n_layer == 8
    got = min(slacks(model, plan))
    best = brute_best(model, devices, arena=arena, act_dtype="bf16")
    # packed is exact to the search's grain; the other modes as the dense toy test allows
    slack = GRAIN if arena == "packed" else 3 * 20 * MIB + GRAIN
    assert best - slack < got <= best
    layout = price(plan, model)
    assert layout.fits == (got >= 0)
    owner = {}
    for d in layout.devices:
        for a in d.arenas:
            for s in a.spans:
                if s.name.startswith("blk."):
                    layer = int(s.name.split(".")[1])
                    assert d.layers[0] <= layer < d.layers[1]  # experts with their layer
                    owner[s.name] = d.device.index
    run = {t.name for t in model.tensors if t.layer is not None and t.layer < 8}
    assert set(owner) == run  # no layer lost, no NextN tensor priced
    assert sum(d.terms["experts"] for d in layout.devices) == sum(
        t.nbytes for t in model.tensors if is_expert(t.name) and t.layer < 8)


def test_a_real_moe_shape_over_two_24_gib_cards():
    model = HeaderModel(SHAPES["qwen3moe-30b-a3b"])
    devices = (gpu(0, 23 * 1024), gpu(1, 23 * 1024))
    plan = auto_split(model, devices, prefer="spread", ctx=8192, act_dtype="bf16")
    layout = price(plan, model)
    assert layout.fits and plan.split[-1] == 48
    experts = [d.terms["experts"] for d in layout.devices]
    assert abs(experts[0] - experts[1]) <= 2 * 113 * MIB  # within about two layers' experts
    assert sum(experts) > 15 * GIB


def test_advice_names_the_experts_when_they_overflow(capsys):
    model = HeaderModel(SHAPES["qwen3moe-30b-a3b"])
    layout = price(Plan("m", (gpu(0, 8 * 1024),), (0, 48), ctx=4096, act_dtype="bf16"), model)
    d = layout.devices[0]
    assert not layout.fits and d.terms["experts"] > 15 * GIB
    assert f"experts ({d.terms['experts'] / GIB:.2f} GiB) does not fit in 8.00 GiB free" in d.advice

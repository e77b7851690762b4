"""Experts in host memory, planned and priced: the Plan's per-GPU placement and expert-cache
slots (validation, JSON), the host line of the bill (pinned experts and transfer buffers against
the host's RAM), the expert cache as a GPU term, the advice and the automatic placement."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from app.cli_plan import main as plan_main
from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.hardware import native
from engine.hardware.devices import DeviceSpec
from engine.planning.arena import align_up
from engine.planning.carve import is_expert, model_index
from engine.planning.defaults import default_plan
from engine.planning.host import HOST_PURPOSES, host_moe_buffers
from engine.planning.layout import PURPOSES, TERMS, Layout, human
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.planning.rules import Verdict
from engine.planning.stage import native_covers, stage_key, stage_need
from engine.synth.header import HeaderModel
from engine.synth.shapes import SHAPES
from spec.errors import CarveError
from spec.quant_types import type_name

MIB, GIB = 1 << 20, 1 << 30
HOST = DeviceSpec(-1, "host", 64 * GIB, 48 * GIB, simulated=True)


def gpu(i: int, free_mib: int) -> DeviceSpec:
    return DeviceSpec(i, f"card{i}", (free_mib + 600) * MIB, free_mib * MIB, simulated=True)


def test_plan_placement_validates_and_round_trips() -> None:
    devs = (gpu(0, 4000), gpu(1, 4000))
    p = Plan("m", devs, (0, 2, 4), ctx=64, experts_resident=(1, 0), expert_slots=[3, 4],
             host=HOST)
    again = Plan.from_json(json.loads(json.dumps(p.to_json())))
    assert again == p and again.experts_resident == (1, 0) and again.expert_slots == (3, 4)
    assert (p.resident(0), p.slots(1)) == (1, 4)
    old = p.to_json()  # a plan saved before placements existed: all in VRAM, no slots
    for key in ("experts_resident", "expert_slots", "host"):
        del old[key]
    legacy = Plan.from_json(old)
    assert legacy.experts_resident == () and legacy.host is None and legacy.slots(0) == 0
    assert legacy.resident(1) >= 1 << 20
    bad = [
        ({"experts_resident": (1,)}, "--experts-resident: 2 device(s) need 2 counts, got 1: 1"),
        ({"expert_slots": (2, -1)}, "--expert-slots: counts must be 0 or more, got 2,-1"),
        ({"experts_resident": ("a", 1)}, "--experts-resident: expected whole numbers"),
    ]
    for kw, msg in bad:
        with pytest.raises(CarveError, match=msg.replace("(", r"\(").replace(")", r"\)")):
            Plan("m", devs, (0, 2, 4), ctx=64, **kw)
    cpu = DeviceSpec(-1, "cpu", 8 * GIB, 8 * GIB)
    with pytest.raises(CarveError, match="--experts-resident: a CPU plan keeps every expert"):
        Plan("m", (cpu,), (0, 4), ctx=64, experts_resident=(0,))


@pytest.mark.parametrize("arena", ["packed", "per-tensor"])
def test_host_layers_leave_vram_and_are_billed_on_the_host(synth_model, arena,
                                                           monkeypatch) -> None:
    """qwen3moe-tiny (4 MoE layers) on two GPUs: GPU 0 keeps 1 of its 2 MoE layers' experts in
    VRAM, GPU 1 none; every term exact against the tensor table. "both" without the CPU's
    native kernel (CARVE_NATIVE=0) keeps the CPU's layouts beside the file's bytes."""
    monkeypatch.setenv("CARVE_NATIVE", "0")
    model = GGUFModel.open(synth_model("qwen3moe-tiny"))
    hp_e = HParams.from_model(model).n_expert
    devs = (gpu(0, 4000), gpu(1, 4000))
    base = Plan("m", devs, (0, 2, 4), ctx=256, act_dtype="bf16", arena=arena, host=HOST)
    plan = Plan("m", devs, (0, 2, 4), ctx=256, act_dtype="bf16", arena=arena, host=HOST,
                experts_resident=(1, 0), expert_slots=(3, 0))
    full, layout = price(base, model), price(plan, model)
    host_layers = {0: {1}, 1: {2, 3}}
    chunk_bufs = host_moe_buffers(HParams.from_model(model), 512, "bf16")
    for i, (d, d0) in enumerate(zip(layout.devices, full.devices, strict=True)):
        lo, hi = d.layers
        experts = [t for t in model.tensors if is_expert(t.name) and lo <= t.layer < hi]
        away = [t for t in experts if t.layer in host_layers[i]]
        assert d.terms["host_experts"] == sum(t.nbytes for t in away)
        assert d.terms["experts"] == sum(t.nbytes for t in experts) - d.terms["host_experts"]
        assert d.terms["weights"] == d0.terms["weights"]  # dense weights stay on the GPU
        assert d.terms["host_buffers"] == sum(b.nbytes for b in chunk_bufs)
        held = {s.name: (a.purpose, s) for a in d.arenas for s in a.spans}
        for t in experts:  # a host layer's experts are in the host arena only, at file bytes
            purpose, span = held[t.name]
            assert purpose == ("host_experts" if t in away else "weights")
            assert span.nbytes == t.nbytes and span.dtype != "bf16"
        # one slot holds one expert's gate, up and down of the stage's largest MoE layer
        slot = max(sum(align_up(t.nbytes // hp_e) for t in experts if t.layer == layer)
                   for layer in range(lo, hi))
        # and the staging span host experts run on the GPU through: the largest host layer's
        stream = max(sum(align_up(t.nbytes) for t in away if t.layer == layer)
                     for layer in host_layers[i])
        assert held["expert_stream"][1].nbytes == stream
        assert d.terms["expert_cache"] == (3 * slot if i == 0 else 0) + stream
        if i == 0:
            assert held["expert_cache"][1].shape == (3, slot)
        host_arenas = [a for a in d.arenas if a.purpose in HOST_PURPOSES]
        assert d.host == sum(a.nbytes for a in host_arenas)
        assert d.host == sum(align_up(t.nbytes) for t in away) + sum(
            align_up(b.nbytes) for b in chunk_bufs)
        # the device's own bytes: every priced purpose, rounding the rest, no host bytes
        by_purpose = {p: sum(s.nbytes for a in d.arenas for s in a.spans if s.purpose == p)
                      for p in PURPOSES}
        assert by_purpose["weights"] == d.terms["weights"] + d.terms["experts"]
        assert d.terms["rounding"] == d.allocated - sum(d.terms[p] for p in TERMS)
        assert d.total == d.allocated + d.terms["overhead"]  # host bytes are not VRAM
    assert layout.host is not None and layout.host.stages == tuple(d.host for d in layout.devices)
    assert layout.host.headroom == HOST.free - layout.host.pinned
    assert full.host is None
    # computed by the CPU: no staging span and no slots in VRAM, and the host experts in the
    # CPU's layouts (Q4_K: 4 bits a value and a bf16 pair per 32; Q6_K: bf16)
    cpu = price(replace(plan, host_compute="cpu", expert_slots=()), model)
    assert [d.terms["expert_cache"] for d in cpu.devices] == [0, 0]
    for i, d in enumerate(cpu.devices):
        away = [t for t in model.tensors if is_expert(t.name) and t.layer in host_layers[i]]
        want = {t.name: t.n_elements * {"Q4_K": 5 / 8, "Q6_K": 2}[type_name(t.ggml_type)]
                for t in away}
        assert d.terms["host_experts"] == sum(want.values())
        held = {s.name: s for a in d.host_arenas for s in a.spans}
        assert {n: held[n].nbytes for n in want} == want
        assert d.host == sum(a.nbytes for a in d.host_arenas) == sum(
            align_up(n) for n in want.values()) + sum(align_up(b.nbytes) for b in chunk_bufs)
    # both: the staging span for prefill, the file's bytes, and beside them the CPU's layouts
    both = price(replace(plan, host_compute="both", expert_slots=()), model)
    for i, (d, dc) in enumerate(zip(both.devices, cpu.devices, strict=True)):
        away = [t for t in model.tensors if is_expert(t.name) and t.layer in host_layers[i]]
        held = {s.name: s for a in d.host_arenas for s in a.spans}
        assert {n for n in held if not n.startswith("hbuf.")} == {t.name for t in away} | {
            "cpu." + t.name for t in away}
        assert all(held[t.name].nbytes == t.nbytes for t in away)
        assert all(held["cpu." + t.name].nbytes == dc.span(t.name)[1].nbytes for t in away)
        assert d.terms["host_experts"] == dc.terms["host_experts"] + sum(t.nbytes for t in away)
        assert d.terms["expert_cache"] == layout.devices[i].span("expert_stream")[1].nbytes
    for where in ("cpu", "both"):
        with pytest.raises(CarveError, match="^--expert-slots: the slots feed decode's host "
                           f"experts to the GPU's kernels, and with --host-compute {where} the "
                           "CPU computes them"):
            replace(plan, host_compute=where)
    with pytest.raises(CarveError, match="--host-compute: unknown 'tpu'; use gpu, cpu or both"):
        replace(plan, host_compute="tpu")
    again = Layout.from_json(json.loads(json.dumps(layout.to_json())))
    assert again.host == layout.host and again.devices[1].host == layout.devices[1].host


@pytest.mark.skipif(not native.available(), reason="no C compiler to build the native kernel")
def test_both_keeps_no_cpu_layout_where_the_native_kernel_reads_the_file(synth_model,
                                                                         monkeypatch) -> None:
    """qwen3moe-tiny's Q4_K / Q6_K experts (widths of whole 256s): where this machine runs the
    CPU's native kernel, "both" pins the host layers' file bytes alone, as "gpu" does, plus
    the CPU's transfer buffers; with CARVE_NATIVE=0 the CPU's layouts beside them. A layer
    of a type the kernel does not read is not covered."""
    model = GGUFModel.open(synth_model("qwen3moe-tiny"))
    plan = Plan("m", (gpu(0, 4000),), (0, 4), ctx=256, act_dtype="bf16", host=HOST,
                experts_resident=(1,))
    away = {t.name for t in model.tensors if is_expert(t.name) and t.layer >= 1}
    types = {type_name(model.tensor(n).ggml_type) for n in away}
    assert types <= {"Q4_K", "Q6_K"} and "Q4_K" in types

    def pinned(where: str) -> tuple[set[str], int, int]:
        d = price(replace(plan, host_compute=where), model).devices[0]
        held = {s.name for a in d.host_arenas for s in a.spans if not s.name.startswith("hbuf.")}
        return held, d.terms["host_experts"], d.host

    gpu_held, gpu_experts, gpu_host = pinned("gpu")
    held, experts, host = pinned("both")
    assert held == gpu_held == away and experts == gpu_experts
    assert host == gpu_host  # ("gpu" prices the CPU's buffers too: its fallback runs there)
    monkeypatch.setenv("CARVE_NATIVE", "0")
    held, experts, _ = pinned("both")
    assert held == away | {"cpu." + n for n in away} and experts > 2 * gpu_experts
    monkeypatch.delenv("CARVE_NATIVE")
    idx = model_index(model)
    reqs = [r for r in idx.layer_requests[1] if is_expert(r[0])]
    assert native_covers(idx, reqs)
    assert native_covers(replace(idx, hp=replace(idx.hp, swiglu_limit=7.0)), reqs)  # gpt-oss's
    assert native_covers(idx, [(n, b, "IQ4_XS" if "gate" in n else dt, shape)
                               for n, b, dt, shape in reqs])  # IQ4_XS and Q4_K: per 256
    assert not native_covers(idx, [(n, b, "TQ1_0" if "gate" in n else dt, shape)
                                   for n, b, dt, shape in reqs])  # a type it does not read
    assert not native_covers(idx, [r for r in reqs if "down" not in r[0]])


def test_both_copies_only_layers_whose_every_matrix_has_a_cpu_layout(synth_model,
                                                                    monkeypatch) -> None:
    """gpt-oss's MXFP4 experts (and their biases) have no CPU layout: "both" keeps the file's
    bytes alone (the CPU's native kernel reads them there, or the GPU takes those layers'
    decode rows), "cpu" the file's bytes too."""
    model = GGUFModel.open(synth_model("gpt-oss-tiny", "mxfp4_moe"))
    base = Plan("m", (gpu(0, 4000),), (0, 4), ctx=256, act_dtype="bf16", host=HOST,
                experts_resident=(2,))
    away = [t for t in model.tensors if is_expert(t.name) and t.layer >= 2]
    assert away and all(type_name(t.ggml_type) in ("MXFP4", "F32") for t in away)
    for where in ("gpu", "cpu", "both"):
        d = price(replace(base, host_compute=where), model).devices[0]
        held = {s.name for a in d.host_arenas for s in a.spans if not s.name.startswith("hbuf.")}
        assert held == {t.name for t in away}
        assert d.terms["host_experts"] == sum(t.nbytes for t in away)
    # the CPU's native kernel reads MXFP4 (and the biases, the clamp): Auto splits gpt-oss's
    # decode too where it is built, on the same bytes
    auto = default_plan(model, [gpu(0, 4000)], ctx=256, host=HOST, experts_resident=(2,))
    assert auto.host_compute == ("both" if native.available() else "gpu")
    monkeypatch.setenv("CARVE_NATIVE", "0")
    assert default_plan(model, [gpu(0, 4000)], ctx=256, host=HOST,
                        experts_resident=(2,)).host_compute == "gpu"
    # every expert in VRAM: nothing in host memory to run, "gpu"
    monkeypatch.delenv("CARVE_NATIVE")
    assert default_plan(model, [gpu(0, 4000)], ctx=256, host=HOST).host_compute == "gpu"
    assert default_plan(model, [gpu(0, 4000)], ctx=256, host=HOST, experts_resident=(2,),
                        expert_slots=(4,)).host_compute == "gpu"  # slots feed the GPU


def test_host_ram_shortfall_is_one_sentence_and_the_bottleneck(synth_model, capsys) -> None:
    path = str(synth_model("qwen3moe-tiny"))
    model = GGUFModel.open(path)
    small = DeviceSpec(-1, "host", GIB, MIB, simulated=True)
    plan = Plan("m", (gpu(0, 4000),), (0, 4), ctx=256, act_dtype="bf16", host=small,
                experts_resident=(0,))
    layout = price(plan, model)
    h = layout.host
    assert layout.devices[0].verdict.runs and h.verdict == Verdict.DOES_NOT_FIT
    assert layout.verdict == Verdict.DOES_NOT_FIT and not layout.fits
    pinned = h.pinned / MIB
    over = (h.pinned - MIB) / MIB
    assert h.advice == (
        f"host RAM: over by {over:.1f} MiB: {pinned:.1f} MiB of experts and buffers pinned in "
        "host memory do not fit in 1.0 MiB available; keep more layers' experts in VRAM "
        "(--experts-resident), add a GPU or free memory")
    assert layout.bottleneck() == f"does not fit: the bottleneck is host RAM (over by {over:.1f} MiB)"
    code = plan_main(["plan", path, "--gpus", "4GiB", "--experts-resident", "0",
                      "--host-ram", "1MiB"])
    out = capsys.readouterr().out
    assert code == 1
    assert h.advice in out and out.rstrip().endswith(layout.bottleneck())
    assert "GPU 0: experts of 0 of its 4 MoE layers in VRAM (its first), 4 in host memory" in out


QWEN30 = SHAPES["qwen3moe-30b-a3b"]


def test_auto_places_experts_on_the_host_when_vram_does_not_hold_them() -> None:
    """qwen3moe-30b-a3b (Q4_K_M, from its tensor table, no file) on a 12 GiB card: all in VRAM
    does not fit; Auto keeps the most layers' experts in VRAM that leave the cache reserve, the
    rest pinned in host RAM; on a 24 GiB card nothing moves."""
    model = HeaderModel(QWEN30)
    card = DeviceSpec(0, "12 GiB (simulated)", 12 * GIB, 12 * GIB - 615 * MIB, simulated=True)
    everything = price(Plan("m", (card,), (0, 48), ctx=4096, act_dtype="bf16", host=HOST), model)
    assert everything.devices[0].verdict == Verdict.DOES_NOT_FIT
    assert "VRAM of GPU 0" in everything.bottleneck()
    # the advice names the placement that fits, and host RAM can take the rest
    idx = model_index(model)
    free = card.free - card.reserve
    most = max(r for r in range(48) if stage_need(idx, stage_key(everything.plan, 0, resident=r))
               <= free)
    advice = everything.devices[0].advice
    assert f"fits with --experts-resident {most} (GPU 0 keeps {most} of its 48 MoE layers' " \
        "experts in VRAM, " in advice and "pinned in host RAM of 48.00 GiB available)" in advice
    plan = default_plan(model, [card], host=HOST)
    (r,) = plan.experts_resident
    avail = card.free - card.reserve
    need = [stage_need(idx, stage_key(plan, 0, resident=n)) for n in (r, r + 1)]
    assert need[0] + plan.cache_reserve <= avail < need[1] + plan.cache_reserve
    layout = price(plan, model)
    assert layout.fits and layout.devices[0].verdict == Verdict.FITS
    host_layers = range(r, 48)
    assert layout.devices[0].terms["host_experts"] == sum(
        t.nbytes for t in model.tensors if is_expert(t.name) and t.layer in host_layers)
    big = DeviceSpec(0, "24 GiB (simulated)", 24 * GIB, 24 * GIB - 615 * MIB, simulated=True)
    assert default_plan(model, [big], host=HOST).experts_resident == ()
    # host RAM that cannot take them: the plan stays as asked and the bill says why
    tiny = DeviceSpec(-1, "host", 4 * GIB, 4 * GIB, simulated=True)
    assert default_plan(model, [card], host=tiny).experts_resident == ()


def test_the_plan_says_what_the_cache_reserve_costs_in_resident_layers() -> None:
    """Auto on a 16 GiB card keeps the most layers' experts that leave the cache reserve free;
    the host lines say how many more would stay in VRAM with no reserve, and the PCIe bytes a
    token saves. No such line when the count was asked for, or when nothing is reserved."""
    from app.cli_plan import host_lines
    from engine.planning.stage import decode_pcie_bytes

    model = HeaderModel(QWEN30)
    card = DeviceSpec(0, "16 GiB (simulated)", 16 * GIB, 16 * GIB - 615 * MIB, simulated=True)
    plan = default_plan(model, [card], host=HOST)
    (r,) = plan.experts_resident
    idx = model_index(model)
    free = card.free - card.reserve
    most = max(n for n in range(49) if stage_need(idx, stage_key(plan, 0, resident=n)) <= free)
    assert r < most < 48
    saved = (decode_pcie_bytes(idx, stage_key(plan, 0))
             - decode_pcie_bytes(idx, stage_key(plan, 0, resident=most)))
    lines = host_lines(price(plan, model), model)
    (note,) = [x for x in lines if "cache reserve" in x]
    assert f"holds {most - r} MoE layers' experts out of VRAM: --cache-reserve 0 would keep " \
        f"{most} of 48 there, {human(saved)} less over PCIe per token" in note
    for other in (replace(plan, experts_resident=(r - 1,)), replace(plan, cache_reserve=0)):
        assert not [x for x in host_lines(price(other, model), model) if "cache reserve" in x]


def test_carve_plan_json_and_text_show_the_host_line_and_cache(synth_model, capsys) -> None:
    path = str(synth_model("qwen3moe-tiny"))
    args = ["plan", path, "--gpus", "2x4GiB", "--split", "0,2,4", "--experts-resident", "2,1",
            "--expert-slots", "5", "--host-ram", "2GiB"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "expert cache" in out and "pinned on host" in out
    assert "host RAM: " in out and "of 2.00 GiB stated" in out
    assert plan_main([*args, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["plan"]["experts_resident"] == [2, 1] and data["plan"]["expert_slots"] == [5, 5]
    assert data["host"]["device"]["total"] == 2 * GIB
    assert data["devices"][0]["host"] == 0 and data["devices"][1]["host"] > 0
    assert data["host"]["pinned"] == data["devices"][1]["host"]
    assert all(d["terms"]["expert_cache"] > 0 for d in data["devices"])
    assert plan_main(["plan", path, "--experts-resident", "x"]) == 2
    assert "--experts-resident: cannot read 'x'" in capsys.readouterr().err


def test_decode_reads_its_routed_host_experts_over_pcie_and_the_plan_says_so(synth_model,
                                                                             capsys) -> None:
    """A GPU stage whose host experts the GPU computes reads, per decode token, k of each
    host layer's experts over PCIe (weights and biases, the file's bytes); one whose CPU
    computes them reads none. `carve plan` says so per GPU, with the most tokens/s that
    allows where the link's rate is known, and says the rate is unknown on a stated card."""
    from app.cli_plan import pcie_line
    from engine.planning.host import PCIE_SHARE
    from engine.planning.stage import decode_pcie_bytes

    path = str(synth_model("qwen3moe-tiny"))
    model = GGUFModel.open(path)
    idx = model_index(model)
    hp = idx.hp
    pl = Plan(model=path, devices=(gpu(0, 4096),), split=(0, 4), ctx=256,
              experts_resident=(1,), host=HOST)
    moe = idx.moe_layers(0, 4)
    host = moe[1:]
    want = sum(t.nbytes for t in model.tensors if t.layer in host and is_expert(t.name)
               ) // hp.n_expert * hp.n_expert_used
    assert want > 0 and decode_pcie_bytes(idx, stage_key(pl, 0)) == want
    assert decode_pcie_bytes(idx, stage_key(replace(pl, host_compute="cpu"), 0)) == 0
    # "both": at most what "gpu" reads (the CPU's share of each row, timed at load, reads none)
    both = stage_key(replace(pl, host_compute="both", expert_slots=()), 0)
    assert decode_pcie_bytes(idx, both) == want
    assert f"decode reads up to {human(want)} of experts per token from host memory over PCIe " \
           "(less the experts the CPU takes, timed at load)" in pcie_line(gpu(0, 4096), want, True)
    assert decode_pcie_bytes(idx, stage_key(replace(pl, experts_resident=(len(moe),)), 0)) == 0
    card = gpu(0, 4096)
    assert pcie_line(card, 0) == ""
    assert pcie_line(card, want).endswith("over PCIe (the link's rate is not known here)")
    fast = replace(card, pcie_gbps=63.0)
    line = pcie_line(fast, 100_000_000)
    rate = 63.0 * PCIE_SHARE
    assert f"at most ~{rate * 10:.0f} tokens/s" in line and "of its 63 GB/s link" in line
    assert plan_main(["plan", path, "--gpus", "4GiB", "--experts-resident", "1",
                      "--host-ram", "2GiB"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0: decode reads " in out and "of experts per token from host memory" in out
    # --host-compute auto (the default): both where the CPU's native kernel reads the experts
    assert ("split for decode between the CPU" if native.available()
            else "read by the GPU over PCIe when routed") in out
    assert plan_main(["plan", path, "--gpus", "4GiB", "--experts-resident", "1",
                      "--host-ram", "2GiB", "--host-compute", "gpu"]) == 0
    assert "read by the GPU over PCIe when routed" in capsys.readouterr().out
    assert plan_main(["plan", path, "--gpus", "4GiB", "--experts-resident", "1",
                      "--host-ram", "2GiB", "--host-compute", "cpu"]) == 0
    assert "decode reads" not in capsys.readouterr().out

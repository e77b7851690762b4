"""The plan-time capability check: the runner tables equal what the kernels run, and a plan
whose runner has no kernel for a tensor type is "does not run here" with the reason, in
pricing and in the engine, before anything is allocated."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.gguf.reader import GGUFModel
from engine.gguf.writer import GGUFSink, tensor_bytes
from engine.hardware.devices import DeviceSpec
from engine.planning.capability import runner_for
from engine.planning.carve import model_index
from engine.planning.defaults import default_plan
from engine.planning.price import price
from engine.planning.rules import Verdict
from engine.synth.contents import metadata, tensor_table
from engine.synth.gen import tensor_types
from engine.synth.header import HeaderModel
from engine.synth.shapes import SHAPES
from spec import quant_types as qt
from spec.errors import CarveError
from spec.runners import ARCHS, TORCH, TRITON

GIB = 1 << 30
ODD = "blk.2.ffn_down.weight"  # [n_ff = 512, n_embd]: a whole number of 256-blocks per row
# a type the CPU engine runs and the GPU runner does not (as a matrix); one that no runner runs
CPU_ONLY = min(TORCH.types - TRITON.types)
NOWHERE = qt.BY_NAME["tq2_0"]


def gpu(index: int = 0, free: int = 8 * GIB) -> DeviceSpec:
    return DeviceSpec(index=index, name="sim", total=free + GIB, free=free, simulated=True)


def cpu() -> DeviceSpec:
    return DeviceSpec(index=-1, name="cpu", total=64 * GIB, free=64 * GIB)


def write_with(path: Path, odd: dict[str, int], shape: str = "qwen2-tiny",
               extra: tuple[tuple[str, tuple[int, ...]], ...] = ()) -> Path:
    """A tiny q4_k_m model whose tensors named in ``odd`` have the given types, plus F32
    tensors ``extra`` (random bytes: planning reads the header, and the engine must refuse
    before it reads any data)."""
    sh = SHAPES[shape]
    types = {**tensor_types(sh, "q4_k_m"), **odd, **{n: qt.F32 for n, _ in extra}}
    table = tensor_table(sh) + list(extra)
    rng = np.random.default_rng(0)
    sink = GGUFSink(metadata(sh, "q4_k_m"), [(n, d, types[n]) for n, d in table], [path])
    sink.write(lambda name, t, nbytes: [rng.integers(0, 255, nbytes, dtype=np.uint8).tobytes()])
    assert tensor_bytes(types[ODD], dict(table)[ODD]) > 0
    return path


def test_the_tables_are_what_the_kernels_run() -> None:
    from carve_kernels.dequant import SUPPORTED_TYPES
    from carve_kernels.quant_blocks import PLANS
    from engine.runtime.models import FAMILIES

    assert set(PLANS) == TRITON.types
    assert set(SUPPORTED_TYPES) == TORCH.types
    assert set(ARCHS) == set(FAMILIES)


def test_a_supported_file_runs_on_both_runners() -> None:
    m = HeaderModel(SHAPES["qwen2-7b"], "q4_k_m")
    for devices in ([gpu(0, 140 * GIB)], [cpu()]):
        layout = price(default_plan(m, devices), m)
        assert layout.verdict == Verdict.FITS and layout.fits
        assert all(d.advice == "" for d in layout.devices)


def test_a_7b_f32_file_does_not_run_on_one_gpu() -> None:
    m = HeaderModel(SHAPES["qwen2-7b"], "f32")
    layout = price(default_plan(m, [gpu(0, 140 * GIB)]), m)
    assert not layout.fits and layout.verdict == Verdict.DOES_NOT_RUN
    (d,) = layout.devices
    assert d.headroom > 0  # the memory fits; the runner does not
    assert re.fullmatch(
        r"F32 \(blk\.0\.attn_q\.weight and \d+ more\) has no GPU kernel: run on the CPU "
        r"engine \(--gpus cpu\) or use a file without it",
        d.advice,
    ), d.advice


@pytest.mark.parametrize("mix", ["iq3_s", "iq4_xs", "iq2_xxs", "q2_k", "iq1_m"])
def test_a_7b_low_bit_file_runs_on_one_gpu(mix) -> None:
    # the issue's defect: a 7B IQ3_S-mix file planned as "fits", then the launch found no
    # GPU kernel for IQ4_XS
    m = HeaderModel(SHAPES["qwen2-7b"], mix)
    layout = price(default_plan(m, [gpu(0, 140 * GIB)]), m)
    assert layout.fits and layout.devices[0].advice == "", layout.devices[0].advice


def test_only_the_device_holding_the_type_is_refused(tmp_path) -> None:
    path = write_with(tmp_path / "odd.gguf", {ODD: CPU_ONLY})
    m = GGUFModel.open(path)
    name = qt.type_name(CPU_ONLY)
    layout = price(default_plan(m, [gpu(0), gpu(1)], split=(0, 2, 4)), m)
    assert [d.verdict for d in layout.devices] == [Verdict.FITS, Verdict.DOES_NOT_RUN]
    assert layout.verdict == Verdict.DOES_NOT_RUN and not layout.fits
    assert layout.devices[1].advice == (
        f"{name} ({ODD}) has no GPU kernel: run on the CPU engine (--gpus cpu) or use a file "
        "without it"
    )
    # the CPU engine runs it
    on_cpu = price(default_plan(m, [cpu()]), m)
    assert on_cpu.fits and on_cpu.devices[0].advice == ""
    # as does the torch engine on the same GPUs, when the engine runs that one
    assert price(default_plan(m, [gpu(0), gpu(1)], split=(0, 2, 4)), m, TORCH).fits


def test_a_type_no_runner_runs_and_several_types_in_one_reason(tmp_path) -> None:
    path = write_with(
        tmp_path / "odd.gguf", {ODD: NOWHERE, "blk.1.ffn_down.weight": NOWHERE,
                                "blk.3.ffn_down.weight": CPU_ONLY}
    )
    m = GGUFModel.open(path)
    (d,) = price(default_plan(m, [cpu()]), m).devices
    assert d.verdict == Verdict.DOES_NOT_RUN
    assert d.advice == (
        "TQ2_0 (blk.1.ffn_down.weight and 1 more) has no dequantizer in the CPU engine: "
        "no runner of this Carve runs it; use a file without it"
    )
    (g,) = price(default_plan(m, [gpu(0)]), m).devices
    assert g.advice.startswith("TQ2_0 (blk.1.ffn_down.weight and 1 more) has no GPU kernel: no ")
    assert f"; {qt.type_name(CPU_ONLY)} (blk.3.ffn_down.weight) has no GPU kernel: run on" in (
        g.advice)


def test_vectors_and_routers_the_gpu_reads_as_f32_are_checked_at_plan_time(tmp_path) -> None:
    """The Triton runner reads norms, biases and expert routers as F32 where they lie: an F16
    router (an older Mixtral conversion) or norm is a plan-time verdict naming them, not a
    load error after "fits"; the CPU engine runs them. RoPE factors it reads on the host."""
    odd = {"blk.0.ffn_gate_inp.weight": qt.F16, "blk.1.ffn_gate_inp.weight": qt.F16,
           "blk.2.attn_norm.weight": qt.BF16, "rope_freqs.weight": qt.F16}
    sh = SHAPES["mixtral-tiny"]
    types = {**tensor_types(sh, "q8_0"), **odd}
    table = tensor_table(sh) + [("rope_freqs.weight", (sh.hd // 2,))]
    path = tmp_path / "f16-router.gguf"
    rng = np.random.default_rng(0)
    GGUFSink(metadata(sh, "q8_0"), [(n, d, types[n]) for n, d in table], [path]).write(
        lambda name, t, nbytes: [rng.integers(0, 255, nbytes, dtype=np.uint8).tobytes()])
    m = GGUFModel.open(path)
    devices = price(default_plan(m, [gpu(0), gpu(1)], split=(0, 1, 4)), m).devices
    assert [d.verdict for d in devices] == [Verdict.DOES_NOT_RUN] * 2
    assert devices[0].advice == (
        "F16 (blk.0.ffn_gate_inp.weight) where the GPU runner reads F32 (norms, biases, "
        "routers): run on the CPU engine (--gpus cpu) or use a file without it")
    assert devices[1].advice.startswith("F16 (blk.1.ffn_gate_inp.weight) where the GPU")
    assert "; BF16 (blk.2.attn_norm.weight) where the GPU runner reads F32" in devices[1].advice
    assert price(default_plan(m, [cpu()]), m).fits


def test_the_runner_rule_is_the_engines(tmp_path, monkeypatch) -> None:
    from engine.gguf.hparams import HParams
    from engine.runtime.gpu.session import why_not

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    plain = write_with(tmp_path / "plain.gguf", {}, "llama-tiny")
    # llama-3.1-style RoPE factors: the GPU runner runs them too (test_rope_factors.py)
    factors = write_with(tmp_path / "rope.gguf", {}, "llama-tiny", (("rope_freqs.weight", (32,)),))
    seen = set()
    for path in (plain, factors):
        m = GGUFModel.open(path)
        hp = HParams.from_model(m)
        for devices in ([gpu(0)], [gpu(0), gpu(1)], [cpu()]):
            plan = default_plan(m, devices, model_path=str(path))
            expected = TRITON if why_not(plan, hp) is None else TORCH
            assert runner_for(plan, model_index(m)) is expected
            seen.add((path, len(devices), expected))
    assert (factors, 1, TRITON) in seen and (plain, 1, TRITON) in seen


def test_the_engine_refuses_before_allocating(tmp_path, monkeypatch) -> None:
    import engine.runtime.gpu.session as gpu_session
    import engine.runtime.session as session
    from engine.runtime.options import RunnerOptions

    def allocated(*_a, **_k):
        raise AssertionError("allocated before refusing")

    monkeypatch.setattr(session, "load_layout", allocated)
    monkeypatch.setattr(gpu_session, "GpuPipeline", allocated)
    path = write_with(tmp_path / "odd.gguf", {ODD: NOWHERE})
    m = GGUFModel.open(path)
    with pytest.raises(CarveError) as e:  # the torch engine
        session.Session.load(default_plan(m, [cpu()], model_path=str(path)))
    assert str(e.value).startswith("CPU: the plan does not run here (TQ2_0 (blk.2.ffn_down")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    path = write_with(tmp_path / "gpu.gguf", {ODD: CPU_ONLY})
    plan = default_plan(GGUFModel.open(path), [gpu(0)], model_path=str(path))
    with pytest.raises(CarveError) as e:  # the GPU runner
        session.Session.load(plan)
    assert str(e.value).startswith(
        f"GPU 0: the plan does not run here ({qt.type_name(CPU_ONLY)} ({ODD}) has no GPU kernel"
    )
    # the torch engine runs that file on the same GPU: no refusal, it goes on to allocate
    with pytest.raises(AssertionError, match="allocated before refusing"):
        session.Session.load(plan, options=RunnerOptions(runner="torch"))


def test_the_engine_process_answers_an_error_event_before_allocating(tmp_path, monkeypatch):
    import os
    import threading

    import engine.runtime.session as session
    from engine.process import protocol as p
    from engine.runtime import server

    monkeypatch.setattr(session, "load_layout", lambda *a, **k: pytest.fail("allocated"))
    path = write_with(tmp_path / "odd.gguf", {ODD: NOWHERE})
    plan = default_plan(GGUFModel.open(path), [cpu()], model_path=str(path))
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    engine = server.Engine(os.fdopen(out_w, "wb"))
    threading.Thread(target=engine.read_requests, args=(in_r,), daemon=True).start()
    worker = threading.Thread(target=engine.serve, daemon=True)
    worker.start()
    os.write(in_w, p.encode(p.Load(plan.to_json())))
    out, decoder, events = os.fdopen(out_r, "rb"), p.LineDecoder(p.EVENTS), []
    while not any(isinstance(e, p.Error) for e in events):
        chunk = out.read1(65536)
        assert chunk, "engine closed its output"
        events += decoder.feed(chunk)
    os.close(in_w)  # EOF: the engine ends
    worker.join(10)
    assert not worker.is_alive()
    (err,) = [e for e in events if isinstance(e, p.Error)]
    assert not err.fatal and err.message.startswith(
        "CPU: the plan does not run here (TQ2_0 (blk.2.ffn_down.weight) has no dequantizer"
    )
    assert not any(isinstance(e, (p.Progress, p.Loaded)) for e in events)

"""A decode step recorded for `carve bench --trace` (carve_kernels/trace.py): every launch of
the instrumented kernels gets its rows, and every program of each reaches every stamp (a kernel
whose programs returned early, or a grid counted wrong, would leave rows unstamped, and the
GPU's trace would then drop that launch from its timeline). Under the interpreter the stamps
are the points' numbers, not times; the GPU's timers are compiled in tests/kernels/
test_trace.py and read on a GPU by the bench."""

from __future__ import annotations

import pytest
import torch
from test_gpu_moe import SHAPES
from test_gpu_moe import plan as moe_plan

from carve_kernels import trace
from engine.runtime import step_trace
from engine.runtime.gpu.session import GpuSession
from engine.runtime.options import RunnerOptions
from engine.synth.gen import write_model
from engine.synth.shapes import Shape

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CPU = torch.device("cpu")


def recorded_step(path: str, options: RunnerOptions = RunnerOptions(),
                  **plan_kw) -> list[trace.Launch]:
    """The launches of one decode step after a 6-token prefill, as a recording reads them."""
    g = GpuSession.load(moe_plan(path, prefill_chunk=8, logits_rows=1, **plan_kw),
                        devices=[CPU], remember=False, options=options)
    try:
        g.forward([5, 9, 11, 3, 7, 8], 0, "last")
        g.pipe.set_position(6, 4)
        (st,) = g.pipe.stages
        with trace.recording(CPU, 1 << 16) as rec:
            st.decode_step()
        return trace.launches(rec)
    finally:
        g.close()


def assert_every_program_stamped(timeline: list[trace.Launch]) -> set[str]:
    assert timeline
    unstamped = sorted({la.name for la in timeline if la.programs < 0})
    assert not unstamped, f"launches with programs that missed a stamp: {unstamped}"
    # the interpreter's stamps are the points' numbers: each phase one step long
    for la in timeline:
        assert la.phases == pytest.approx(dict.fromkeys(trace.PHASES, 1e-3)), la.name
    return {la.name for la in timeline}


def test_a_dense_decode_step_stamps_every_program_of_every_launch(tmp_path) -> None:
    shape = Shape("qwen2", 2, 256, 4, 2, 512, 320, n_ctx=512)
    (path,) = write_model(tmp_path / "dense.gguf", shape, "q4_k_m")
    # the matrices in GGUF order (nothing in the dequant cache), then in the T layout (each
    # with its dequant-cache copy, as the GPU runner repacks them)
    names = assert_every_program_stamped(recorded_step(str(path)))
    assert {"rmsnorm", "gemv3", "attention_decode", "gemv", "gemv_glu", "sample_topk",
            "sample_pick"} <= names
    names = assert_every_program_stamped(recorded_step(str(path), cache_reserve=0))
    assert {"rmsnorm", "gemv_t3", "attention_decode", "gemv_t_glu", "gemv_t", "sample_topk",
            "sample_pick"} <= names


def test_a_moe_decode_step_stamps_every_program_of_every_launch(tmp_path) -> None:
    (path,) = write_model(tmp_path / "moe.gguf", SHAPES["qwen3moe"], "q4_k_m")
    names = assert_every_program_stamped(recorded_step(str(path)))
    assert {"norm_router", "route", "expert_glu_q8", "expert_down_q8"} <= names


def test_the_bench_trace_of_a_cpu_stage_reads_its_launches(tmp_path, capsys) -> None:
    """`step_trace.trace_step`, as `carve bench --trace` runs it after the bench, on a stage
    under the interpreter: its eager step recorded (no graph, no times), every launch stamped,
    the per-kernel table and the timeline printed."""
    (path,) = write_model(tmp_path / "moe.gguf", SHAPES["qwen3moe"], "q4_k_m")
    g = GpuSession.load(moe_plan(str(path), prefill_chunk=8, logits_rows=1), devices=[CPU],
                        remember=False)
    try:
        g.forward([5, 9, 11, 3], 0, "last")
        (s,) = step_trace.trace_step(g.pipe, position=4)
    finally:
        g.close()
    assert s["stage"] == "cpu" and s["unstamped"] == [] and s["launches"] == len(s["timeline"])
    kernels = {k["name"]: k for k in s["kernels"]}
    assert kernels["expert_glu_q8"]["calls"] == 2  # both layers route
    assert kernels["rmsnorm"]["calls"] >= 2
    step_trace.print_trace([s])
    out = capsys.readouterr().out
    assert "trace cpu: a decode step of" in out and "expert_down_q8" in out


def test_a_latent_attention_decode_step_stamps_every_program_of_every_launch(tmp_path) -> None:
    """deepseek2: the latent path's per-head matrices and attention (its split-K decode and
    merge) stamp too."""
    (path,) = write_model(tmp_path / "ds.gguf", SHAPES["deepseek2"], "q4_k_m")
    names = assert_every_program_stamped(recorded_step(str(path)))
    assert {"head_matmul", "latent_attention", "norm_router", "route"} <= names

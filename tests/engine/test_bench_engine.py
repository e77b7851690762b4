"""`carve bench --engine`'s harness (engine/runtime/bench_engine.py) through a real engine
process: on the CPU engine here, the same code measures the GPU runner on a GPU machine."""

from __future__ import annotations

from engine.hardware.devices import cpu_spec
from engine.planning.plan import Plan
from engine.runtime import bench_engine
from engine.synth.gen import write_model
from engine.synth.shapes import Shape

TINY = Shape("qwen2", 2, 128, 2, 1, 256, 320, n_ctx=512)


def test_engine_bench_reports_load_stages_replies_and_ratios(tmp_path, capsys) -> None:
    path = str(write_model(tmp_path / "tiny.gguf", TINY, "q4_k_m")[0])
    plan = Plan(model=path, devices=(cpu_spec(),), split=(0, 2), ctx=256, prefill_chunk=64,
                cache_reserve=0, act_dtype="f32")
    out = bench_engine.run(plan, replies=2, sampled=1, max_tokens=5, timeout=120, followups=1)
    assert out["launch_to_loaded_s"] >= out["loaded_s"] > 0
    assert out["stages"] and all(v >= 0 for v in out["stages"].values())
    assert len(out["greedy"]) == 2 and len(out["sampled"]) == 1
    for r in out["greedy"] + out["sampled"]:
        assert r["prompt_tokens"] > 30 and 1 <= r["tokens"] <= 5
        assert r["ttft_s"] > 0 and r["prefill_tps"] > 0
    # the next turn: its conversation's first reply, an answer and a new user line after it
    (f,) = out["followup"]
    assert f["prompt_tokens"] > out["greedy"][0]["prompt_tokens"] and f["ttft_s"] > 0
    assert bench_engine.summary(out)["followup_ttft_s"] == f["ttft_s"]
    bench_engine.print_report(out, pipeline_tps=100.0)
    text = capsys.readouterr().out
    assert "launch -> loaded" in text and "engine / pipeline" in text and "first / last" in text
    assert "next short turn" in text

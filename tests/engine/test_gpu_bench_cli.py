"""`carve bench` runs the engine in a child process: app never imports torch, and on a
machine without a GPU the user gets one line and exit status 2."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch


def test_cli_bench_does_not_import_torch():
    code = "import sys, app.cli_bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_bench_without_gpu_says_so_and_exits_2():
    out = subprocess.run([sys.executable, "-m", "app", "bench", "--synth", "qwen2-tiny"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("carve: ") and "GPU" in lines[0]


def test_bench_of_a_torch_engine_model_asks_for_the_engine_process(synth_model, monkeypatch,
                                                                    capsys):
    # a MoE file with 48-wide heads runs on the torch engine: there is no Triton pipeline to
    # measure, so without --engine the bench says so in one line (a GPU is faked: only the plan
    # is made)
    from engine.runtime import bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i=0: (80 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "NVIDIA H200")
    assert bench.main([str(synth_model("qwen3moe-h48-tiny")), "--depths", ""]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs on the torch engine" in err[0] and "--engine" in err[0]

"""`carve plan` as a user runs it: output, exit codes, one-line errors, and no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from app.cli_plan import main

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m app plan ...` in a child process, asserting torch never got imported."""
    code = (
        "import sys; from app.__main__ import main; rc = main(sys.argv[1:]); "
        "assert 'torch' not in sys.modules, 'torch imported'; "
        "assert not any(m.startswith('PySide6') for m in sys.modules), 'Qt imported'; sys.exit(rc)"
    )
    return subprocess.run(
        [sys.executable, "-c", code, "plan", *args],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def tiny(synth_model: Any) -> str:
    return str(synth_model("llama"))


def test_table_for_a_simulated_rig(tiny: str) -> None:
    r = run(tiny, "--gpus", "2x4GiB", "--ctx", "1024", "--split", "0,2,4", "--kv", "q8_0")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "split 0,2,4" in out and "layers" in out
    for label in (
        "weights",
        "globals",
        "KV cache",
        "buffers",
        "dequant cache",
        "overhead",
        "rounding",
        "total",
        "free (idle card)",
        "headroom",
        "verdict",
    ):
        assert f"\n{label} " in out, label
    assert out.count("GPU 0") == 1 and "GPU 1" in out and out.rstrip().endswith("fits")
    assert "torch" not in r.stderr


def test_no_gpu_here_plans_for_the_cpu_and_says_so(tiny: str) -> None:
    # this machine has no NVIDIA driver; hide any the test machine might have
    r = run(
        tiny, "--ctx", "512", env={"LD_LIBRARY_PATH": "/nonexistent", "CUDA_VISIBLE_DEVICES": ""}
    )
    if "no NVIDIA GPU found" not in r.stdout:
        pytest.skip("this machine has an NVIDIA driver")
    assert r.returncode == 0, r.stderr
    assert "planning for cpu" in r.stdout and "CPU" in r.stdout


def test_json_is_the_layout(tiny: str) -> None:
    r = run(tiny, "--gpus", "rtx4090,a6000", "--ctx", "512", "--json", "--arena", "per-tensor",
            "--prefer", "spread")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [d["device"]["name"] for d in data["devices"]] == [
        "NVIDIA GeForce RTX 4090",
        "NVIDIA RTX A6000",
    ]
    assert data["plan"]["split"][-1] == 4 and data["plan"]["arena"] == "per-tensor"
    spans = [s for d in data["devices"] for a in d["arenas"] for s in a["spans"]]
    assert any(s[0] == "blk.0.attn_q.weight" for s in spans)


def test_auto_split_and_fewest(tiny: str, capsys: pytest.CaptureFixture[str]) -> None:
    r = run(tiny, "--gpus", "4x24GiB", "--ctx", "512", "--prefer", "fewest", "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)["devices"]) == 1
    # in process: auto, the default, keeps a model that fits on one GPU
    # there, on the card with the most room; spread uses every card
    for prefer, names in ((None, ["NVIDIA RTX A6000"]),
                          ("spread", ["NVIDIA GeForce RTX 4090", "NVIDIA RTX A6000"])):
        args = ["plan", tiny, "--gpus", "rtx4090,a6000", "--ctx", "512", "--json"]
        assert main(args + (["--prefer", prefer] if prefer else [])) == 0
        data = json.loads(capsys.readouterr().out)
        assert [d["device"]["name"] for d in data["devices"]] == names, prefer


def test_does_not_fit_exits_1_with_advice(tiny: str) -> None:
    # a 1 GiB card keeps 409 MiB after the driver: less than the 825 MiB runtime overhead
    r = run(tiny, "--gpus", "1GiB", "--ctx", "512")
    assert r.returncode == 1, r.stderr
    assert "does not fit" in r.stdout
    assert "GPU 0: over by" in r.stdout and "the runtime overhead" in r.stdout


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--gpus", "4x24GiBs"], "--gpus"),
        (["--split", "0,3,1"], "--split"),
        (["--split", "0,x"], "--split"),
        (["--split", "0,1,2", "--gpus", "1x24GiB"], "--split"),
        (["--ctx", "99999"], "--ctx"),
        (["--ctx", "abc"], "--ctx"),
        (["--kv", "q4"], "--kv"),
        (["--arena", "chunky"], "--arena"),
        (["--prefer", "most"], "--prefer"),
        (["--cache-reserve", "-1"], "--cache-reserve"),
        (["--bogus"], "unrecognized"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tiny: str, args: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["plan", tiny, *args])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("carve: ") and err.count("\n") == 1 and needle in err
    assert "Traceback" not in err


def test_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model at all")
    for path in (str(junk), str(tmp_path / "missing.gguf")):
        assert main(["plan", path, "--gpus", "1x24GiB"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("carve: ") and err.count("\n") == 1


def test_missing_model_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan"]) == 2
    assert capsys.readouterr().err.startswith("carve: plan: the following arguments are required")


def test_demo_model(demo_model_path: Path) -> None:
    r = run(str(demo_model_path), "--gpus", "rtx3060,rtx3060", "--ctx", "32768")
    assert r.returncode == 0, r.stderr
    # it fits on one 12 GiB card with 32k of context: auto keeps it there (no hop)
    assert "qwen2, 24 layers" in r.stdout and "GPU 0" in r.stdout and "GPU 1" not in r.stdout
    assert "it stays on GPU 0" in r.stdout and "--prefer spread" in r.stdout  # and says so


def test_a_type_the_runner_has_no_kernel_for_does_not_run(synth_model: Any) -> None:
    path = str(synth_model("qwen2", "f32"))
    r = run(path, "--gpus", "1x4GiB")
    assert r.returncode == 2, r.stderr
    lines = r.stdout.splitlines()
    assert lines[-1] == "does not run here"
    assert "GPU 0: F32 (blk.0.attn_q.weight and 28 more) has no GPU kernel: run on the CPU " \
        "engine (--gpus cpu) or use a file without it" in lines
    assert any(line.startswith("verdict") and line.endswith(" does not run here") for line in lines)
    r = run(path, "--gpus", "1x4GiB", "--json")
    assert r.returncode == 2, r.stderr
    out = json.loads(r.stdout)
    assert out["verdict"] == "does not run here"
    assert out["devices"][0]["advice"].startswith("F32 (blk.0.attn_q.weight and 28 more)")
    # the CPU engine runs it
    r = run(path, "--gpus", "cpu")
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[-1] == "fits"


def test_a_gpu_plan_names_its_runner(tiny: str, synth_model: Any) -> None:
    # the Triton kernels run the llama file and deepseek2's latent attention (experts in host
    # memory too); a MoE file with 48-wide heads runs on the torch engine, and the plan says so
    # (and refuses experts in host memory, which only the Triton runner computes)
    r = run(tiny, "--gpus", "1x4GiB", "--ctx", "1024")
    assert r.returncode == 0, r.stderr
    assert "runner: Triton GPU kernels" in r.stdout
    ds = str(synth_model("deepseek2-tiny"))
    for kv in ("f16", "q8_0"):
        r = run(ds, "--gpus", "1x4GiB", "--ctx", "1024", "--kv", kv, "--experts-resident", "0")
        assert r.returncode == 0, r.stdout
        assert "deepseek2, 4 layers" in r.stdout and "runner: Triton GPU kernels" in r.stdout
    odd = str(synth_model("qwen3moe-h48-tiny"))
    r = run(odd, "--gpus", "1x4GiB", "--ctx", "1024")
    assert r.returncode == 0, r.stderr
    assert "runner: the torch engine, on the GPU (" in r.stdout and "have 48" in r.stdout
    assert "runner" not in run(odd, "--gpus", "cpu", "--ctx", "1024").stdout
    r = run(odd, "--gpus", "1x4GiB", "--ctx", "1024", "--experts-resident", "0")
    assert r.returncode == 2, r.stdout
    assert "experts in host memory run on the Triton GPU runner" in r.stdout

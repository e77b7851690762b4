"""`carve` on a machine with no display plans in the terminal instead of letting Qt abort."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")}  # fmt: skip
    return subprocess.run([sys.executable, "-m", "app", *args], check=False, cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


def test_no_display_plans_the_model_in_the_terminal(synth_model):
    r = _run(["--model", str(synth_model("llama")), "--gpus", "2x24GiB"])
    assert r.returncode == 0, r.stderr
    assert "no display" in r.stderr and "planning in the terminal" in r.stderr
    # Auto keeps a model that fits on one GPU there (and says how to spread it)
    assert "GPU 0" in r.stdout and "verdict" in r.stdout and "--prefer spread" in r.stdout
    assert "Traceback" not in r.stderr


def test_no_display_with_a_bad_model_is_one_line_and_exit_2(tmp_path):
    bad = tmp_path / "not.gguf"
    bad.write_bytes(b"hello")
    r = _run(["--model", str(bad)])
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("carve: ") and "no display" not in ln]
    assert len(lines) == 1 and "not.gguf" in lines[0] and "Traceback" not in r.stderr

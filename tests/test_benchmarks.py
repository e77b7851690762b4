"""The lab cannot rot silently: every module in benchmarks/ imports, answers
``python -m benchmarks.NAME --help`` with exit 0 on a machine without a GPU, documents its command
line, and is listed in benchmarks/README.md (its shell scripts too); the GPU-only ones refuse
in one line without CUDA.

One child process runs every module as ``-m`` would (``runpy``, ``__main__``), so torch and triton
are imported once for all of them."""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(m.name for m in pkgutil.iter_modules([str(ROOT / "benchmarks")]))
GPU_ONLY = ("device_check", "device_check_moe", "gemv_profile")

CHILD = r"""
import contextlib, importlib, io, json, runpy, sys

def run(argv, call):
    out, err, code = io.StringIO(), io.StringIO(), None
    sys.argv = argv
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = call()
        except SystemExit as exc:
            code = exc.code
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}

modules, gpu_only = sys.argv[1].split(","), sys.argv[2].split(",")
report = {"help": {}, "no_gpu": {}}
for name in modules:
    mod = "benchmarks." + name
    report["help"][name] = run([mod, "--help"], lambda: runpy.run_module(mod, run_name="__main__"))
for name in gpu_only:
    main = importlib.import_module("benchmarks." + name).main
    report["no_gpu"][name] = run([name], lambda: main([]))
print(json.dumps(report))
"""


def _run_child() -> dict:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(MODULES), ",".join(GPU_ONLY)],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_every_benchmark_answers_help_without_a_gpu_and_gpu_ones_refuse_in_one_line():
    assert {"bench_cpu", "bench_price", "device_check", "gemv_profile"} <= set(MODULES)
    report = _run_child()
    for name in MODULES:
        r = report["help"][name]
        assert r["code"] in (0, None), f"{name} --help: exit {r['code']}\n{r['err'][-2000:]}"
        assert f"usage: python -m benchmarks.{name}" in r["out"], f"{name} --help: {r['out']!r}"
        assert f"python -m benchmarks.{name}" in _docstring(name), f"{name}'s docstring lacks its command line"
    for name in GPU_ONLY:
        r = report["no_gpu"][name]
        assert r["code"] == 2, f"{name} without CUDA: exit {r['code']}\n{r['err'][-2000:]}"
        lines = r["err"].strip().splitlines()
        assert len(lines) == 1 and "needs a CUDA GPU" in lines[0], r["err"][-2000:]


def _docstring(name: str) -> str:
    """The module's docstring, read from its source (no import in this process)."""
    tree = ast.parse((ROOT / "benchmarks" / f"{name}.py").read_text())
    return ast.get_docstring(tree) or ""


def test_readme_lists_every_benchmark_and_carve_bench():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    for name in MODULES:
        assert f"python -m benchmarks.{name}" in readme, f"benchmarks/README.md lacks {name}"
    for script in (ROOT / "benchmarks").glob("*.sh"):
        assert f"benchmarks/{script.name}" in readme, f"benchmarks/README.md lacks {script.name}"
    assert "carve bench" in readme

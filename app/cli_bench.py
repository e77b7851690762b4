"""`carve bench`: the GPU pipeline benchmark (engine/runtime/bench.py; the rest of the benchmarks
are in benchmarks/README.md). It runs `python -m engine.runtime.bench` in a child process, so that
app never imports torch (the GUI starts in under a second and the CLI stays light)."""

from __future__ import annotations

import subprocess
import sys


def main(argv: list[str]) -> int:
    args = list(argv[1:] if argv and argv[0] == "bench" else argv)
    return subprocess.call([sys.executable, "-m", "engine.runtime.bench", *args])

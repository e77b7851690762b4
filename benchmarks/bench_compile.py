"""Compile again, and time, the kernel variants a GPU machine's load compiled: the JSON lines
that CARVE_PRECOMPILE_DUMP=FILE makes the load's compile workers write (benchmarks/h200.sh's
LAUNCH step writes $OUT/variants-SHAPE.jsonl). No GPU needed: each variant compiles for the
target it was recorded for, in worker processes as the load runs them, into a fresh Triton
cache folder.

    python -m benchmarks.bench_compile variants-qwen2-7b.jsonl [--jobs N]

Prints each variant's seconds here beside its seconds on the GPU machine, slowest first, then
the wall time of the whole set on N workers: which kernels bound a cold launch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import as_completed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_compile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dump", help="JSON lines written under CARVE_PRECOMPILE_DUMP")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1: in turn)")
    args = ap.parse_args(argv)
    with open(args.dump, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    seen, jobs = set(), []
    for r in rows:  # a dump of two cold launches holds each variant twice
        if (r["name"], r["data"]) not in seen:
            seen.add((r["name"], r["data"]))
            jobs.append(r)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="carve-compile-")
    os.environ.pop("TRITON_INTERPRET", None)
    from engine.runtime.gpu import compile_worker

    pool = compile_worker.workers(max(1, args.jobs))
    if pool is None:
        print("the compile workers did not start", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    out = []
    try:
        futures = {pool.submit(compile_worker.timed_build, j["module"], j["name"], j["data"],
                               tuple(j["target"])): j for j in jobs}
        for fut in as_completed(futures):
            err, sec = fut.result()
            out.append((sec, futures[fut], err))
    finally:
        pool.shutdown()
        compile_worker.stop_server()
    wall = time.perf_counter() - t0
    print(f"{'kernel':28s} {'here s':>7s} {'there s':>8s}  constants")
    for sec, j, err in sorted(out, key=lambda t: -t[0]):
        consts = json.loads(j["data"]).get("constant_vals", [])
        print(f"{j['name']:28s} {sec:7.2f} {j['seconds']:8.2f}  {consts}"
              + (f"  FAILED: {err}" if err else ""))
    print(f"{len(jobs)} variants on {args.jobs} worker(s): {wall:.1f} s wall, "
          f"{sum(s for s, _, _ in out):.1f} s of compiling")
    return 0


if __name__ == "__main__":
    sys.exit(main())

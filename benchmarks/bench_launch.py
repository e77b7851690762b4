"""Launch -> loaded through the engine process, stage by stage, with the Triton kernel cache
cold (a fresh cache folder) and warm, the engine process started at Launch (as `carve chat`
starts it) and pre-started (as the window starts it when a model opens).

    python -m benchmarks.bench_launch MODEL | --synth SHAPE [--mix q4_k_m] [--runs N]

Prints each launch's load timeline (the engine's marks) and, for the cold launch, the kernels
Triton compiled: how many variants of each, which is what a cold launch pays for.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path


def compiled(cache: Path) -> collections.Counter:
    """Kernel name -> number of compiled variants in a Triton cache folder."""
    names: collections.Counter = collections.Counter()
    for meta in cache.glob("*/*.json"):
        if meta.name.startswith("__grp__"):
            continue
        try:
            names[json.loads(meta.read_text()).get("name", meta.stem)] += 1
        except (OSError, ValueError):
            continue
    return names


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_launch", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--synth", help="write a synthetic model of this shape first")
    ap.add_argument("--mix", default="q4_k_m")
    ap.add_argument("--runs", type=int, default=2,
                    help="warm launches after the cold ones (0: the two cold ones and a pre-started one)")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        torch = None
    if torch is None or not torch.cuda.is_available():
        print("bench_launch needs a CUDA GPU", file=sys.stderr)
        return 2
    from engine.gguf.reader import GGUFModel
    from engine.hardware.rigs import parse_rig
    from engine.planning.defaults import default_plan
    from engine.runtime import bench_engine

    path = args.model
    if args.synth:
        from engine.synth.gen import write_model

        path = str(Path(tempfile.gettempdir()) / f"carve-launch-{args.synth}-{args.mix}.gguf")
        if not Path(path).exists():
            write_model(path, args.synth, args.mix)
    if not path:
        ap.error("give MODEL or --synth SHAPE")
    plan = default_plan(GGUFModel.open(path), parse_rig("auto"), model_path=path)
    cache = Path(tempfile.mkdtemp(prefix="carve-triton-"))
    # (kind, Triton cache folder, engine started before Launch as the window starts it)
    runs = [("cold", cache, False), ("cold, pre-started", Path(tempfile.mkdtemp(
        prefix="carve-triton-")), True)] + [("warm", cache, False)] * args.runs + [
        ("pre-started", cache, True)]
    for kind, folder, prestarted in runs:
        os.environ["TRITON_CACHE_DIR"] = str(folder)  # the engine process inherits it
        out = bench_engine.run(plan, replies=1, sampled=0, prestarted=prestarted)
        stages = ", ".join(f"{k} {v:.2f} s" for k, v in out["stages"].items())
        r = out["greedy"][0]
        print(f"{kind:17s} launch -> loaded {out['launch_to_loaded_s']:6.2f} s (ready "
              f"{out['ready_s']:.2f} s; {stages}); first reply ttft {r['ttft_s'] * 1e3:.0f} ms, "
              f"prompt {r['prefill_tps']:.0f} t/s", flush=True)
        bench_engine.print_timeline(out)
        if kind.startswith("cold"):
            names = compiled(folder)
            print(f"   {kind} launch compiled {sum(names.values())} kernel variants:", ", ".join(
                f"{n} x{c}" for n, c in names.most_common()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

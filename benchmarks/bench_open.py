"""Time to open a model's metadata: header parse (GGUFModel.open) and HParams, median of runs.

    python -m benchmarks.bench_open MODEL [--runs 7] [--reference]

``--reference`` also times gguf.GGUFReader once on the same file, for comparison.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from spec.errors import CarveError


def _time(fn, runs: int, clock=time.perf_counter) -> list[float]:
    out = []
    for _ in range(runs):
        t0 = clock()
        fn()
        out.append(clock() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_open", description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a .gguf file (any shard of a split set)")
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--reference", action="store_true", help="also time gguf.GGUFReader once")
    args = ap.parse_args(argv)
    try:
        first = _time(lambda: GGUFModel.open(args.model), 1)[0]  # page cache may be cold here
        opens = _time(lambda: GGUFModel.open(args.model), max(1, args.runs))
        # CPU time too: on a shared machine wall time also counts other processes' turns
        cpu = _time(lambda: GGUFModel.open(args.model), max(1, args.runs), time.process_time)
        model = GGUFModel.open(args.model)
        hps = _time(lambda: HParams.from_model(model), max(1, args.runs))
    except CarveError as err:
        print(f"carve: {err}", file=sys.stderr)
        return 2
    n_strings = sum(len(v) for v in model.metadata.values()
                    if isinstance(v, list) and v and isinstance(v[0], str))
    print(f"{args.model}: {model.arch}, {len(model.paths)} file(s), {len(model.tensors)} tensors, "
          f"{len(model.metadata)} metadata keys ({n_strings} strings in arrays), "
          f"{model.file_size / 2**20:.1f} MiB")
    print(f"open metadata: median {statistics.median(opens) * 1e3:.1f} ms over {len(opens)} runs "
          f"(min {min(opens) * 1e3:.1f}, max {max(opens) * 1e3:.1f}; first {first * 1e3:.1f}); "
          f"CPU time median {statistics.median(cpu) * 1e3:.1f} ms")
    print(f"HParams.from_model: median {statistics.median(hps) * 1e3:.3f} ms")
    if args.reference:
        from gguf import GGUFReader

        ref = _time(lambda: GGUFReader(model.paths[0]), 1)[0]
        print(f"gguf.GGUFReader (reference): {ref:.2f} s, "
              f"{ref / statistics.median(opens):.0f}x the median above")
    return 0


if __name__ == "__main__":
    sys.exit(main())

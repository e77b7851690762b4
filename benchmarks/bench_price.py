"""How fast pricing answers while a user drags a boundary.

    python -m benchmarks.bench_price [MODEL.gguf] [--gpus RIG] [--ctx N] [--arena MODE]

Without a model it builds a header-only synthetic model (engine.synth.gen shapes, 120 layers of a
70B-class qwen2, 1,443 tensors): pricing reads only the tensor table, so no data is written.
Prints the time of one full price (cold: every stage built) and of a re-price after one
boundary moves by one layer (the two stages beside it rebuilt, the rest cached).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from engine.synth.header import HeaderModel
from engine.synth.shapes import Shape
from spec.errors import CarveError

BENCH_SHAPE = Shape("qwen2", 120, 8192, 64, 8, 29568, 152064, n_ctx=32768)


def _time(fn: Any, repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_price", description=__doc__.splitlines()[0]
    )
    ap.add_argument(
        "model", nargs="?", help="a GGUF file (default: a synthetic 1,443-tensor model)"
    )
    ap.add_argument("--gpus", default="4x80GiB")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--arena", default="packed")
    ap.add_argument("--repeat", type=int, default=50)
    args = ap.parse_args(argv)
    from engine.hardware.calibration import overhead_for
    from engine.hardware.rigs import parse_rig
    from engine.planning import price as pricing
    from engine.planning.carve import model_index
    from engine.planning.plan import Plan
    from engine.planning.split import auto_split
    from engine.planning.stage import stage_key

    try:
        t0 = time.perf_counter()
        model = pricing.open_model(args.model) if args.model else HeaderModel(BENCH_SHAPE)
        t_open = time.perf_counter() - t0
        devices = parse_rig(args.gpus)
        t0 = time.perf_counter()
        idx = model_index(model)
        t_index = time.perf_counter() - t0
        t0 = time.perf_counter()
        base = auto_split(model, devices, ctx=args.ctx, arena=args.arena, act_dtype="bf16")
        t_split = time.perf_counter() - t0
    except CarveError as exc:
        print(f"carve: {exc}", file=sys.stderr)
        return 2
    n_dev = len(base.devices)
    print(
        f"model: {model.paths[0]} ({len(model.tensors)} tensors, {idx.n_layer} layers); "
        f"rig {args.gpus} ({n_dev} stages), ctx {args.ctx}, arena {args.arena}"
    )
    print(
        f"open {t_open * 1e3:.1f} ms, model index (once per model) {t_index * 1e3:.1f} ms, "
        f"--split auto {t_split * 1e3:.1f} ms -> {','.join(map(str, base.split))}"
    )

    def cold() -> None:
        pricing._STAGES.clear()
        pricing.price(base, model)

    cold_t = _time(cold, max(3, args.repeat // 10))
    # drag boundary 1 back and forth over fresh positions: every move misses the stage cache
    # for the two stages beside it (the cache is cleared of them first)
    lo, hi = base.split[0] + 1, base.split[2] - 1 if n_dev > 1 else base.split[1]
    moves, spans = [], []
    if n_dev > 1:
        positions = [p for p in range(lo, hi + 1) if p != base.split[1]][: args.repeat]
        for p in positions:
            split = list(base.split)
            split[1] = p
            plan = Plan(
                base.model,
                base.devices,
                tuple(split),
                base.ctx,
                base.kv_type,
                base.prefill_chunk,
                base.cache_reserve,
                base.arena,
                base.act_dtype,
            )
            pricing.price(base, model)  # everything else warm, as during a drag
            for i in (0, 1):  # as if never priced: a real move lands on new ranges
                k = stage_key(plan, i)
                pricing._STAGES.pop((idx.token, k, overhead_for(k.device)[0]), None)
            t0 = time.perf_counter()
            layout = pricing.price(plan, model)
            moves.append(time.perf_counter() - t0)
            t0 = time.perf_counter()  # what the loader / --json pay on top: every Span object
            n_spans = sum(len(a.spans) for d in layout.devices[:2] for a in d.arenas)
            spans.append(time.perf_counter() - t0)
    print(
        f"price, cold (all {n_dev} stages built): median {statistics.median(cold_t) * 1e3:.2f} ms"
    )
    if moves:
        print(
            f"re-price after one boundary move (2 stages rebuilt, {len(moves)} moves): "
            f"median {statistics.median(moves) * 1e3:.2f} ms, max {max(moves) * 1e3:.2f} ms"
        )
        print(
            f"  + building the {n_spans} spans of those two stages (loader, --json; not needed "
            f"for the numbers): median {statistics.median(spans) * 1e3:.2f} ms"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

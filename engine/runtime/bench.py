"""`carve bench`: prefill / decode tokens per second of the GPU engine, decode at growing depth,
load GB/s and priced vs reserved bytes per device, against ceilings measured in the same run.

    python -m engine.runtime.bench MODEL | --synth SHAPE [--mix q4_k_m] [--gpus RIG] [--compare-split]
        [--engine]   (also through the engine process: engine/runtime/bench_engine.py)
        [--vram GiB] [--experts-resident auto|N,N] [--expert-slots N] [--host-compute gpu|cpu|both]
        [--cache-reserve MiB]   (experts in host memory)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.runtime import bench_engine
from engine.runtime.options import RunnerOptions
from spec.errors import CarveError


def _plan(path: str, n_gpus: int, n_layer: int, ctx: int, kv_type: str, arena: str,
          placement: dict | None = None):
    """One stage per device; ``placement``: vram (GiB each device's plan may use, as a card of
    that size would: the driver's reserve off), experts_resident (None: Auto), expert_slots,
    host_compute, cache_reserve (bytes kept free; 1 GiB without one)."""
    from engine.hardware.devices import DeviceSpec
    from engine.hardware.rigs import DRIVER_RESERVE
    from engine.planning.plan import Plan

    devs = []
    have = torch.cuda.device_count()
    for i in range(n_gpus):
        # more stages than GPUs: stages share GPUs (each priced on its share of the memory),
        # which still checks that a split changes where bytes live, not what is computed
        free, total = torch.cuda.mem_get_info(i % have)
        share = -(-n_gpus // have)
        total, free = total // share, free // share
        if placement and placement.get("vram"):
            total = int(placement["vram"] * (1 << 30))
            free = min(free, total - DRIVER_RESERVE)
        devs.append(DeviceSpec(index=i % have, name=torch.cuda.get_device_name(i % have),
                               total=total, free=free))
    split = tuple(round(i * n_layer / n_gpus) for i in range(n_gpus + 1))
    plan = Plan(model=path, devices=tuple(devs), split=split, ctx=ctx, kv_type=kv_type,
                prefill_chunk=512, cache_reserve=(placement or {}).get("cache_reserve", 1 << 30),
                arena=arena, act_dtype="bf16")
    if not placement:
        return plan
    from dataclasses import replace

    from engine.gguf.reader import GGUFModel
    from engine.planning.defaults import auto_host_compute, place_experts

    slots = tuple(placement.get("expert_slots") or ())
    if len(slots) == 1:
        slots *= n_gpus
    where = placement.get("host_compute", "gpu")
    plan = replace(plan, expert_slots=slots, host_compute="gpu" if where == "auto" else where)
    model = GGUFModel.open(path)
    if placement.get("experts_resident") is None:
        plan = place_experts(plan, model)
    else:
        plan = replace(plan, experts_resident=tuple(placement["experts_resident"]))
    return auto_host_compute(plan, model) if where == "auto" else plan


PP_RUNS = 5  # timed prefill passes, the median reported


def _greedy_margins(pipe: Any, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """``n`` greedy ids after ``prompt`` and, for each, its logit minus the runner-up's."""
    rows = pipe.stages[-1].buf["logits"]

    def lead(row: torch.Tensor) -> float:
        top = row.float().topk(2).values
        return float(top[0] - top[1])

    ids = [pipe.prefill(prompt)]
    margins = [lead(rows[pipe.head_row])]
    for _ in range(n - 1):
        pipe.step()
        ids.append(int(pipe.stages[-1].next_id))
        margins.append(lead(rows[0]))
    return ids, margins


def _timed(fn, n: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _kernel_breakdown(pipe, steps: int = 4) -> list[dict]:
    """GPU time per kernel name in eager decode steps (torch.profiler; the graph replays the
    same kernels), per token, largest first."""
    from torch.profiler import ProfilerActivity, profile

    pipe.set_position(64, 1)
    for st in pipe.stages:
        st.graph, saved = None, st.graph  # eager: the profiler sees each kernel
        st._saved_graph = saved
    try:
        pipe.step()
        pipe.sync()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                pipe.step()
            pipe.sync()
    finally:
        for st in pipe.stages:
            st.graph = st._saved_graph
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count:
            rows.append({"name": e.key[:60], "us_per_token": us / steps,
                         "calls_per_token": e.count / steps})
    rows.sort(key=lambda r: -r["us_per_token"])
    return rows[:14]


def run(path: str, n_gpus: int, ctx: int, kv_type: str, arena: str, tokens: int,
        depths: list[int], pp: int, out: dict, kernels: bool = False,
        options: RunnerOptions = RunnerOptions(), placement: dict | None = None,
        trace: bool = False) -> list[int]:
    from engine.gguf.hparams import HParams
    from engine.gguf.reader import GGUFModel
    from engine.planning.price import price
    from engine.runtime.gpu.pipeline import GpuPipeline

    model = GGUFModel.open(path)
    hp = HParams.from_model(model)
    if hp.n_ctx_train and ctx > hp.n_ctx_train:
        ctx = hp.n_ctx_train  # the deepest point of the sweep is then ctx - 64
    layout = price(_plan(path, n_gpus, hp.n_layer_run, ctx, kv_type, arena, placement), model)
    if not layout.fits:
        raise CarveError("the bench's plan does not fit: " + (layout.bottleneck() or "; ".join(
            d.advice for d in layout.devices if d.advice)))
    t0 = time.perf_counter()
    pipe = GpuPipeline(model, hp, layout, options=options)
    load_s = time.perf_counter() - t0
    rep = {"gpus": n_gpus, "devices": pipe.report, "load_wall_s": load_s}
    if layout.host is not None:
        plan = layout.plan
        rep["experts"] = {"resident": list(plan.experts_resident), "on": plan.host_compute,
                          "host_layers": [len(st.host_layers) for st in pipe.stages],
                          "pinned": layout.host.pinned, "slots": list(plan.expert_slots),
                          # host_compute "both": per host layer, the experts of a decode row
                          # the CPU computes (the rest cross PCIe to the GPU meanwhile)
                          "cpu_shares": [st.cpu_shares for st in pipe.stages],
                          # the load's timing behind them (the first split layer's): ms for
                          # the CPU's 1..k experts, the PCIe's for the GPU's k..0
                          "split_model_ms": [[[round(t * 1e3, 3) for t in part]
                                              for part in h.split_model]
                                             for st in pipe.stages for h in st._hosts()
                                             if h.split_model is not None][:1]}
    nbytes = sum(r["load_bytes"] for r in pipe.report)
    rep["load_gbps"] = nbytes / sum(r["load_s"] for r in pipe.report) / 1e9
    pipe.capture()
    g = torch.Generator().manual_seed(1234)
    prompt = torch.randint(0, hp.n_vocab, (pp,), generator=g).tolist()
    # pp: one warm-up pass, then PP_RUNS timed ones (fresh positions 0..pp-1 each time), the
    # median reported: one pass of a prefill that Python launches varies by tens of percent
    pipe.prefill(prompt)
    pipe.sync()
    moved0 = sum(st.host_moved() for st in pipe.stages)
    runs = sorted(_timed(lambda: pipe.prefill(prompt), 1) for _ in range(PP_RUNS))
    t = runs[PP_RUNS // 2]
    moved = (sum(st.host_moved() for st in pipe.stages) - moved0) / PP_RUNS
    rep["pp"] = {"tokens": pp, "s": t, "tps": pp / t, "host_gbps": moved / t / 1e9,
                 "runs_tps": [pp / r for r in runs]}
    ids, margins = _greedy_margins(pipe, prompt[:32], 64)
    rep["greedy64_sha256"] = hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:16]
    rep["greedy64_head"] = ids[:8]
    # every id and its logit's lead over the runner-up: where two placements' ids part, the
    # lead there says whether a rounding's difference (a near tie) or a fault parted them
    rep["greedy64"] = ids
    rep["greedy64_margins"] = [round(m, 4) for m in margins]
    finite = all(bool(torch.isfinite(st.buf["logits"]).all()) for st in pipe.stages if st.last)
    rep["logits_finite"] = finite
    # tg: `tokens` graph replays from position 0, no host sync in between
    pipe.set_position(0, 1)
    pipe.step()
    pipe.set_position(0, 1)
    moved0 = sum(st.host_moved() for st in pipe.stages)
    cpu0 = sum(st.host_cpu_s() for st in pipe.stages)
    wait0 = sum(st.host_wait_s() for st in pipe.stages)
    hm0 = [sum(x) for x in zip(*(st.cache_hits() for st in pipe.stages))]
    t = _timed(pipe.step, tokens)
    moved = sum(st.host_moved() for st in pipe.stages) - moved0
    cpu_s = sum(st.host_cpu_s() for st in pipe.stages) - cpu0
    wait_s = sum(st.host_wait_s() for st in pipe.stages) - wait0
    hits, misses = (a - b for a, b in zip(
        [sum(x) for x in zip(*(st.cache_hits() for st in pipe.stages))], hm0))
    weight_bytes = step_weight_bytes(model, hp, sum(r["load_bytes"] for r in pipe.report))
    rep["tg"] = {"tokens": tokens, "s": t, "tps": tokens / t, "step_bytes": weight_bytes,
                 "weight_gbps": weight_bytes / (t / tokens) / 1e9,
                 # experts in host memory: what decode copied between GPU and host, and how
                 # often the expert cache held the experts a step chose
                 "host_bytes_per_token": moved / tokens, "host_gbps": moved / t / 1e9,
                 # and the share of a step the CPU spent computing host experts
                 "host_cpu_ms_per_token": cpu_s / tokens * 1e3,
                 # a split decode's host waiting for the GPU's rows (the CPU idle)
                 "host_wait_ms_per_token": wait_s / tokens * 1e3,
                 "cache_hit_rate": hits / (hits + misses) if hits + misses else None}
    rep["depth"] = []
    for d in depths:
        d = min(d, ctx - 64)
        pipe.set_position(d, 1)
        t = _timed(pipe.step, 32)
        rep["depth"].append({"depth": d, "tps": 32 / t})
    if kernels:
        rep["kernels"] = _kernel_breakdown(pipe)
    if trace:
        from engine.runtime.step_trace import trace_step

        rep["trace"] = trace_step(pipe)
    out.setdefault("runs", []).append(rep)
    pipe = None  # free this run's arenas before the next
    torch.cuda.empty_cache()
    return ids


def step_weight_bytes(model, hp, loaded: int) -> int:
    """Weight bytes a decode step reads: every loaded byte, but of a MoE layer's expert
    tensors only the n_expert_used of n_expert experts a token is routed to."""
    if not getattr(hp, "n_expert", 0):
        return loaded
    experts = sum(t.nbytes for t in model.tensors if "_exps." in t.name
                  and t.layer is not None and t.layer < hp.n_layer_run)
    return loaded - experts + experts * hp.n_expert_used // hp.n_expert


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="carve bench")
    ap.add_argument("model", nargs="?")
    ap.add_argument("--synth", help="write and bench a synthetic model of this shape")
    ap.add_argument("--mix", help="--synth's mix (default: the one the shape's published files "
                    "use: q4_k_m, gpt-oss mxfp4_moe)")
    ap.add_argument("--gpus", default="",
                    help="a rig as carve plan takes it: one stage per device it names, run on the "
                         'GPUs here ("auto": one per GPU here); default one stage')
    ap.add_argument("--compare-split", action="store_true",
                    help="also run split in 2 stages (2 GPUs, or 2 stages on one GPU when only "
                         "one is present) and compare greedy ids with 1 stage")
    ap.add_argument("--ctx", type=int, default=0, help="default: largest depth + 512")
    ap.add_argument("--kv", default="f16", choices=["f16", "q8_0"])
    ap.add_argument("--arena", default="packed")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--depths", default="2048,4096,8192,16384,32768")
    ap.add_argument("--kernels", action="store_true",
                    help="also list GPU time per kernel in a decode step (torch.profiler)")
    ap.add_argument("--trace", action="store_true",
                    help="also time a decode step's kernels from inside its CUDA graph: each "
                         "launch's exposed time, gap and phases (engine/runtime/step_trace.py)")
    ap.add_argument("--engine", action="store_true",
                    help="also measure through the engine process, as the window drives it")
    ap.add_argument("--vram", type=float, default=0,
                    help="GiB each device's plan may use (a consumer card's budget on a big GPU)")
    ap.add_argument("--experts-resident", default="",
                    help="auto, or per GPU the MoE layers whose experts stay in VRAM (the rest "
                         "in pinned host memory); default: all in VRAM")
    ap.add_argument("--expert-slots", default="", help="VRAM expert-cache slots per GPU")
    ap.add_argument("--host-compute", default="auto", choices=("auto", "gpu", "cpu", "both"),
                    help="where experts in host memory run: read by the GPU over PCIe, on the "
                         "CPU, or both (decode split between CPU and GPU, the GPU prefills); "
                         "auto: as the window and carve chat choose (both where the CPU's "
                         "native kernel reads every host layer, else gpu)")
    ap.add_argument("--cache-reserve", type=float, default=1024, metavar="MiB",
                    help="VRAM each plan keeps free (the window's cache reserve; Auto's "
                         "placement of experts leaves it free)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    try:
        # the kernels' switches (CARVE_Q8X, CARVE_T_LAYOUT, CARVE_PDL, CARVE_TRIAL); bench
        # runs Triton
        options = RunnerOptions.from_env(os.environ)
        options.apply()
        if not torch.cuda.is_available():
            raise CarveError("carve bench needs an NVIDIA GPU with a CUDA build of torch")
        path = args.model
        if args.synth:
            from engine.synth.gen import SHAPES, write_model

            mix = args.mix or getattr(SHAPES.get(args.synth), "mix", "q4_k_m")
            path = str(Path("/tmp") / f"carve-bench-{args.synth}-{mix}.gguf")
            t0 = time.perf_counter()
            write_model(path, args.synth, mix)
            print(f"# wrote {path} in {time.perf_counter() - t0:.1f} s", flush=True)
        if not path:
            raise CarveError("carve bench: give a MODEL path or --synth SHAPE")
        depths = [int(x) for x in args.depths.split(",") if x]
        ctx = args.ctx or (max(depths) + 512 if depths else 4096)
        out: dict = {"model": path, "trials": sorted(options.trials)}
        if options.trials:  # kernels on trial (CARVE_TRIAL): say so beside every figure
            print(f"# kernels on trial: {', '.join(sorted(options.trials))}", flush=True)
        if options.t_tiles:  # T launches' tuning (CARVE_T_TILES): likewise
            out["t_tiles"] = {part: list(cfg) for part, cfg in options.t_tiles}
            print("# T tiles: " + "; ".join(f"{part} {w} warps, {n} programs"
                                            + (f", {r} rows" if r else "")
                                            for part, (w, n, r) in options.t_tiles), flush=True)
        from engine.hardware.rigs import parse_rig

        n_gpus = len(parse_rig(args.gpus)) if args.gpus else 1
        placement = None
        if (args.vram or args.experts_resident or args.expert_slots
                or args.host_compute not in ("gpu", "auto") or args.cache_reserve != 1024):
            from engine.planning.plan import parse_counts

            text = args.experts_resident.strip().lower()
            placement = {
                "vram": args.vram,
                "experts_resident": (None if text == "auto" else parse_counts(
                    "--experts-resident", text) if text else ()),
                "expert_slots": (parse_counts("--expert-slots", args.expert_slots)
                                 if args.expert_slots else ()),
                "host_compute": args.host_compute,
                "cache_reserve": int(args.cache_reserve * (1 << 20)),
            }
        why = _torch_runner(path, n_gpus, ctx, args.kv, args.arena, placement)
        if why is not None:  # nothing of the Triton pipeline to measure: the engine process
            if not args.engine:
                raise CarveError(f"carve bench measures the Triton GPU runner, and this model "
                                 f"runs on the torch engine ({why}); add --engine to measure "
                                 "it through the engine process")
            print(f"# the torch engine runs this model ({why}): engine process only",
                  flush=True)
            out["engine"] = bench_engine.measure(path, ctx, args.kv, None)
            if args.json:
                Path(args.json).write_text(json.dumps(out, indent=1))
            return 0
        ids1 = run(path, n_gpus, ctx, args.kv, args.arena, args.tokens, depths, args.pp, out,
                   args.kernels, options, placement, args.trace)
        _print(out)
        if args.compare_split:
            ids2 = run(path, 2, ctx, args.kv, args.arena, args.tokens, [], args.pp, out,
                       options=options)
            out["split_same_ids"] = ids1 == ids2
            out["runs"] = out["runs"][-1:]
            _print(out)
        if args.engine:
            placed = None
            if placement:  # the engine process runs the plan just measured, budget and all
                from engine.gguf.hparams import HParams
                from engine.gguf.reader import GGUFModel

                hp = HParams.from_model(GGUFModel.open(path))
                placed = _plan(path, n_gpus, hp.n_layer_run,
                               min(ctx, hp.n_ctx_train) if hp.n_ctx_train else ctx, args.kv,
                               args.arena, placement)
            out["engine"] = bench_engine.measure(path, ctx, args.kv, out["runs"][0]["tg"]["tps"],
                                                 placed)
    except CarveError as e:
        print(f"carve: {e}", file=sys.stderr)
        return 2
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def _torch_runner(path: str, n_gpus: int, ctx: int, kv_type: str, arena: str,
                  placement: dict | None) -> str | None:
    """Why the bench's plan of ``path`` would run on the torch engine, or None (Triton)."""
    from engine.gguf.hparams import HParams
    from engine.gguf.reader import GGUFModel
    from engine.planning.capability import gpu_why_not

    hp = HParams.from_model(GGUFModel.open(path))
    ctx = min(ctx, hp.n_ctx_train) if hp.n_ctx_train else ctx
    return gpu_why_not(_plan(path, n_gpus, hp.n_layer_run, ctx, kv_type, arena, placement), hp)


def _print(out: dict) -> None:
    print(f"model {out['model']}", flush=True)
    for r in out["runs"]:
        gpus = len({d["index"] for d in r["devices"]})
        print(f"-- {r['gpus']} stage(s) on {gpus} GPU(s): load {r['load_gbps']:.1f} GB/s, "
              f"pp{r['pp']['tokens']} {r['pp']['tps']:.0f} t/s, tg{r['tg']['tokens']} "
              f"{r['tg']['tps']:.1f} t/s ({r['tg']['weight_gbps']:.0f} GB/s of weights), "
              f"greedy64 {r['greedy64_sha256']} finite={r['logits_finite']}")
        if "experts" in r:
            e, tg = r["experts"], r["tg"]
            rate = tg["cache_hit_rate"]
            hit = "n/a (no slots, or none used)" if rate is None else f"{rate:.1%}"
            on = {"both": "CPU and GPU"}.get(e["on"], e["on"].upper())
            print(f"   experts: resident {e['resident'] or 'all'} (host ones run on the "
                  f"{on}), host layers per stage "
                  f"{e['host_layers']}, pinned {e['pinned'] / 2**30:.2f} GiB, slots "
                  f"{e['slots'] or 0}; decode moves {tg['host_bytes_per_token'] / 1e3:.1f} kB "
                  f"per token between GPU and host ({tg['host_gbps']:.2f} GB/s); expert-cache "
                  f"hit rate in decode: {hit}; the CPU computed host experts "
                  f"{tg['host_cpu_ms_per_token']:.2f} ms of each "
                  f"{1e3 / tg['tps']:.2f} ms step; prefill moved {r['pp']['host_gbps']:.2f} GB/s")
            shares = [c for st in e.get("cpu_shares", []) for c in st.values()]
            if shares:
                print(f"   decode rows split: the CPU computes {shares} of each host layer's "
                      f"routed experts, the GPU the rest; the host waited for the GPU "
                      f"{tg['host_wait_ms_per_token']:.2f} ms a token; timed at load (ms, "
                      f"CPU 1..k experts; PCIe k..0): {e.get('split_model_ms')}")
        for d in r["devices"]:
            print(f"   cuda:{d['index']} layers {d['layers']}: priced {d['priced']:,} B, "
                  f"reserved {d['reserved']:,} B (diff {d['reserved'] - d['priced']:+,}), "
                  f"load {d['load_bytes'] / d['load_s'] / 1e9:.1f} GB/s, "
                  f"dequant cache {d['dequant_cached']} matrices in {d['dequant_s']:.2f} s")
        for d in r["depth"]:
            print(f"   depth {d['depth']:6d}: {d['tps']:.1f} t/s")
        for k in r.get("kernels", []):
            print(f"   kernel {k['us_per_token']:8.1f} us/token {k['calls_per_token']:5.0f} "
                  f"calls  {k['name']}")
        if "trace" in r:
            from engine.runtime.step_trace import print_trace

            print_trace(r["trace"])
    if "split_same_ids" in out:
        print(f"split vs one GPU, same greedy ids: {out['split_same_ids']}")


if __name__ == "__main__":
    sys.exit(main())

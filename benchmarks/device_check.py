"""Every kernel on a GPU against its torch twin at real (Qwen2-7B) shapes, timed against its floor.

    python -m benchmarks.device_check [--quick | --attn | --moe | --moe-host | --sample]
        [--types LIST]
        [--json FILE]

Prints the measured copy rate and bf16 matmul rate, then one line per kernel (GEMV per type and
tile, dequantize, RMSNorm, SwiGLU, RoPE, attention decode and prefill over f16 and q8_0 KV
caches, and DeepSeek's latent attention at V2-Lite's and V3's heads (carve_kernels/latent.py:
decode and prefill over the latent cache, the per-head matrices); ``--moe``: the
mixture-of-experts kernels alone, decode and prefill at Qwen3-30B-A3B and gpt-oss-20b expert
shapes; ``--moe-host``: decode's expert kernels reading experts in
pinned host memory where they lie, against the host-to-GPU copy rate): microseconds, its
floor (bytes over the copy rate, or FLOPs over the matmul rate), the
share of the floor reached and the normalized error against the reference; then the same as a
Markdown table and the fastest GEMV tile per type (``--json`` writes them to FILE too).
``--types`` picks the GEMV / dequantize types (comma-separated names; ``lowbit``: Q2_K, Q3_K,
Q4_1, Q5_1 and the IQ family) and skips the other kernels. Builds
every input itself (random well-formed blocks), so it needs no model file and no gguf. Needs a
CUDA GPU.
"""

# Timed lambdas run at once inside their loop iteration (B023); a failing section is reported
# and the run goes on, so one device call brings back everything else (BLE001).
# ruff: noqa: B023, BLE001

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import triton
from triton.testing import do_bench

from carve_kernels import (
    attention,
    gemv_t,
    glu,
    kv_cache,
    latent,
    norm,
    q8x,
    quant_matmul,
    rope,
    t_layout,
)
from carve_kernels.random_blocks import random_weight
from spec import launch
from spec import quant_types as qt
from spec.errors import CarveError

TYPES = [qt.Q4_K, qt.Q6_K, qt.Q5_K, qt.Q4_0, qt.Q5_0, qt.Q8_0, qt.F16, qt.BF16]
# the low-bit types of large quants, by use in published files
LOWBIT = [qt.IQ2_XXS, qt.IQ3_S, qt.IQ4_XS, qt.Q2_K, qt.Q3_K, qt.IQ3_XXS, qt.IQ2_XS, qt.IQ2_S,
          qt.IQ4_NL, qt.IQ1_S, qt.IQ1_M, qt.Q4_1, qt.Q5_1]
K_CONFIGS = [(4, 16, 4), (8, 8, 4), (4, 8, 2), (8, 16, 8), (2, 16, 2)]
B_CONFIGS = [(4, 32, 4), (8, 16, 4), (4, 16, 2), (8, 32, 8)]
# the grid IQ types' row body (a lane per group of 32 values: 8 lanes per block); a sweep of
# ten tiles on an H200 (2026-12-02) put these first, the best at (4, 4, 4) or (8, 8, 4)
ROW_CONFIGS = [(4, 4, 4), (8, 8, 4), (4, 8, 4), (2, 8, 4), (8, 4, 4)]
# the row bodies of a thread per 32-value block (Q8_0: carve_kernels/gemv_dot.py q80_rows_dot; Q4_0,
# Q4_1, Q5_0, Q5_1, IQ4_NL: carve_kernels/gemv_q8.py), 1 to 4 blocks a thread (Q5_0's best at
# 7B on an H200, 2026-12-04: (4, 32, 4))
BLOCK_ROW_CONFIGS = {t: [(8, 32, 4), (4, 32, 4), (16, 32, 4), (8, 16, 4), (16, 16, 4),
                         (4, 64, 4)] for t in (qt.Q8_0, qt.Q5_0, qt.Q4_0, qt.Q4_1, qt.Q5_1,
                                               qt.IQ4_NL)}
# (rows per program, warps, target programs): the rule's two, then more rows a thread or fewer
# programs
T_CONFIGS = [launch.T_CONFIG, launch.T_CONFIG_LOWBIT, (256, 2, 2112), (512, 4, 2112),
             (256, 4, 1056)]
ROTATE = 4  # weight copies cycled so that timings are not L2 hits (60 MB of L2)


def nerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(y).all():
        return float("nan")
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def require_cuda(prog: str) -> bool:
    """Whether torch sees a CUDA GPU; when not, says so in one line on stderr."""
    if torch.cuda.is_available():
        return True
    print(f"error: {prog} needs a CUDA GPU and torch {torch.__version__} sees none",
          file=sys.stderr)
    return False


def graph_time(fn, calls: int = 8) -> float:
    """Median seconds of one call, replayed from a CUDA graph of ``calls`` calls (the decode
    step runs from a graph too, so launch gaps are not part of a kernel's time)."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fn(i)
    ms = do_bench(g.replay, warmup=20, rep=80, return_mode="median")
    return ms / 1e3 / calls


def ceilings() -> tuple[float, float]:
    n = 1 << 30  # 1 GiB each way
    a = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = do_bench(lambda: b.copy_(a), warmup=20, rep=100, return_mode="median")
    copy_bw = 2 * n / (ms / 1e3)
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: x @ y, warmup=20, rep=100, return_mode="median")
    mm = 2 * 8192**3 / (ms / 1e3)
    return copy_bw, mm


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.device_check") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one GEMV config per type")
    ap.add_argument("--attn", action="store_true", help="the attention kernels only")
    ap.add_argument("--moe", action="store_true",
                    help="the mixture-of-experts kernels only (30B-A3B and gpt-oss-20b shapes)")
    ap.add_argument("--moe-host", action="store_true",
                    help="decode's expert kernels reading experts in pinned host memory in "
                         "place, against the host-to-GPU copy rate (30B-A3B shape)")
    ap.add_argument("--host-split", action="store_true",
                    help="the hand-over of a decode row split between the GPU and the CPU "
                         "(host_compute both): its round trip alone and beside a PCIe copy")
    ap.add_argument("--sample", action="store_true",
                    help="the GPU sampler only: greedy and default sampling at real vocabulary "
                         "sizes, each first-pass variant against the host chain")
    ap.add_argument("--no-prefill", action="store_true",
                    help="with --moe: decode's kernels only (no prefill router, sort or grouped "
                         "GEMM sweeps)")
    ap.add_argument("--json", metavar="FILE", default=None, help="also write the rows to FILE")
    ap.add_argument("--types", metavar="LIST", default=None,
                    help="GEMV/dequantize types only: comma-separated names, or lowbit (with "
                         "--moe: the expert shapes whose gate/up type is one of them)")
    args = ap.parse_args(argv)
    try:
        types = _types(args.types)
    except CarveError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if not require_cuda(prog):
        return 2
    dev = torch.cuda.get_device_properties(0)
    print(f"# {dev.name} sms={dev.multi_processor_count} torch={torch.__version__} "
          f"triton={triton.__version__}", flush=True)
    copy_bw, mm_rate = ceilings()
    print(f"# copy {copy_bw / 1e9:.0f} GB/s (read+write), bf16 matmul {mm_rate / 1e12:.0f} "
          f"TFLOP/s", flush=True)
    rows: list[dict] = []
    best_cfg: dict[str, list] = {}

    def row(name, sec, floor, err=None, note=""):
        r = {"kernel": name, "us": sec * 1e6, "floor_us": floor * 1e6,
             "of_floor": floor / sec if sec else 0.0, "err": err, "note": note}
        rows.append(r)
        e = "" if err is None else f"{err:.1e}"
        print(f"{name:34s} {sec * 1e6:9.1f} us  floor {floor * 1e6:8.1f} us  "
              f"{100 * floor / sec:5.1f}%  err {e:8s} {note}", flush=True)

    g = torch.Generator(device="cuda")
    g.manual_seed(int(time.time()))
    if args.host_split:
        from benchmarks.device_check_moe import split_section

        split_section(row)
        _table(rows, best_cfg, args, copy_bw, mm_rate)
        return 0
    if args.moe or args.moe_host:
        # they import this module's helpers
        from benchmarks.device_check_moe import host_section, moe_section

        if args.moe_host:
            host_section(g, copy_bw, mm_rate, row)
        else:
            moe_section(g, copy_bw, mm_rate, row, types, prefill=not args.no_prefill)
        _table(rows, best_cfg, args, copy_bw, mm_rate)
        return 0
    if args.sample:
        _sample_section(g, copy_bw, row)
        _table(rows, best_cfg, args, copy_bw, mm_rate)
        return 0
    if args.attn:
        _attn_section(g, copy_bw, mm_rate, row)
        _latent_section(g, copy_bw, mm_rate, row)
        _table(rows, best_cfg, args, copy_bw, mm_rate)
        return 0
    # -- decode GEMV, Qwen2-7B ffn_up/gate [18944 x 3584] and ffn_down [3584 x 18944]
    for t in types or TYPES:
        try:
            _gemv_section(t, args, g, copy_bw, row, best_cfg)
        except Exception as exc:  # report and go on: one device call must bring back the rest
            print(f"FAIL section gemv {qt.type_name(t)}: {type(exc).__name__}: {exc}", flush=True)
        torch.cuda.empty_cache()
    if types is None:
        try:
            _other_section(g, copy_bw, mm_rate, row)
        except Exception:
            import traceback
            traceback.print_exc()
    _table(rows, best_cfg, args, copy_bw, mm_rate)
    return 0


def _types(arg: str | None) -> list[int] | None:
    """The --types list: None (every kernel), LOWBIT, or the named types."""
    if arg is None:
        return None
    if arg.lower() == "lowbit":
        return LOWBIT
    out = [qt.type_id(n.strip()) for n in arg.split(",") if n.strip()]
    missing = [qt.type_name(t) for t in out if t not in quant_matmul.GEMV_CONFIG]
    if missing:
        raise CarveError(f"--types: no GPU GEMV for {', '.join(missing)}")
    return out


def _sweep(label, t, ws, shapes, cfgs, xy, xqs=None):
    """Each tile's time for the pair of matrices of type ``t`` on the rows ``xy[s]`` (x, y),
    or on the int8 copies ``xqs[s]``; (best time, its tile), None if no tile ran."""
    best = None
    for c in cfgs:
        try:
            tt = sum(graph_time(lambda i=0, s=s, c=c: quant_matmul.gemv(
                ws[s][i % ROTATE], t, xy[s][0], out=xy[s][1], config=c,
                xq=None if xqs is None else xqs[s][0])) for s in shapes)
        except Exception as exc:  # a config can exceed registers/shared memory
            print(f"  {label} {c}: {type(exc).__name__}: {str(exc)[:100]}", flush=True)
            continue
        print(f"  {label} cfg {c}: {tt * 1e6 / 2:.1f} us per matrix", flush=True)
        best = min(best or (tt, c), (tt, c))
    return best


def _int8_row(name, t, ws, shapes, cfgs, g, copy_bw, row, best_cfg, note=""):
    # a body's GEMV on decode's int8 copy of x (dp4a) at every tile, its error at the best
    xqs = {s: q8x.copy_ref(torch.randn(s[1], device="cuda", generator=g)) for s in shapes}
    xy = {s: (xqs[s][1].to(torch.bfloat16), torch.empty(1, s[0], device="cuda"))
          for s in shapes}
    best = _sweep(f"{name} int8 x{note}", t, ws, shapes, cfgs, xy, xqs)
    if best is None:
        return
    s0 = shapes[0]
    yq = torch.full((1, s0[0]), float("nan"), device="cuda")
    quant_matmul.gemv(ws[s0][0], t, xy[s0][0], out=yq, config=best[1], xq=xqs[s0][0])
    nbytes = sum(w[0].numel() for w in ws.values())
    row(f"gemv {name} up+down M=1 int8 x{note}", best[0], nbytes / copy_bw,
        nerr(yq, quant_matmul.gemv_ref(ws[s0][0], t, xqs[s0][1])),
        f"cfg={best[1]} {nbytes / best[0] / 1e9:.0f} GB/s")
    best_cfg[f"{name} int8{note}"] = list(best[1])


def _trial_rows(name, t, ws, shapes, g, copy_bw, row, best_cfg):
    # a body written but not yet switched on (quant_matmul.ROW_BODY_TRIAL): its GEMV on bf16
    # and on int8 x at every row-body tile, beside the generic walk's rows above
    body = quant_matmul.ROW_BODY_TYPES
    quant_matmul.ROW_BODY_TYPES = body | {t}
    try:
        xy = {s: (torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16),
                  torch.empty(1, s[0], device="cuda")) for s in shapes}
        best = None
        if t not in quant_matmul.INT8_BODY_TYPES:  # a body on bf16 x too
            best = _sweep(f"{name} row body", t, ws, shapes, ROW_CONFIGS, xy)
        if best is not None:
            x = torch.randn(1, shapes[0][1], device="cuda", generator=g)
            out = torch.full((1, shapes[0][0]), float("nan"), device="cuda")
            quant_matmul.gemv(ws[shapes[0]][0], t, x, out=out, config=best[1])
            nbytes = sum(w[0].numel() for w in ws.values())
            row(f"gemv {name} up+down M=1 row body (trial)", best[0], nbytes / copy_bw,
                nerr(out, quant_matmul.gemv_ref(ws[shapes[0]][0], t, x)), f"cfg={best[1]}")
        _int8_row(name, t, ws, shapes, BLOCK_ROW_CONFIGS.get(t, ROW_CONFIGS), g, copy_bw, row,
                  best_cfg, " (trial)")
    finally:
        quant_matmul.ROW_BODY_TYPES = body


def _t_rows(t, ws, shapes, g, copy_bw, row, best_cfg) -> None:
    """The T layout (carve_kernels/gemv_t.py) of the GGUF-order matrices ``ws[shape]`` (ROTATE
    copies each) on bf16 x and on decode's int8 copy of x, at the launch rule's tiles and a few
    others: each x kind's best, with its error against the reference."""
    name = qt.type_name(t)
    wts = {s: [t_layout.repack(w, t) for w in ws[s]] for s in shapes}
    floats = max(launch.scratch([s[0]], s[1], c)[0] for s in shapes for c in T_CONFIGS)
    part = torch.empty(floats, device="cuda")
    counter = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    nbytes = sum(w[0].numel() for w in ws.values())
    for label, int8 in (("bf16 x", False), ("int8 x", True)):
        xs, xqs = {}, {}
        for s in shapes:
            x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
            xqs[s], xr = q8x.copy_ref(x[0]) if int8 else (None, x.float())
            xs[s] = (x, xr, torch.full((1, s[0]), float("nan"), device="cuda"))
        best = None
        for c in T_CONFIGS:
            tt = sum(graph_time(lambda i=0, s=s, c=c: gemv_t.gemv_t(
                wts[s][i % ROTATE], t, s[0], xs[s][0], xs[s][2], part, counter, config=c,
                xq=xqs[s])) for s in shapes)
            print(f"  {name} T {label} cfg {c}: {tt * 1e6 / 2:.1f} us per matrix", flush=True)
            best = min(best or (tt, c), (tt, c))
        s0 = shapes[0]
        out = xs[s0][2].fill_(float("nan"))
        gemv_t.gemv_t(wts[s0][0], t, s0[0], xs[s0][0], out, part, counter, config=best[1],
                      xq=xqs[s0])
        err = nerr(out, quant_matmul.gemv_ref(ws[s0][0], t, xs[s0][1]))
        row(f"gemv {name} up+down M=1 T {label}", best[0], nbytes / copy_bw, err,
            f"cfg={best[1]} {nbytes / best[0] / 1e9:.0f} GB/s")
        best_cfg[f"{name} T {label}"] = list(best[1])


def _gemv_section(t, args, g, copy_bw, row, best_cfg):
    name = qt.type_name(t)
    shapes = [(18944, 3584), (3584, 18944)]
    ws = {s: [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)] for s in shapes}
    cfgs = K_CONFIGS if quant_matmul.plan(t).block == 256 else B_CONFIGS
    if t in quant_matmul.ROW_BODY_TYPES:
        cfgs = BLOCK_ROW_CONFIGS.get(t, ROW_CONFIGS)
    if args.quick:
        cfgs = [quant_matmul.GEMV_CONFIG[t]]
    # correctness at M=1 and M=4 on the real shape, default config
    for m in (1, 4):
        w = ws[shapes[0]][0]
        x = torch.randn(m, shapes[0][1], device="cuda", generator=g)
        out = torch.full((m, shapes[0][0]), float("nan"), device="cuda")
        quant_matmul.gemv(w, t, x, out=out)
        e = nerr(out, quant_matmul.gemv_ref(w, t, x))
        if not e < 1e-4:
            print(f"FAIL gemv {name} M={m} err {e}", flush=True)
    # timed on bf16 x, as decode runs them
    xy = {s: (torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16),
              torch.empty(1, s[0], device="cuda")) for s in shapes}
    total, cfg = _sweep(name, t, ws, shapes, cfgs, xy)
    best_cfg[name] = list(cfg)
    nbytes = sum(w[0].numel() for w in ws.values())
    w = ws[shapes[0]][0]
    x = torch.randn(1, shapes[0][1], device="cuda", generator=g)
    out = torch.full((1, shapes[0][0]), float("nan"), device="cuda")
    quant_matmul.gemv(w, t, x, out=out, config=cfg)
    err = nerr(out, quant_matmul.gemv_ref(w, t, x))
    row(f"gemv {name} up+down M=1", total, nbytes / copy_bw, err,
        f"cfg={cfg} {nbytes / total / 1e9:.0f} GB/s")
    if t in quant_matmul.ROW_BODY_TYPES:  # the same tile on the generic per-part walk (and
        # the walk's own tile where it has one: Q8_0's)
        body = quant_matmul.ROW_BODY_TYPES
        quant_matmul.ROW_BODY_TYPES = body - {t}
        own = quant_matmul.GEMV_CONFIG_GENERIC.get(t) or (
            quant_matmul.GEMV_CONFIG[t] if t in quant_matmul.INT8_BODY_TYPES else None)
        try:
            generic = _sweep(f"{name} generic walk", t, ws, shapes,
                             [cfg] + ([own] if own and own != cfg else []), xy)
        finally:
            quant_matmul.ROW_BODY_TYPES = body
        if generic is not None:
            row(f"gemv {name} up+down M=1 generic walk", generic[0], nbytes / copy_bw, None,
                f"cfg={generic[1]}")
        _int8_row(name, t, ws, shapes, cfgs, g, copy_bw, row, best_cfg)
    if t in quant_matmul.ROW_BODY_TRIAL:
        _trial_rows(name, t, ws, shapes, g, copy_bw, row, best_cfg)
    if t in t_layout.WORDS:  # the T layout the runner repacks these into
        _t_rows(t, ws, shapes, g, copy_bw, row, best_cfg)
    # M=4 time with the best config
    s = shapes[0]
    x4 = torch.randn(4, s[1], device="cuda", generator=g).to(torch.bfloat16)
    y4 = torch.empty(4, s[0], device="cuda")
    t4 = graph_time(lambda i=0: quant_matmul.gemv(ws[s][i % ROTATE], t, x4, out=y4, config=cfg))
    row(f"gemv {name} up M=4", t4, ws[s][0].numel() / copy_bw)
    # dequantize to bf16 (prefill): read bytes + write 2 B/value
    wq = ws[s][0]
    dq = torch.full(s, float("nan"), device="cuda", dtype=torch.bfloat16)
    quant_matmul.dequantize(wq, t, torch.bfloat16, out=dq)
    err = nerr(dq, quant_matmul.dequantize_ref(wq, t, torch.float32))
    td = graph_time(lambda i=0: quant_matmul.dequantize(ws[s][i % ROTATE], t,
                                                       torch.bfloat16, out=dq))
    row(f"dequant {name} -> bf16", td, (wq.numel() + dq.numel() * 2) / copy_bw, err)


def _other_section(g, copy_bw, mm_rate, row):
    # -- prefill GEMM on a dequantized tile: x [512, 3584] @ W^T [3584 -> 18944]
    xb = torch.randn(512, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    wd = torch.randn(18944, 3584, device="cuda", dtype=torch.bfloat16, generator=g)
    tm = do_bench(lambda: xb @ wd.T, warmup=20, rep=100, return_mode="median") / 1e3
    row("matmul bf16 512x3584x18944", tm, 2 * 512 * 3584 * 18944 / mm_rate)

    # -- RMSNorm + residual, GLU, RoPE at decode (1 token) and prefill (512)
    for t_ in (1, 512):
        x = torch.randn(t_, 3584, device="cuda", generator=g)
        res = torch.randn(t_, 3584, device="cuda", generator=g)
        w = torch.randn(3584, device="cuda", generator=g)
        y = torch.full_like(x, float("nan"))
        r2 = res.clone()
        norm.rmsnorm(x, w, 1e-6, residual=res, out=y)
        err = nerr(y, norm.rmsnorm_ref(x, w, 1e-6, residual=r2))
        tn = graph_time(lambda i=0: norm.rmsnorm(x, w, 1e-6, residual=res, out=y))
        row(f"rmsnorm+res T={t_}", tn, 4 * x.numel() * 4 / copy_bw, err)
        gate = torch.randn(t_, 18944, device="cuda", generator=g)
        up = torch.randn(t_, 18944, device="cuda", generator=g)
        yo = torch.full_like(gate, float("nan"))
        glu.glu(gate, up, "silu", out=yo)
        err = nerr(yo, glu.glu_ref(gate, up, "silu"))
        tg = graph_time(lambda i=0: glu.glu(gate, up, "silu", out=yo))
        row(f"swiglu T={t_}", tg, 3 * gate.numel() * 4 / copy_bw, err)
        q = torch.randn(t_, 28, 128, device="cuda", generator=g)
        pos = torch.arange(t_, device="cuda", dtype=torch.int32) + 1000
        ref = rope.rope_ref(q.clone(), pos, 1e6, True)
        rope.rope(q, pos, 1e6, True)
        err = nerr(q, ref)
        tr = graph_time(lambda i=0: rope.rope(q, pos, 1e6, True))
        row(f"rope neox T={t_}", tr, 2 * q.numel() * 4 / copy_bw, err)

    _attn_section(g, copy_bw, mm_rate, row)


def _sample_section(g, copy_bw, row):
    """carve_kernels/sample.py at Qwen2's, gpt-oss's and a 32k vocabulary: greedy and the
    default chain (top-k 40, top-p 0.95, min-p 0.05, penalty 1.1 over 64), each first-pass
    variant (its programs, the best ids each keeps: keeping 64 is the earlier sampler, rounds of
    block maxima over every part's best) checked draw by draw against sample_ref, then timed
    from a graph; the floor is one read of the logits."""
    from carve_kernels import sample
    from engine.process.sampling_params import SamplingParams

    variants = [(f"parts {p} keep {k}", p, k) for p, k in
                ((128, 64), (128, sample.FIRST), (128, 4), (128, 16), (64, sample.FIRST))]
    for n_vocab in (151936, 201088, 32000):
        logits = torch.randn(n_vocab, device="cuda", generator=g) * 3.0
        hist = torch.randint(0, n_vocab, (64,), device="cuda", generator=g).tolist()
        for label, params in (("greedy", SamplingParams(temperature=0.0)),
                              ("default", SamplingParams())):
            for name, parts, first in variants:
                state = torch.zeros(launch.SAMPLE_STATE, dtype=torch.int32, device="cuda")
                keys = torch.zeros(launch.SAMPLE_KEYS, dtype=torch.int64, device="cuda")
                out = torch.zeros(1, dtype=torch.int64, device="cuda")
                sample.write_settings(state, params, 12345, hist)
                h, bad = list(hist), 0
                for d in range(16):
                    sample.sample(logits.clone(), state, keys, out, parts=parts, first=first)
                    want = sample.sample_ref(logits, params, 12345, h, d)
                    bad += int(out) != want
                    h.append(want)
                work = logits.clone()
                t = graph_time(lambda i=0: sample.sample(work, state, keys, out, parts=parts,
                                                         first=first))
                row(f"sample {label} V={n_vocab} {name}", t, 4 * n_vocab / copy_bw,
                    None, f"{bad} of 16 draws differ")


def _attn_section(g, copy_bw, mm_rate, row):
    # -- attention, Qwen2-7B heads: 28 q heads, 4 kv heads, head_dim 128
    nh, kvh, d = 28, 4, 128
    for kv_type in ("f16", "q8_0"):
        for depth in (4096, 32768):
            cells = depth
            src = torch.randn(cells, kvh, d, device="cuda", generator=g)
            allpos = torch.arange(cells, device="cuda", dtype=torch.int32)
            if kv_type == "f16":
                kc = torch.empty(cells, kvh, d, device="cuda", dtype=torch.float16)
            else:
                kc = torch.empty(cells * kvh * d // 32 * 34, device="cuda", dtype=torch.uint8)
            vc = torch.empty_like(kc)
            kv_cache.kv_store(src, kc, allpos, cells)
            kv_cache.kv_store(src.flip(0), vc, allpos, cells)
            qd = torch.randn(nh, d, device="cuda", generator=g)
            posd = torch.tensor([depth - 1], device="cuda", dtype=torch.int32)
            ws_ = attention.decode_workspace(nh, d, cells, "cuda")
            o = torch.full_like(qd, float("nan"))
            attention.attn_decode(qd, kc, vc, posd, kvh, cells, 0, d**-0.5, out=o, workspace=ws_)
            err = nerr(o, attention.attn_decode_ref(qd, kc, vc, posd, kvh, cells, 0, d**-0.5))
            ta = graph_time(lambda i=0: attention.attn_decode(qd, kc, vc, posd, kvh, cells, 0,
                                                             d**-0.5, out=o, workspace=ws_))
            row(f"attn decode {kv_type} depth {depth}", ta, 2 * kc.numel() * kc.element_size()
                / copy_bw, err)
            if depth == 4096:
                # prefill chunk of 512 at position 3584 over 3584 cached + 512 own keys
                t_ = 512
                qp = torch.randn(t_, nh, d, device="cuda", generator=g, dtype=torch.bfloat16)
                kn = torch.randn(t_, kvh, d, device="cuda", generator=g, dtype=torch.bfloat16)
                vn = torch.randn(t_, kvh, d, device="cuda", generator=g, dtype=torch.bfloat16)
                op = torch.full_like(qp, float("nan"))
                attention.attn_prefill(qp, kn, vn, kc, vc, 3584, cells, 0, d**-0.5, out=op)
                err = nerr(op, attention.attn_prefill_ref(qp, kn, vn, kc, vc, 3584, cells, 0,
                                                          d**-0.5))
                tp = do_bench(lambda: attention.attn_prefill(qp, kn, vn, kc, vc, 3584, cells, 0,
                                                             d**-0.5, out=op),
                              warmup=20, rep=100, return_mode="median") / 1e3
                keys = 3584 * t_ + t_ * (t_ + 1) / 2
                row(f"attn prefill {kv_type} 512@3584", tp, 4 * keys * d * nh / mm_rate, err)
                tp0 = do_bench(lambda: attention.attn_prefill(qp, kn, vn, kc, vc, 0, cells, 0,
                                                              d**-0.5, out=op),
                               warmup=20, rep=100, return_mode="median") / 1e3
                row(f"attn prefill {kv_type} 512@0", tp0, 4 * t_ * (t_ + 1) / 2 * d * nh / mm_rate)
            kc = vc = src = None  # free the cache before the next depth
            torch.cuda.empty_cache()


def _latent_section(g, copy_bw, mm_rate, row, dev="cuda", timer=None, bench=None,
                    heads=(16, 128), depths=(4096, 32768), chunk=512):
    """DeepSeek's latent attention (carve_kernels/latent.py): V2-Lite's 16 heads and V3's 128,
    a latent of 512 and 64 rotated dims. Decode over f16 and q8_0 caches at two depths (floor:
    the cache read once), prefill of 512 rows at 3584 (floor: its products at the matmul
    rate), and decode's per-head matrices attn_k_b and attn_v_b (floor: their bf16 bytes read
    once). ``timer``/``bench``: graph_time and do_bench's median; the rest shrink the shapes
    (a CPU smoke test under the interpreter passes its own)."""
    timer = timer or graph_time
    bench = bench or (lambda fn: do_bench(fn, warmup=20, rep=100, return_mode="median") / 1e3)
    c, r, nope, vd = 512, 64, 128, 128
    w = c + r
    for h in heads:
        q_all = torch.randn(chunk, h, nope + r, device=dev, generator=g, dtype=torch.bfloat16)
        q_lat = torch.randn(chunk, h, c, device=dev, generator=g, dtype=torch.bfloat16)
        k_b = torch.randn(h, c, nope, device=dev, generator=g, dtype=torch.bfloat16) * 0.05
        v_b = torch.randn(h, vd, c, device=dev, generator=g, dtype=torch.bfloat16) * 0.05
        o1 = torch.full((1, h, c), float("nan"), device=dev, dtype=torch.bfloat16)
        latent.head_matmul(q_all[:1, :, :nope], k_b, o1)
        err = nerr(o1, latent.head_matmul_ref(q_all[:1, :, :nope], k_b, o1.float().clone()))
        row(f"latent k_b x{h} heads decode", timer(lambda: latent.head_matmul(
            q_all[:1, :, :nope], k_b, o1)), 2 * k_b.numel() * 2 / copy_bw, err)
        ov = torch.full((1, h, vd), float("nan"), device=dev, dtype=torch.bfloat16)
        latent.head_matmul(q_lat[:1], v_b, ov)
        err = nerr(ov, latent.head_matmul_ref(q_lat[:1], v_b, ov.float().clone()))
        row(f"latent v_b x{h} heads decode", timer(lambda: latent.head_matmul(q_lat[:1], v_b, ov)),
            2 * v_b.numel() * 2 / copy_bw, err)
        ws = (torch.empty(h, launch.ATTN_SPLITS, latent.workspace_width(c), device=dev),
              torch.empty(h, launch.ATTN_SPLITS, device=dev))
        for kv_type in ("f16", "q8_0"):
            for depth in depths:
                rows = torch.randn(depth, w, device=dev, generator=g) * 0.5
                if kv_type == "f16":
                    cache = torch.empty(depth, 1, w, device=dev, dtype=torch.float16)
                else:
                    cache = torch.empty(depth * w // 32 * 34, device=dev, dtype=torch.uint8)
                latent.latent_store(rows, cache, torch.arange(depth, device=dev), depth)
                pos = torch.tensor([depth - 1], device=dev)
                o = torch.full((1, h, c), float("nan"), device=dev, dtype=torch.bfloat16)
                args = (q_lat[:1], q_all[:1, :, nope:], cache, pos, depth, 0.1, o)
                latent.latent_attention(*args, workspace=ws)
                err = nerr(o, latent.latent_attention_ref(*args[:6], o.float().clone()))
                row(f"latent decode {kv_type} x{h} depth {depth}",
                    timer(lambda: latent.latent_attention(*args, workspace=ws)),
                    2 * cache.numel() * cache.element_size() / copy_bw, err)
                if depth == depths[0]:  # a chunk at the end of the cache (512 at 3584)
                    pp = torch.arange(depth - chunk, depth, device=dev)
                    op = torch.full((chunk, h, c), float("nan"), device=dev, dtype=torch.bfloat16)
                    pargs = (q_lat, q_all[..., nope:], cache, pp, depth, 0.1, op)
                    latent.latent_attention(*pargs)
                    err = nerr(op, latent.latent_attention_ref(*pargs[:6], op.float().clone()))
                    keys = (depth - chunk) * chunk + chunk * (chunk + 1) / 2
                    row(f"latent prefill {kv_type} x{h} {chunk}@{depth - chunk}",
                        bench(lambda: latent.latent_attention(*pargs)),
                        2 * keys * h * (w + c) / mm_rate, err)
                cache = rows = None
                torch.cuda.empty_cache()


def _table(rows, best_cfg, args, copy_bw, mm_rate):
    print("\n| kernel | time us | floor us | % of floor | err |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        e = "" if r["err"] is None else f"{r['err']:.1e}"
        print(f"| {r['kernel']} | {r['us']:.1f} | {r['floor_us']:.1f} | "
              f"{100 * r['of_floor']:.0f} | {e} |")
    print("best GEMV configs:", json.dumps(best_cfg))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": copy_bw, "mm_rate": mm_rate, "rows": rows,
                       "best_cfg": best_cfg}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

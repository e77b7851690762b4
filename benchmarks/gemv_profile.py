"""GEMV experiments on a GPU at Qwen2-7B and 32B shapes: tiles, bodies, fused and T launches.

    python -m benchmarks.gemv_profile [--probes | --ncu | --tlayout [--quick] [--glu] | --q8x | --qkv]

With no option: the Q4_K storage-order body (bf16 x) over a sweep of tiles against the generic
walk (float32 x), Q6_K over its tiles, then the fused launches (gate/up + GLU, q/k/v) against the
separate ones. ``--probes``: where the Q4_K GEMV's time goes (its loads alone, x in float32);
``--ncu``: a short run for the profiler; ``--tlayout``: the T-layout gate/up launch over its
tiles, then the T-layout GEMV (carve_kernels/gemv_t.py) against the GGUF-layout one at 7B, 32B and
head shapes (``--glu``: the gate/up launch only; ``--quick``: the default T tile only); ``--q8x``:
the T GEMVs on float x against int8 x; ``--qkv``: q/k/v in one launch, GGUF order against T.

Prints one line per variant: microseconds per call, GB/s of weight bytes read and the normalized
error against the reference. Times are replays of a CUDA graph of 8 calls with four weight copies
cycled (no L2 hits). Needs a CUDA GPU.
"""

# The timed lambda runs at once inside its loop iteration.
# ruff: noqa: B023, BLE001

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from benchmarks.device_check import ROTATE, graph_time, nerr, require_cuda
from carve_kernels import gemv_fused, glu, quant_matmul
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt

PART = 4 << 20  # floats: the T GEMVs' split sums (spec/launch.py), any shape here
TILES = [(4, 8, 4), (8, 8, 4), (8, 4, 4), (4, 16, 4), (8, 16, 4), (16, 8, 4)]
Q6_TILES = [(2, 16, 4), (4, 16, 8), (2, 16, 8), (4, 16, 4), (2, 32, 4), (4, 8, 4)]
SHAPES = ((18944, 3584), (3584, 18944))  # ffn_up, ffn_down of Qwen2-7B


def _variants(t: int) -> list[tuple[str, tuple, torch.dtype]]:
    """(label, tile, x dtype): the GEMV picks its body from x's dtype (the Q4_K storage-order
    body for 16-bit x, the generic walk for float32)."""
    if t == qt.Q4_K:
        return [("storage-order", c, torch.bfloat16) for c in TILES] \
            + [("generic f32 x", (4, 16, 4), torch.float32)]
    return [("generic", c, torch.bfloat16) for c in Q6_TILES]


def _sweep(g: torch.Generator) -> dict:
    best: dict = {}
    for t in (qt.Q4_K, qt.Q6_K):
        for s in SHAPES:
            ws = [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
            x32 = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16).float()
            ref = quant_matmul.gemv_ref(ws[0], t, x32)
            nb = ws[0].numel()
            for label, cfg, dt in _variants(t):
                x = x32.to(dt)
                y = torch.empty(1, s[0], device="cuda", dtype=dt)
                try:
                    quant_matmul.gemv(ws[0], t, x, out=y, config=cfg)
                    err = nerr(y.float(), ref)
                    sec = graph_time(lambda i=0, c=cfg: quant_matmul.gemv(
                        ws[i % ROTATE], t, x, out=y, config=c))
                except Exception as exc:
                    print(f"{qt.type_name(t)} {s} {label} {cfg}: {type(exc).__name__} {exc}"[:300],
                          flush=True)
                    continue
                print(f"{qt.type_name(t)} {s} {label} {cfg}: {sec * 1e6:.1f} us "
                      f"{nb / sec / 1e9:.0f} GB/s err {err:.1e}", flush=True)
                key = (t, s)
                if key not in best or sec < best[key][2]:
                    best[key] = (label, cfg, sec)
    for (t, s), (label, cfg, sec) in best.items():
        print(f"# best {qt.type_name(t)} {s}: {label} {cfg} {sec * 1e6:.1f} us", flush=True)
    return best


@triton.jit
def _stream_kernel(w_ptr, y_ptr, N, row_bytes, nblk, BLOCK_R: tl.constexpr,
                   BLOCK_B: tl.constexpr):
    # the Q4_K body's weight loads alone (same tile and addresses, bytes summed): the memory
    # side's ceiling for this access pattern
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_c = tl.minimum(rows, N - 1).to(tl.int64)
    c = tl.arange(0, 4)
    lane = tl.arange(0, 32)
    tb = tl.arange(0, BLOCK_B)
    q_off = (16 + c * 32)[:, None] + lane[None, :]
    acc = tl.zeros([BLOCK_R, BLOCK_B, 4, 32], dtype=tl.int32)
    for b0 in range(0, nblk, BLOCK_B):
        base = rows_c[:, None] * row_bytes + tl.minimum(b0 + tb, nblk - 1)[None, :] * 144
        base = tl.multiple_of(base, [16, 16])
        acc += tl.load(w_ptr + base[:, :, None, None] + q_off[None, None, :, :]).to(tl.int32)
    tl.store(y_ptr + rows, tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1), mask=rows < N)


def _probes(g: torch.Generator) -> None:
    """Where the Q4_K GEMV's time goes: its loads alone, and x in float32 (no bf16 convert)."""
    for s in SHAPES:
        ws = [random_weight(qt.Q4_K, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
        nb = ws[0].numel()
        y = torch.empty(s[0], device="cuda", dtype=torch.int32)
        for cfg in ((8, 8, 4), (4, 16, 4), (8, 16, 4), (16, 8, 4)):
            grid = (triton.cdiv(s[0], cfg[0]),)
            sec = graph_time(lambda i=0, c=cfg: _stream_kernel[grid](
                ws[i % ROTATE], y, s[0], ws[0].shape[1], s[1] // 256, BLOCK_R=c[0],
                BLOCK_B=c[1], num_warps=c[2]))
            print(f"probe Q4_K {s} loads only {cfg}: {sec * 1e6:.1f} us {nb / sec / 1e9:.0f} GB/s",
                  flush=True)
        cfg = quant_matmul.gemv_config(qt.Q4_K, *s)
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(1, s[1], device="cuda", generator=g).to(dt)
            yy = torch.empty(1, s[0], device="cuda", dtype=dt)
            sec = graph_time(lambda i=0: quant_matmul.gemv(ws[i % ROTATE], qt.Q4_K, x, out=yy))
            print(f"probe Q4_K {s} gemv {cfg} x {dt}: {sec * 1e6:.1f} us "
                  f"{nb / sec / 1e9:.0f} GB/s", flush=True)


def _fused(g: torch.Generator) -> None:
    f, h, kv = 18944, 3584, 512
    gates = [random_weight(qt.Q4_K, f, h, "cuda", g) for _ in range(ROTATE)]
    ups = [random_weight(qt.Q4_K, f, h, "cuda", g) for _ in range(ROTATE)]
    x = torch.randn(1, h, device="cuda", generator=g).to(torch.bfloat16)
    both = torch.empty(1, 2 * f, device="cuda", dtype=torch.bfloat16)
    act = torch.empty(1, f, device="cuda", dtype=torch.bfloat16)

    def separate(i=0):
        quant_matmul.gemv(gates[i % ROTATE], qt.Q4_K, x, out=both[:, :f])
        quant_matmul.gemv(ups[i % ROTATE], qt.Q4_K, x, out=both[:, f:])
        glu.glu(both[:, :f], both[:, f:], "silu", out=act)

    sep = graph_time(separate)
    fused = graph_time(lambda i=0: gemv_fused.gemv_glu(gates[i % ROTATE], ups[i % ROTATE],
                                                       qt.Q4_K, x, "silu", out=act))
    separate(0)
    ref = act.float().clone()
    gemv_fused.gemv_glu(gates[0], ups[0], qt.Q4_K, x, "silu", out=act)
    print(f"gate/up+GLU Q4_K: separate {sep * 1e6:.1f} us, fused {fused * 1e6:.1f} us "
          f"({2 * gates[0].numel() / fused / 1e9:.0f} GB/s) err {nerr(act.float(), ref):.1e}",
          flush=True)
    mats = [[(random_weight(t, n, h, "cuda", g), t) for t, n in
             ((qt.Q4_K, h), (qt.Q4_K, kv), (qt.Q6_K, kv))] for _ in range(ROTATE)]
    bias = [torch.randn(n, device="cuda", generator=g) for n in (h, kv, kv)]
    qkv = torch.empty(1, h + 2 * kv, device="cuda", dtype=torch.bfloat16)

    def three(i=0):
        o = 0
        for (w, t), b in zip(mats[i % ROTATE], bias):
            quant_matmul.gemv(w, t, x, out=qkv[:, o:o + w.shape[0]], bias=b)
            o += w.shape[0]

    sep = graph_time(three)
    one = graph_time(lambda i=0: gemv_fused.gemv3(mats[i % ROTATE], x, qkv, bias))
    nb = sum(w.numel() for w, _ in mats[0])
    print(f"q/k/v (Q4_K, Q4_K, Q6_K): separate {sep * 1e6:.1f} us, one launch {one * 1e6:.1f} "
          f"us ({nb / one / 1e9:.0f} GB/s)", flush=True)


# (rows per program, warps, programs aimed at)
T_CONFIGS = [(256, 4, 1056), (512, 4, 1056), (512, 8, 1056), (256, 2, 1056), (128, 2, 1056),
             (256, 4, 528), (256, 4, 2112)]
T_GLU_CONFIGS = [(256, 4, 2112), (128, 4, 2112), (512, 8, 2112), (256, 8, 2112)]
T_SHAPES = [(qt.Q4_K, s) for s in (*SHAPES, (27648, 5120), (5120, 27648), (3584, 3584),
                                    (896, 4864), (5120, 5120))] \
    + [(qt.Q6_K, s) for s in ((3584, 18944), (152064, 3584), (896, 4864), (5120, 27648),
                              (152064, 5120))]


def _tlayout(g: torch.Generator, quick: bool) -> None:
    """The T-layout GEMV (carve_kernels/gemv_t.py) against the GGUF-layout one, same data."""
    from carve_kernels import gemv_t, t_layout

    for t, s in T_SHAPES:
        ws = [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
        wts = [t_layout.repack(w, t) for w in ws]
        x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
        y = torch.empty(1, s[0], device="cuda", dtype=torch.bfloat16)
        part = torch.empty(PART, device="cuda")
        cnt = torch.zeros(1, 4096, device="cuda", dtype=torch.int32)
        ref = quant_matmul.gemv_ref(ws[0], t, x.float())
        nb = ws[0].numel()
        name = f"T {qt.type_name(t)} {s}"
        quant_matmul.gemv(ws[0], t, x, out=y)
        err = nerr(y.float(), ref)
        sec = graph_time(lambda i=0: quant_matmul.gemv(ws[i % ROTATE], t, x, out=y))
        print(f"{name} gguf layout {quant_matmul.gemv_config(t, *s)}: {sec * 1e6:.1f} us "
              f"{nb / sec / 1e9:.0f} GB/s err {err:.1e}", flush=True)
        for cfg in [gemv_t.T_CONFIG] if quick else T_CONFIGS:
            try:
                gemv_t.gemv_t(wts[0], t, s[0], x, y, part, cnt, config=cfg)
                err = nerr(y.float(), ref)
                sec = graph_time(lambda i=0, c=cfg: gemv_t.gemv_t(
                    wts[i % ROTATE], t, s[0], x, y, part, cnt, config=c))
                left = float(cnt.abs().max())
            except Exception as exc:
                print(f"{name} {cfg}: {type(exc).__name__} {exc}"[:300], flush=True)
                continue
            print(f"{name} t-layout {cfg}: {sec * 1e6:.1f} us {nb / sec / 1e9:.0f} GB/s "
                  f"err {err:.1e} left {left}", flush=True)


def _tglu(g: torch.Generator) -> None:
    """The T-layout gate/up + GLU launch at 7B and 32B shapes over T_CONFIGS."""
    from carve_kernels import gemv_t, t_layout

    for t, s in ((qt.Q4_K, (18944, 3584)), (qt.Q4_K, (27648, 5120))):
        ws = [[t_layout.repack(random_weight(t, s[0], s[1], "cuda", g), t) for _ in range(2)]
              for _ in range(ROTATE)]
        x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
        y = torch.empty(1, s[0], device="cuda", dtype=torch.bfloat16)
        part = torch.empty(PART, device="cuda")
        cnt = torch.zeros(1, 4096, device="cuda", dtype=torch.int32)
        nb = 2 * ws[0][0].numel()
        for cfg, paired in [(c, p) for c in T_GLU_CONFIGS for p in (True, False)]:
            try:
                sec = graph_time(lambda i=0, c=cfg, p=paired: gemv_t.gemv_t_glu(
                    *ws[i % ROTATE], t, s[0], x, y, part, cnt, config=c, paired=p))
            except Exception as exc:
                print(f"T glu {s} {cfg}: {type(exc).__name__} {exc}"[:300], flush=True)
                continue
            print(f"T glu {qt.type_name(t)} {s} {cfg} paired={paired}: {sec * 1e6:.1f} us "
                  f"{nb / sec / 1e9:.0f} GB/s", flush=True)


def _q8x(g: torch.Generator) -> None:
    """The Q4_K T GEMVs on float x against the same on x's int8 copy (dp4a), same weights."""
    from carve_kernels import gemv_t, q8x, t_layout

    for s in ((18944, 3584), (3584, 18944), (27648, 5120), (5120, 27648)):
        ws = [t_layout.repack(random_weight(qt.Q4_K, s[0], s[1], "cuda", g), qt.Q4_K)
              for _ in range(ROTATE)]
        x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
        xq, xr = q8x.copy_ref(x[0])
        ref = quant_matmul.gemv_ref(t_layout.unpack(ws[0], qt.Q4_K, s[0]), qt.Q4_K, xr)
        y = torch.empty(1, s[0], device="cuda", dtype=torch.bfloat16)
        part = torch.empty(PART, device="cuda")
        cnt = torch.zeros(4096, device="cuda", dtype=torch.int32)
        nb = ws[0].numel()
        base = graph_time(lambda i=0: gemv_t.gemv_t(ws[i % ROTATE], qt.Q4_K, s[0], x, y, part,
                                                    cnt))
        gemv_t.gemv_t(ws[0], qt.Q4_K, s[0], x, y, part, cnt, xq=xq)
        err = nerr(y.float(), ref)
        sec = graph_time(lambda i=0: gemv_t.gemv_t(ws[i % ROTATE], qt.Q4_K, s[0], x, y, part,
                                                   cnt, xq=xq))
        print(f"Q4_K {s}: float x {base * 1e6:.1f} us, int8 x {sec * 1e6:.1f} us "
              f"({nb / sec / 1e9:.0f} GB/s, {base / sec:.2f}x) err {err:.1e}", flush=True)
        if s[0] > s[1]:  # an up shape: the gate/up pair too
            glu_f = graph_time(lambda i=0: gemv_t.gemv_t_glu(
                ws[i % ROTATE], ws[(i + 1) % ROTATE], qt.Q4_K, s[0], x, y, part, cnt))
            glu_q = graph_time(lambda i=0: gemv_t.gemv_t_glu(
                ws[i % ROTATE], ws[(i + 1) % ROTATE], qt.Q4_K, s[0], x, y, part, cnt, xq=xq))
            print(f"Q4_K gate/up {s}: float x {glu_f * 1e6:.1f} us, int8 x {glu_q * 1e6:.1f} "
                  f"us ({2 * nb / glu_q / 1e9:.0f} GB/s, {glu_f / glu_q:.2f}x)", flush=True)


QKV_SHAPES = (("7B", 3584, 3584, 512), ("32B", 5120, 5120, 1024))
QKV_CONFIGS = [(256, 4, 2112), (128, 4, 2112), (128, 4, 1056), (64, 2, 2112), (128, 8, 2112)]


def _qkv(g: torch.Generator) -> None:
    """q, k, v in one launch: the GGUF-order gemv3 against gemv_t3 on float x and on x's int8
    copy (Q4_K q and k, v Q4_K or Q6_K as Q4_K_M gives it); then single small matrices,
    GGUF order against T on int8 x (where T_MIN_BYTES sits once x is int8)."""
    from carve_kernels import gemv_t, gemv_t3, q8x, t_layout

    for label, e, nq, nkv in QKV_SHAPES:
        for tv in (qt.Q4_K, qt.Q6_K):
            types, rows = (qt.Q4_K, qt.Q4_K, tv), (nq, nkv, nkv)
            ws = [[random_weight(t, r, e, "cuda", g) for t, r in zip(types, rows)]
                  for _ in range(ROTATE)]
            ts = [[(t_layout.repack(w, t), t, r) for w, t, r in zip(m, types, rows)] for m in ws]
            nb = sum(w.numel() for w in ws[0])
            x = torch.randn(1, e, device="cuda", generator=g).to(torch.bfloat16)
            xq, xr = q8x.copy_ref(x[0])
            ref = torch.cat([quant_matmul.gemv_ref(w, t, xr) for w, t in zip(ws[0], types)], 1)
            y = torch.empty(1, sum(rows), device="cuda", dtype=torch.bfloat16)
            part = torch.empty(PART, device="cuda")
            cnt = torch.zeros(4096, device="cuda", dtype=torch.int32)
            base = graph_time(lambda i=0: gemv_fused.gemv3(
                [(w, t) for w, t in zip(ws[i % ROTATE], types)], x, y))
            tag = f"{label} qkv v={qt.type_name(tv)} {nb / 1e6:.1f} MB"
            print(f"{tag}: gemv3 {base * 1e6:.1f} us ({nb / base / 1e9:.0f} GB/s)", flush=True)
            for cfg in QKV_CONFIGS:
                for use in (False, True):
                    gemv_t3.gemv_t3(ts[0], x, y, part, cnt, config=cfg, xq=xq if use else None)
                    err = nerr(y.float(), ref)
                    sec = graph_time(lambda i=0: gemv_t3.gemv_t3(
                        ts[i % ROTATE], x, y, part, cnt, config=cfg, xq=xq if use else None))
                    print(f"  t3 {cfg} {'int8' if use else 'float'}: {sec * 1e6:.1f} us "
                          f"({nb / sec / 1e9:.0f} GB/s, {base / sec:.2f}x) err {err:.1e}",
                          flush=True)
    for t, s in ((qt.Q4_K, (3584, 3584)), (qt.Q4_K, (5120, 5120)), (qt.Q4_K, (512, 3584)),
                 (qt.Q6_K, (896, 4864)), (qt.Q4_K, (896, 4864))):
        ws = [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
        ts = [t_layout.repack(w, t) for w in ws]
        x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
        xq, _ = q8x.copy_ref(x[0])
        y = torch.empty(1, s[0], device="cuda", dtype=torch.bfloat16)
        part = torch.empty(PART, device="cuda")
        cnt = torch.zeros(4096, device="cuda", dtype=torch.int32)
        base = graph_time(lambda i=0: quant_matmul.gemv(ws[i % ROTATE], t, x, out=y))
        line = f"{qt.type_name(t)} {s} {ws[0].numel() / 1e6:.1f} MB: gguf {base * 1e6:.1f} us"
        for cfg in (None, (128, 4, 2112), (64, 2, 2112)):
            sec = graph_time(lambda i=0: gemv_t.gemv_t(ts[i % ROTATE], t, s[0], x, y, part, cnt,
                                                       config=cfg, xq=xq))
            line += f", T int8 {cfg or 'default'} {sec * 1e6:.1f} us"
        print(line, flush=True)


def main(argv: list[str] | None = None) -> int:
    prog = "python -m benchmarks.gemv_profile"
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--probes", action="store_true", help="where the Q4_K GEMV's time goes")
    what.add_argument("--ncu", action="store_true", help="a short run for the profiler")
    what.add_argument("--tlayout", action="store_true", help="T-layout GEMVs against GGUF layout")
    what.add_argument("--q8x", action="store_true", help="the T GEMVs on float x against int8 x")
    what.add_argument("--qkv", action="store_true", help="q/k/v in one launch, GGUF order and T")
    ap.add_argument("--quick", action="store_true", help="with --tlayout: the default T tile only")
    ap.add_argument("--glu", action="store_true", help="with --tlayout: the gate/up launch only")
    args = ap.parse_args(argv)
    if not require_cuda(prog):
        return 2
    g = torch.Generator(device="cuda").manual_seed(7)
    if args.q8x:
        _q8x(g)
    elif args.qkv:
        _qkv(g)
    elif args.tlayout:
        _tglu(g)
        if not args.glu:
            _tlayout(g, args.quick)
    elif args.ncu:
        for t in (qt.Q4_K, qt.Q6_K):
            w = random_weight(t, 3584, 18944, "cuda", g)
            x = torch.randn(1, 18944, device="cuda", generator=g)
            y = torch.empty(1, 3584, device="cuda")
            for _ in range(2):
                quant_matmul.gemv(w, t, x, out=y)
        torch.cuda.synchronize()
    elif args.probes:
        _probes(g)
    else:
        _sweep(g)
        _fused(g)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""GEMV experiments on a GPU at the Qwen2-7B shapes: the Q4_K/Q6_K storage-order bodies over a
sweep of tiles against the generic walk, and the fused launches (gate/up + GLU, q/k/v) against
the separate ones; ``--ncu`` makes a short run for the profiler.

    python -m kernels.gemv_profile [--quick] [--ncu]

Times are replays of a CUDA graph of 8 calls with four weight copies cycled (no L2 hits);
GB/s counts the weight bytes read.
"""

# The timed lambda runs at once inside its loop iteration.
# ruff: noqa: B023, BLE001

from __future__ import annotations

import sys

import torch

from engine import quant_types as qt
from kernels import glu, quant_matmul
from kernels.device_check import ROTATE, graph_time, nerr
from kernels.random_blocks import random_weight

TILES = [(r, b, w) for r in (2, 4, 8) for b in (2, 4, 8) for w in (4, 8)]
QUICK = [(4, 8, 4), (4, 4, 4), (2, 8, 4), (8, 4, 8)]
SHAPES = ((18944, 3584), (3584, 18944))  # ffn_up, ffn_down of Qwen2-7B


def _sweep(g: torch.Generator, tiles) -> dict:
    best: dict = {}
    for t in (qt.Q4_K, qt.Q6_K):
        for s in SHAPES:
            ws = [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
            x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
            y = torch.empty(1, s[0], device="cuda", dtype=torch.bfloat16)
            ref = quant_matmul.gemv_ref(ws[0], t, x.float())
            nb = ws[0].numel()
            old = quant_matmul.GEMV_CONFIG[t] if t != qt.Q4_K else (4, 16, 4)
            old = old if t != qt.Q6_K else (2, 16, 4)
            sec = graph_time(lambda i=0: quant_matmul.gemv(ws[i % ROTATE], t, x, out=y,
                                                           config=old, special=False))
            print(f"{qt.type_name(t)} {s} generic {old}: {sec * 1e6:.1f} us "
                  f"{nb / sec / 1e9:.0f} GB/s", flush=True)
            for cfg in tiles:
                try:
                    quant_matmul.gemv(ws[0], t, x, out=y, config=cfg, special=True)
                    err = nerr(y.float(), ref)
                    sec = graph_time(lambda i=0, c=cfg: quant_matmul.gemv(
                        ws[i % ROTATE], t, x, out=y, config=c, special=True))
                except Exception as exc:
                    print(f"{qt.type_name(t)} {s} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                print(f"{qt.type_name(t)} {s} special {cfg}: {sec * 1e6:.1f} us "
                      f"{nb / sec / 1e9:.0f} GB/s err {err:.1e}", flush=True)
                key = (t, s)
                if key not in best or sec < best[key][1]:
                    best[key] = (cfg, sec)
    for (t, s), (cfg, sec) in best.items():
        print(f"# best {qt.type_name(t)} {s}: {cfg} {sec * 1e6:.1f} us", flush=True)
    return best


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
    ref = act.float().clone()
    fused = graph_time(lambda i=0: quant_matmul.gemv_glu(gates[i % ROTATE], ups[i % ROTATE],
                                                         qt.Q4_K, x, "silu", out=act))
    quant_matmul.gemv_glu(gates[0], ups[0], qt.Q4_K, x, "silu", out=act)
    separate(0)
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
    one = graph_time(lambda i=0: quant_matmul.gemv3(mats[i % ROTATE], x, qkv, bias))
    nb = sum(w.numel() for w, _ in mats[0])
    print(f"q/k/v (Q4_K, Q4_K, Q6_K): separate {sep * 1e6:.1f} us, one launch {one * 1e6:.1f} "
          f"us ({nb / one / 1e9:.0f} GB/s)", flush=True)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    if "--ncu" in sys.argv:
        for t in (qt.Q4_K, qt.Q6_K):
            w = random_weight(t, 3584, 18944, "cuda", g)
            x = torch.randn(1, 18944, device="cuda", generator=g)
            y = torch.empty(1, 3584, device="cuda")
            for _ in range(2):
                quant_matmul.gemv(w, t, x, out=y)
        torch.cuda.synchronize()
        return
    _sweep(g, QUICK if "--quick" in sys.argv else TILES)
    _fused(g)


if __name__ == "__main__":
    main()

"""GEMV experiments on a GPU: pipelining depth and tile sweeps for Q4_K / Q6_K at the
Qwen2-7B ffn shapes, and a short run for `ncu` to profile (--ncu).

    python -m kernels.gemv_profile [--ncu]
"""

# The timed lambda runs at once inside its loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import sys

import torch

from engine import quant_types as qt
from kernels import quant_matmul
from kernels.device_check import ROTATE, graph_time
from kernels.random_blocks import random_weight

CONFIGS = [(4, 16, 4), (4, 4, 4, 3), (4, 8, 4, 3), (4, 4, 4, 4), (2, 8, 4, 3), (8, 4, 4, 3),
           (4, 4, 2, 3), (2, 16, 4), (4, 8, 8, 3)]


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
    for t in (qt.Q4_K, qt.Q6_K):
        for s in ((18944, 3584), (3584, 18944)):
            ws = [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
            x = torch.randn(1, s[1], device="cuda", generator=g)
            y = torch.empty(1, s[0], device="cuda")
            for cfg in CONFIGS:
                try:
                    sec = graph_time(lambda i=0, c=cfg: quant_matmul.gemv(
                        ws[i % ROTATE], t, x, out=y, config=c))
                except Exception as exc:  # noqa: BLE001 - a config may not compile; go on
                    print(f"{qt.type_name(t)} {s} {cfg}: {type(exc).__name__}", flush=True)
                    continue
                print(f"{qt.type_name(t)} {s} cfg={cfg}: {sec * 1e6:.1f} us "
                      f"{ws[0].numel() / sec / 1e9:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()

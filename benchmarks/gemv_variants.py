"""Time GEMV variants on a GPU: the default per-element accumulator vs LANE_SUM (each part
reduced over its lanes at once), for the Qwen2-7B ffn shapes.

    python -m benchmarks.gemv_variants
"""

# The timed lambda runs at once inside its loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import torch

from benchmarks.device_check import ROTATE, graph_time
from kernels import quant_matmul
from kernels.random_blocks import random_weight
from spec import quant_types as qt


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    for t in (qt.Q4_K, qt.Q6_K, qt.Q8_0, qt.Q5_0):
        for s in ((18944, 3584), (3584, 18944)):
            ws = [random_weight(t, s[0], s[1], "cuda", g) for _ in range(ROTATE)]
            x = torch.randn(1, s[1], device="cuda", generator=g)
            y = torch.empty(1, s[0], device="cuda")
            for lane_sum in (False, True):
                for cfg in ((4, 16, 4), (8, 8, 4), (8, 16, 8)):
                    sec = graph_time(lambda i=0, ls=lane_sum, c=cfg: quant_matmul.gemv(
                        ws[i % ROTATE], t, x, out=y, config=c, lane_sum=ls))
                    gbs = ws[0].numel() / sec / 1e9
                    print(f"{qt.type_name(t)} {s} lane_sum={lane_sum} cfg={cfg}: "
                          f"{sec * 1e6:.1f} us {gbs:.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()

"""Time the T-layout Q4_K bodies (kernels/gemv_t.py T_BATCH 1 and 2) on a GPU at the Qwen2-7B
and Qwen2-32B FFN shapes: the gate/up pair with its GLU in one launch, and ffn_down.

    python -m kernels.gemv_t_bodies
"""

# The timed lambda runs at once inside its loop iteration.
# ruff: noqa: B023

from __future__ import annotations

import torch

from engine import quant_types as qt
from kernels import gemv_t
from kernels.device_check import ROTATE, graph_time
from kernels.random_blocks import random_weight


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(7)
    t = qt.Q4_K
    for f, h in ((18944, 3584), (27648, 5120)):
        gates = [gemv_t.repack(random_weight(t, f, h, "cuda", g), t) for _ in range(ROTATE)]
        ups = [gemv_t.repack(random_weight(t, f, h, "cuda", g), t) for _ in range(ROTATE)]
        downs = [gemv_t.repack(random_weight(t, h, f, "cuda", g), t) for _ in range(ROTATE)]
        x = torch.randn(1, h, device="cuda", generator=g).to(torch.bfloat16)
        xf = torch.randn(1, f, device="cuda", generator=g).to(torch.bfloat16)
        act = torch.empty(1, f, device="cuda", dtype=torch.bfloat16)
        y = torch.empty(1, h, device="cuda", dtype=torch.bfloat16)
        part = torch.zeros(2 * f, device="cuda")
        cnt = torch.zeros(4096, device="cuda", dtype=torch.int32)
        nb = 2 * gates[0].numel()
        for batch in (1, 2):
            sec = graph_time(lambda i=0: gemv_t.gemv_t_glu(
                gates[i % ROTATE], ups[i % ROTATE], t, f, x, act, part, cnt, batch=batch))
            sd = graph_time(lambda i=0: gemv_t.gemv_t(
                downs[i % ROTATE], t, h, xf, y, part, cnt, batch=batch))
            print(f"Q4_K {f}x{h} body {batch}: gate/up+GLU {sec * 1e6:.1f} us "
                  f"({nb / sec / 1e9:.0f} GB/s), down {sd * 1e6:.1f} us "
                  f"({downs[0].numel() / sd / 1e9:.0f} GB/s)", flush=True)


if __name__ == "__main__":
    main()

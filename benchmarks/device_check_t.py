"""The T-layout decode GEMVs (kernels/gemv_t.py) in ``benchmarks.device_check --types``: for a
type the runner repacks (``gemv_t.WORDS``), Qwen2-7B ffn_up + ffn_down in the T layout on bf16
x and on decode's int8 copy of x, at the launch rule's tiles (spec/launch.py ``T_CONFIG``,
``T_CONFIG_LOWBIT``) and a few others, beside the same matrices' GGUF-order rows that
device_check prints before these. Each line: microseconds for the pair, its byte floor, the
error against the reference at the best tile. Needs a CUDA GPU (run through device_check).
"""

# ruff: noqa: B023

from __future__ import annotations

import torch

from benchmarks.device_check import ROTATE, graph_time, nerr
from kernels import gemv_t, q8x, quant_matmul
from spec import launch
from spec import quant_types as qt

# (rows per program, warps, target programs): the rule's two, then more rows a thread or fewer
# programs
T_CONFIGS = [launch.T_CONFIG, launch.T_CONFIG_LOWBIT, (256, 2, 2112), (512, 4, 2112),
             (256, 4, 1056)]


def t_rows(t, ws, shapes, g, copy_bw, row, best_cfg) -> None:
    """The T GEMV rows of type ``t`` for the GGUF-order matrices ``ws[shape]`` (ROTATE
    copies each), added through ``row`` and ``best_cfg`` as device_check's own."""
    name = qt.type_name(t)
    wts = {s: [gemv_t.repack(w, t) for w in ws[s]] for s in shapes}
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

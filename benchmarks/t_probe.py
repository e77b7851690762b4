"""One T-layout decode GEMV (carve_kernels/gemv_t.py) of each named type at Qwen2-7B's ffn_up
size (18,944 x 3,584), on decode's int8 copy of x, launched a few times and nothing else: the
program for a hardware profiler to read (the GPU machine's ``ncu``), where
``benchmarks.device_check --types`` times the same kernels among many others.

    python -m benchmarks.t_probe IQ2_XXS,Q2_K [--rows 18944 --cols 3584] [--bf16]
        [--programs N] [--no-smem]

``--no-smem``: the grid types gather their grid rows from L1 instead of reading the copy each
program makes in shared memory (``gemv_t.SMEM_TYPES``, the default).

Under ``ncu --kernel-name regex:_gemv_t_kernel --launch-skip 1 --launch-count 1 ...`` the second
call of the first type is the one profiled (the first compiles). Prints each type's time a call
(replayed from a CUDA graph, as ``device_check`` times; meaningless under the profiler) and its
error against the reference.
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.device_check import graph_time
from carve_kernels import gemv_t, q8x, quant_matmul, t_layout
from carve_kernels.random_blocks import random_weight
from spec import launch
from spec import quant_types as qt
from spec.errors import CarveError


def probe(t: int, rows: int, cols: int, int8: bool, copies: int = 4,
          programs: int = 0) -> tuple[float, float]:
    """(us a call, relative error) of one T GEMV of type ``t``: the first call compiles, the
    second is the one a profiler skipping one launch reads, then a CUDA graph of calls over
    ``copies`` copies of the matrix (more bytes than L2 holds) is timed. ``programs``: about
    that many programs (each row tile's blocks split fewer ways) instead of the config's."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [random_weight(t, rows, cols, "cuda", g) for _ in range(copies)]
    wts = [t_layout.repack(w, t) for w in ws]
    cfg = launch.t_config(t)
    if programs:
        cfg = (cfg[0], cfg[1], programs)
    floats, tiles = launch.scratch([rows], cols, cfg)
    part = torch.empty(max(floats, 1), device="cuda")
    counter = torch.zeros(max(tiles, 1), dtype=torch.int32, device="cuda")
    x = torch.randn(1, cols, device="cuda", generator=g).to(torch.bfloat16)
    xq, xr = q8x.copy_ref(x[0]) if int8 else (None, x.float())
    out = torch.full((1, rows), float("nan"), device="cuda")

    def call(i: int = 0) -> None:
        gemv_t.gemv_t(wts[i % copies], t, rows, x, out, part, counter, config=cfg, xq=xq)

    call()
    call()
    torch.cuda.synchronize()
    ref = quant_matmul.gemv_ref(ws[0], t, xr)
    err = float((out - ref).norm() / ref.norm())
    return graph_time(call, calls=2 * copies) * 1e6, err


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.t_probe", description=__doc__)
    ap.add_argument("types", help="comma-separated GGML type names of the T layout")
    ap.add_argument("--rows", type=int, default=18944)
    ap.add_argument("--cols", type=int, default=3584)
    ap.add_argument("--bf16", action="store_true", help="bf16 x instead of the int8 copy")
    ap.add_argument("--no-smem", action="store_true",
                    help="the grid types' grid rows gathered from L1, not from a shared copy")
    ap.add_argument("--programs", type=int, default=0,
                    help="about this many programs instead of the config's (fewer splits)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("t_probe: no CUDA device here", file=sys.stderr)
        return 2
    try:
        types = [qt.type_id(n.strip()) for n in args.types.split(",") if n.strip()]
    except CarveError as e:
        print(f"t_probe: {e}", file=sys.stderr)
        return 2
    if args.no_smem:
        gemv_t.SMEM_TYPES = frozenset()
    for t in types:
        if t not in t_layout.WORDS:
            print(f"t_probe: {qt.type_name(t)} has no T layout (t_layout.WORDS)", file=sys.stderr)
            return 2
        us, err = probe(t, args.rows, args.cols, not args.bf16, programs=args.programs)
        x = ("bf16" if args.bf16 else "int8") + (" no smem" if args.no_smem else "")
        x += f" ~{args.programs} programs" if args.programs else ""
        print(f"{qt.type_name(t)} T {x} x {args.rows}x{args.cols}: {us:.1f} us a call, error"
              f" {err:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

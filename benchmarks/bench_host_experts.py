"""The CPU's share of a decode step whose experts live in host memory (host_compute "cpu" and
"both"): one token's routed experts of a MoE layer, computed on this machine's cores from the
file's blocks (dequantized per routed expert, the CPU engine's way), from the CPU layouts
(engine/runtime/models/cpu_experts.py) and by the native kernel on the file's blocks
(engine/runtime/models/cpu_native.py, where it reads the types), beside a plain read of the
same bytes.

    python -m benchmarks.bench_host_experts [--shape qwen3moe-30b-a3b] [--layers 4]
        [--tokens 64] [--gate q4_k] [--down q4_k,q6_k] [--threads N]
    python -m benchmarks.bench_host_experts --shape gpt-oss-20b --gate mxfp4 --down mxfp4

Each layer is built from random well-formed blocks at the shape's expert sizes (gate and up
``--gate``, down each type of ``--down``, as llama.cpp's Q4_K_M rule gives half the layers
each; gpt-oss's experts are MXFP4, with the shape's biases and clamped SwiGLU);
every token routes to ``n_expert_used`` random experts of the next layer in turn, so the
bytes come from memory, not cache. Prints, per layout: milliseconds per layer and token, the
bytes a token's experts occupy in that layout, their rate in GB/s and that rate over the
machine's read rate of a buffer larger than its caches (measured in the same run); then one
expert tensor's product for one row, k experts at the gate's shape, in each type's CPU layout
("half" in both f16 and bf16, timed in turns): the unit llama.cpp's `test-backend-ops perf -o
MUL_MAT_ID -b CPU` times for Qwen3-30B-A3B.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from carve_kernels.random_blocks import random_weight
from engine.planning.host import cpu_bytes, cpu_layout
from engine.runtime.models import cpu_experts, cpu_native, ops
from engine.runtime.models.cpu_experts import PackedExperts, half_dtype
from engine.synth.shapes import SHAPES
from spec import quant_types as qt

ROUNDS = 5  # interleaved rounds of the one-tensor timings (this machine's noise is large)


def _layer(shape, gate_type: int, down_type: int, gen: torch.Generator) -> dict[str, list]:
    """One layer's gate, up and down expert tensors: file bytes and CPU layouts."""
    e, d, f = shape.n_expert, shape.n_embd, shape.n_ff_exp
    out: dict[str, list] = {"file": [], "cpu": []}
    for name, t, rows, cols in (("gate", gate_type, f, d), ("up", gate_type, f, d),
                                ("down", down_type, d, f)):
        raw = torch.cat([random_weight(t, rows, cols, generator=gen).reshape(-1)
                         for _ in range(e)])
        out["file"].append(ops.QExperts(name, raw, t, e, rows, cols, None,
                                        torch.empty(rows * cols)))
        span = torch.empty(cpu_bytes(f"blk.0.ffn_{name}_exps.weight", t, (cols, rows, e),
                                     raw.numel()), dtype=torch.uint8)
        if cpu_layout(t, rows, cols) == "file":
            out["cpu"].append(out["file"][-1])
            continue
        m = PackedExperts(name, cpu_layout(t, rows, cols), e, rows, cols, span)
        m.fill(raw, t, 0)
        out["cpu"].append(m)
    return out


def _bytes(m, k: int) -> int:
    """Bytes k experts of matrix m occupy in its layout."""
    if isinstance(m, ops.QExperts):
        return m.raw.numel() // m.n_expert * k
    return m.span.numel() // m.n_expert * k


def read_rate(nbytes: int = 1 << 30, runs: int = 3) -> float:
    """GB/s of a sum over a buffer larger than the caches (the memory's read rate)."""
    buf = torch.ones(nbytes // 8, dtype=torch.int64)
    buf.sum()
    t = time.perf_counter()
    for _ in range(runs):
        buf.sum()
    return nbytes * runs / (time.perf_counter() - t) / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.bench_host_experts",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="qwen3moe-30b-a3b", help="a MoE shape of carve gen")
    ap.add_argument("--layers", type=int, default=4, help="layers to rotate through per down "
                    "type (their experts must not fit in the caches)")
    ap.add_argument("--tokens", type=int, default=64, help="decode tokens timed per layout")
    ap.add_argument("--gate", default="q4_k", help="the gate and up projections' type")
    ap.add_argument("--down", default="q4_k,q6_k", help="down-projection types, comma-separated")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = ap.parse_args(argv)
    shape = SHAPES[args.shape]
    if shape.n_expert <= 1:
        raise SystemExit(f"--shape {args.shape} has no routed experts")
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    k, d, f = shape.n_expert_used, shape.n_embd, shape.n_ff_exp
    gate = qt.type_id(args.gate.strip().upper())
    oss = shape.arch == "gpt-oss"  # its experts' biases and clamped SwiGLU
    limit = 7.0 if oss else 0.0
    lib = cpu_native.library()
    rate = read_rate()
    print(f"{args.shape}: {shape.n_expert} experts of {shape.n_ff_exp} x {d}, {k} per token; "
          f"{torch.get_num_threads()} threads; memory read {rate:.1f} GB/s")
    print(f"{'down':<6} {'layout':<22} {'ms/layer':>9} {'MB/token':>9} {'GB/s':>7} "
          f"{'of read':>8} {'rel err':>8}")
    for name in args.down.split(","):
        down = qt.type_id(name.strip().upper())
        layers = [_layer(shape, gate, down, gen) for _ in range(args.layers)]
        biases = [[torch.randn(shape.n_expert, n, generator=gen) * 0.1 for n in (f, f, d)]
                  if oss else None for _ in layers]
        types = (gate, gate, down)
        hows = ["file", "cpu"]
        if lib is not None and cpu_native.supported(types, "silu", d, f):
            for lay, b in zip(layers, biases, strict=True):
                lay["native"] = [cpu_native.NativeExperts(
                    lib, [m.raw for m in lay["file"]], types, d, f, shape.n_expert, k, "silu",
                    limit, b)]
            hows.append("native")
        xs = torch.randn(args.tokens, 1, d, generator=gen)
        ids = [torch.randperm(shape.n_expert, generator=gen)[:k].view(1, k)
               for _ in range(args.tokens)]
        w = torch.softmax(torch.randn(args.tokens, 1, k, generator=gen), -1)
        ref = []
        for how in hows:
            def step(i: int, how: str = how) -> torch.Tensor:
                lay = layers[i % len(layers)]
                if how == "native":
                    y = torch.empty(1, d)
                    lay["native"][0].run(xs[i].view(-1), ids[i].view(-1).to(torch.int32),
                                         w[i].view(-1), y.view(-1))
                    return y
                g, u, dn = lay[how]
                b = biases[i % len(layers)]
                return ops.experts(xs[i], ids[i], w[i], g, u, dn, "silu", limit,
                                   None if b is None else tuple(b))

            step(0)
            outs = []
            t = time.perf_counter()
            for i in range(args.tokens):
                outs.append(step(i))
            ms = (time.perf_counter() - t) / args.tokens * 1e3
            nb = sum(_bytes(m, k) for m in layers[0]["file" if how == "native" else how])
            if how == "file":
                ref = outs
                err = 0.0
            else:
                err = max(((a - b).norm() / b.norm()).item()
                          for a, b in zip(outs, ref, strict=True))
            label = {"file": "file blocks", "native": "native (file blocks)"}.get(
                how, "CPU layouts (" + "/".join(getattr(m, "layout", "file")
                                               for m in layers[0][how]) + ")")
            gbs = nb / ms / 1e6
            print(f"{name:<6} {label:<22} {ms:9.3f} {nb / 1e6:9.2f} {gbs:7.1f} "
                  f"{gbs / rate:8.2f} {err:8.1e}")
    # one expert product of k experts at the gate's shape, the unit llama.cpp's
    # `test-backend-ops perf -o MUL_MAT_ID` times for this model (128 experts, 8 used); the
    # "half" layout in both 16-bit types; variants timed in turns, medians of the rounds
    print(f"one tensor, {k} experts x [{f}, {d}], one row (MUL_MAT_ID), median of "
          f"{ROUNDS} interleaved rounds; this machine's half type: "
          f"{str(half_dtype()).removeprefix('torch.')}:")
    print(f"{'type':<6} {'layout':<14} {'us':>9} {'GB/s':>7} {'of read':>8}")
    chosen = cpu_experts._HALF[:]
    variants = []
    for name in args.down.split(","):
        t = qt.type_id(name.strip().upper())
        layout = cpu_layout(t, f, d)
        if layout == "file":  # (no CPU layout: the file's blocks above are all there is)
            continue
        raws = [torch.cat([random_weight(t, f, d, generator=gen).reshape(-1)
                           for _ in range(shape.n_expert)]) for _ in range(args.layers)]
        for dt in ((torch.bfloat16, torch.float16) if layout == "half" else (None,)):
            cpu_experts._HALF[:] = [dt] if dt is not None else chosen
            mats = []
            for raw in raws:
                span = torch.empty(cpu_bytes("blk.0.ffn_gate_exps.weight", t,
                                             (d, f, shape.n_expert), raw.numel()),
                                   dtype=torch.uint8)
                m = PackedExperts(name, layout, shape.n_expert, f, d, span)
                m.fill(raw, t, 0)
                mats.append(m)
            label = layout if dt is None else f"{layout} {str(dt).removeprefix('torch.')}"
            variants.append((name, label, mats, []))
    cpu_experts._HALF[:] = chosen
    x = torch.randn(1, d, generator=gen)
    picks = [torch.randperm(shape.n_expert, generator=gen)[:k].tolist()
             for _ in range(args.tokens)]
    for _ in range(ROUNDS):
        for _, _, mats, times in variants:
            t0 = time.perf_counter()
            for i, chosen_e in enumerate(picks):
                for e in chosen_e:
                    mats[i % len(mats)].product(e, x)
            times.append((time.perf_counter() - t0) / len(picks) * 1e6)
    for name, label, mats, times in variants:
        us = statistics.median(times)
        gbs = _bytes(mats[0], k) / us / 1e3
        print(f"{name:<6} {label:<14} {us:9.1f} {gbs:7.1f} {gbs / rate:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

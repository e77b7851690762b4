"""Count the instructions of a decode GEMV's inner loop without a GPU: compile
``quant_matmul._gemv_kernel`` for sm_90 with the ptxas that ships in the Triton wheel and count
the PTX of the loop over blocks, per value and by opcode.

    python -m benchmarks.ptx_count TYPE [--config R,B,W] [--x bf16|f32|int8] [--body row|generic]

A GEMV of the low-bit types is instruction-bound long before it is memory-bound, so the count
per value is the first thing to move when a body changes (kernels/NOTES.md); the time on a GPU
(`benchmarks.device_check --types`) is the figure that counts. ``--body row`` puts TYPE in
``quant_matmul.ROW_BODY_TYPES`` (the bodies on trial too), ``generic`` takes it out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections import Counter

from kernels import quant_matmul as qm
from kernels.quant_blocks import plan
from spec import quant_types as qt

_SKIP = ("//", ".", "{", "}", "$", ")", "ret")


def compile_ptx(ggml_type: int, config: tuple[int, int, int], x: str = "bf16",
                body: str | None = None) -> str:
    """The PTX of the decode GEMV of ``ggml_type`` at tile ``config`` on x of kind ``x``
    (bf16, f32, or int8: decode's int8 copy) with the row body (``body="row"``), the generic
    walk (``"generic"``) or whatever the type runs today (None)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    p = plan(ggml_type)
    rows, blocks, warps = config
    special = ggml_type in qm.SPECIAL_ALIGN or ggml_type in qm.ROW_BODY_TYPES
    if body == "row":
        special = True
    elif body == "generic":
        special = False
    xt = {"bf16": "*bf16", "f32": "*fp32", "int8": "*bf16"}[x]
    # the third pointer: Q4_K's storage-order body reads the weight as int32 words, the IQ
    # types their value table (int8)
    wi = "*i32" if special and ggml_type in qm.SPECIAL_ALIGN else "*i8"
    sig = {"w_ptr": "*u8", "wh_ptr": "*fp16", "wi_ptr": wi, "x_ptr": xt, "xq_ptr": "*i8",
           "xd_ptr": "*fp32", "y_ptr": "*bf16", "b_ptr": "*bf16", "N": "i32", "K": "i32",
           "row_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32"}
    const = {"TYPE": ggml_type, "BS": p.block, "TS": p.nbytes, "NPART": p.parts, "L": p.lanes,
             "BLOCK_R": rows, "BLOCK_B": blocks, "LANE_SUM": ggml_type in qm.LANE_SUM_TYPES,
             "SPECIAL": special, "MAGIC": ggml_type in qm.MAGIC_TYPES, "HAS_BIAS": False,
             "Q8X": x == "int8", "ASM": True, "PDL": False}
    sig.update({k: "constexpr" for k in const})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(7)}  # the pointers
    src = ASTSource(fn=qm._gemv_kernel, signature=sig, constexprs=const, attrs=aligned)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    return kernel.asm["ptx"]


def loop_counts(ptx: str) -> Counter:
    """Opcodes of the largest basic block (the loop over blocks), as {opcode: count}; the
    moves Triton writes before each load's inline assembly are left out (ptxas drops them)."""
    blocks: dict[str, Counter] = {}
    cur = None
    for line in ptx.splitlines():
        s = line.strip()
        m = re.match(r"^(\$L__BB\d+_\d+):", s)
        if m:
            cur = blocks.setdefault(m.group(1), Counter())
            continue
        if cur is None or not s or s.startswith(_SKIP):
            continue
        op = s.split()[0]
        if op.startswith("@"):  # a predicated instruction: count its opcode
            op = s.split()[1]
        op = op.split(".")[0].rstrip(";")
        if op == "mov" and re.match(r"mov\.u(16|32|64) %r[sd]?\d+, 0x0;", s):
            continue
        cur[op] += 1
    return max(blocks.values(), key=lambda c: sum(c.values())) if blocks else Counter()


def values_per_step(ggml_type: int, config: tuple[int, int, int]) -> int:
    """Weight values one thread of the loop covers per step."""
    rows, blocks, warps = config
    return rows * blocks * plan(ggml_type).block // (32 * warps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ptx_count", description=__doc__)
    ap.add_argument("type", help="a GGML type name (IQ2_XXS, Q2_K, ...)")
    ap.add_argument("--config", default=None, help="rows,blocks,warps (default: the type's)")
    ap.add_argument("--x", choices=("bf16", "f32", "int8"), default="bf16")
    ap.add_argument("--body", choices=("row", "generic"), default=None)
    ap.add_argument("--json", action="store_true", help="one JSON line instead")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: the interpreter compiles nothing",
              file=sys.stderr)
        return 2
    t = qt.BY_NAME.get(args.type.lower())
    if t is None or t not in qm.GEMV_CONFIG:
        print(f"error: no GPU GEMV for type {args.type!r}", file=sys.stderr)
        return 2
    cfg = (tuple(int(v) for v in args.config.split(",")) if args.config
           else tuple(qm.GEMV_CONFIG[t][:3]))
    if args.x == "int8" and args.body != "row" and t not in qm.ROW_BODY_TYPES:
        print(f"error: {args.type}'s GEMV reads no int8 x (add --body row for a body on trial)",
              file=sys.stderr)
        return 2
    counts = loop_counts(compile_ptx(t, cfg, args.x, args.body))
    n, per = sum(counts.values()), values_per_step(t, cfg)
    if args.json:
        print(json.dumps({"type": qt.type_name(t), "config": cfg, "x": args.x,
                          "body": args.body, "loop": n, "per_value": n / per,
                          "counts": dict(counts)}))
        return 0
    print(f"{qt.type_name(t)} tile {cfg} x {args.x} body {args.body or 'default'}: "
          f"{n} PTX instructions a loop step, {per} values a thread, {n / per:.2f} per value")
    print("  " + ", ".join(f"{op} {c}" for op, c in counts.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

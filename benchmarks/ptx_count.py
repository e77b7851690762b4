"""Count the instructions of a decode GEMV's inner loop without a GPU: compile
``quant_matmul._gemv_kernel`` (``--t``: the T-layout ``gemv_t._gemv_t_kernel``) for sm_90 with
the ptxas that ships in the Triton wheel and count the PTX of the loop over blocks (``--sass``:
the machine code, disassembled by the wheel's nvdisasm), per value and by opcode.

    python -m benchmarks.ptx_count TYPE [--config R,B,W | --t --config ROWS,WARPS]
        [--x bf16|f32|int8] [--body row|generic] [--sass] [--json]
    python -m benchmarks.ptx_count TYPE --expert glu|down [--config R,B,W] [--sass]
        [--json]
    python -m benchmarks.ptx_count --rope-store [--qk-norm] [--sass] [--json]

``--expert``: decode's routed-expert GEMV on int8 x (carve_kernels/gemv_q8.py: Q4_K, Q6_K, MXFP4).
``--rope-store``: decode's RoPE + cache store (``--qk-norm``: with qwen3's q/k norms in it),
its whole kernel counted.

A GEMV of the low-bit types in GGUF order was instruction-bound long before it was
memory-bound, then bound by its L1 traffic (carve_kernels/NOTES.md): the count per value is the
first thing to move when a body changes; the time on a GPU (`benchmarks.device_check --types`) is
the figure that counts. ``--body row`` puts TYPE in ``quant_matmul.ROW_BODY_TYPES`` (the bodies on
trial too), ``generic`` takes it out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from collections import Counter

from carve_kernels import quant_matmul as qm
from carve_kernels.gemv_q8_blocks import lut_words
from carve_kernels.quant_blocks import plan
from spec import quant_types as qt

_SKIP = ("//", ".", "{", "}", "$", ")", "ret")


def compile_gemv(ggml_type: int, config: tuple[int, int, int], x: str = "bf16",
                 body: str | None = None):
    """The compiled decode GEMV (``.asm["ptx"]``, ``.asm["cubin"]``) of ``ggml_type`` at tile
    ``config`` on x of kind ``x`` (bf16, f32, or int8: decode's int8 copy) with the row body
    (``body="row"``), the generic walk (``"generic"``) or whatever the type runs today
    (None)."""
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
           "row_bytes": "i32", "stride_xm": "i32", "stride_ym": "i32", "trace_ptr": "*i64"}
    const = {"TYPE": ggml_type, "BS": p.block, "TS": p.nbytes, "NPART": p.parts, "L": p.lanes,
             "BLOCK_R": rows, "BLOCK_B": blocks, "LANE_SUM": ggml_type in qm.LANE_SUM_TYPES,
             "SPECIAL": special, "MAGIC": ggml_type in qm.MAGIC_TYPES, "HAS_BIAS": False,
             "Q8X": x == "int8", "ASM": True, "PDL": False, "TRACE": False,
             **dict(zip(("LUT0", "LUT1", "LUT2", "LUT3"), lut_words(ggml_type), strict=True))}
    sig.update({k: "constexpr" for k in const})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(7)}  # the pointers
    src = ASTSource(fn=qm._gemv_kernel, signature=sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_t(ggml_type: int, rows: int, warps: int, x: str = "bf16", traced: bool = False,
              smem: bool | None = None):
    """The compiled T-layout GEMV of ``ggml_type`` (carve_kernels/gemv_t.py), ``rows`` rows a
    program, split, on x of kind ``x`` (bf16, f32, or int8: decode's int8 copy); ``traced``:
    with the stamps of carve_kernels/trace.py compiled in; ``smem``: a grid type's grid read
    from shared memory (the bodies' ASM = 2), or from L1 (False); None: as the type runs
    (``gemv_t.SMEM_TYPES``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from carve_kernels import gemv_t

    if smem is None:
        smem = ggml_type in gemv_t.SMEM_TYPES
    sig = {"wt_ptr": "*i32", "wh_ptr": "*fp16", "tab_ptr": "*i8",
           "x_ptr": "*fp32" if x == "f32" else "*bf16", "xq_ptr": "*i32", "xd_ptr": "*fp32",
           "xs_ptr": "*fp32", "y_ptr": "*fp32", "b_ptr": "*fp32", "part_ptr": "*fp32",
           "cnt_ptr": "*i32", "N": "i32", "NB": "i32", "BPS": "i32", "stride_xm": "i32",
           "stride_ym": "i32", "trace_ptr": "*i64"}
    const = {"BLOCK_N": rows, "SPLIT": 4, "XV": x == "bf16", "HAS_BIAS": False,
             "TYPE": ggml_type, "Q8X": x == "int8", "ASM": 2 if smem else True, "PDL": False,
             "TRACE": traced}
    sig.update({k: "constexpr" for k in const})
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(11)}  # the pointers
    src = ASTSource(fn=gemv_t._gemv_t_kernel, signature=sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_expert(ggml_type: int, part: str, config: tuple[int, int, int],
                   traced: bool = False, late: bool = False, split: int = 1):
    """The compiled decode expert GEMV on int8 x (carve_kernels/moe_decode_q8.py,
    carve_kernels/gemv_q8.py) of ``ggml_type``: ``part`` "glu" (gate and up of that type,
    gpt-oss's clamped SwiGLU with biases for MXFP4, writing the int8 copy of its outputs) or
    "down" (the in-kernel sum of the k rows), tile ``config`` (rows, blocks, warps);
    ``traced``: with the stamps of carve_kernels/trace.py compiled in; ``late``: the gate/up
    releasing the next kernel after its tiles (as decode's does before the down); ``split``:
    Q4_K's gate/up along each row's blocks in that many programs (decode's: GLU_SPLIT)."""

    from carve_kernels import moe_decode_q8 as md

    rows, blocks, warps = config
    _, wh, wi = _expert_views(ggml_type)
    if part == "glu":
        fn = md._expert_glu_q8_kernel
        sig = {"g_ptr": "*u8", "gh_ptr": wh, "gi_ptr": wi, "u_ptr": "*u8", "uh_ptr": wh,
               "ui_ptr": wi, "gb_ptr": "*fp32", "ub_ptr": "*fp32", "xq_ptr": "*i8",
               "xd_ptr": "*fp32", "xs_ptr": "*fp32", "ids_ptr": "*i32", "h_ptr": "*bf16",
               "oq_ptr": "*i8", "od_ptr": "*fp32", "os_ptr": "*fp32", "N": "i32", "NB": "i32",
               "g_rb": "i32", "u_rb": "i32", "limit": "fp32", "trace_ptr": "*i64",
               "part_ptr": "*fp32", "cnt_ptr": "*i32", "BPS": "i32"}
        oai = ggml_type == qt.MXFP4
        const = {"KU": 4 if oai else 8, "TG": ggml_type, "TU": ggml_type, "HAS_BIAS": oai,
                 "ACT": 2 if oai else 0, "QOUT": True, "LATE": late, "SPLIT": split}
    else:
        fn = md._expert_down_q8_kernel
        sig = {"w_ptr": "*u8", "wh_ptr": wh, "wi_ptr": wi, "b_ptr": "*fp32", "hq_ptr": "*i8",
               "hd_ptr": "*fp32", "hs_ptr": "*fp32", "ids_ptr": "*i32", "y_ptr": "*fp32",
               "rw_ptr": "*fp32", "out_ptr": "*bf16", "cnt_ptr": "*i32", "N": "i32",
               "K": "i32", "row_bytes": "i32", "stride_ym": "i32", "trace_ptr": "*i64"}
        const = {"KU": 8, "HAS_BIAS": ggml_type == qt.MXFP4, "COMBINE": True, "ACCUM": False,
                 "TYPE": ggml_type, "QK": md.Q8_BLOCK[ggml_type]}
    const.update({"BLOCK_R": rows, "BLOCK_B": blocks, "ASM": True, "PDL": True,
                  "TRACE": traced, **(md._lut(ggml_type) or dict.fromkeys(("L0", "L1", "L2", "L3"), 0))})
    return _compile_sm90(fn, sig, const, warps)


def _expert_views(t: int) -> tuple[str, str, str]:
    """The pointer types of an expert tensor's three views (moe_decode_q8._q8_views): its bytes,
    16-bit words (MXFP4: bytes) and int32 words (Q4_K's; bytes for the rest)."""
    return "*u8", "*u8" if t == qt.MXFP4 else "*fp16", "*i32" if t == qt.Q4_K else "*u8"


def compile_attention(q8: bool = False, pdl: bool = True, out_q8: bool = False):
    """The compiled decode attention (carve_kernels/attention.py ``_decode_partial_kernel``),
    head_dim 128 in GQA groups of 4, the last split merging, launched with PDL (``pdl``) on an
    f16 or q8_0 (``q8``) cache; ``out_q8``: writing the int8 copy of its output (attn_output's
    x), and so releasing the next launch after its partials, as attn_decode launches it."""
    from carve_kernels import attention

    fn = attention._decode_partial_kernel
    types = {"q_ptr": "*bf16", "c_k": "*fp16", "c8_k": "*i8", "ch_k": "*fp16", "c_v": "*fp16",
             "c8_v": "*i8", "ch_v": "*fp16", "pos_ptr": "*i32", "po_ptr": "*fp32",
             "pml_ptr": "*fp32", "cnt_ptr": "*i32", "o_ptr": "*bf16", "sink_ptr": "*fp32",
             "trace_ptr": "*i64", "scale": "fp32", "oq_ptr": "*i32", "od_ptr": "*fp32",
             "os_ptr": "*fp32"}
    const = {"G": 4, "GP": 16, "D": 128, "SPLIT": 64, "BLOCK_N": 64, "Q8": q8, "FUSED": True,
             "NSP": 64, "MERGE": 4, "SINK": False, "OUT_Q8": out_q8, "PDL": pdl,
             "TRACE": False, "LATE": 1 if out_q8 else 0}
    sig = {n: types.get(n, "i32") for n in fn.arg_names if n not in const}
    return _compile_sm90(fn, sig, const, 4)


def _compile_sm90(fn, sig: dict, const: dict, warps: int):
    """``fn`` compiled for sm_90 with these argument types and constexprs, every pointer
    16-byte aligned (as the engine's tensors are)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {**sig, **{k: "constexpr" for k in const}}
    aligned = {(i,): [["tt.divisibility", 16]]  # the pointers, wherever they stand
               for i, v in enumerate(sig.values()) if v.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=const, attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})


def compile_rope_store(qk_norm: bool, q8_cache: bool = False):
    """The compiled decode RoPE + cache store (carve_kernels/rope.py) for 128-dim neox heads, with
    qwen3's per-head q/k norms in it (``qk_norm``) or not, into an f16 or q8_0 cache."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from carve_kernels import rope

    cache = ("*u8", "*i8", "*fp16") if q8_cache else ("*fp16",) * 3
    sig = {"x_ptr": "*bf16", "v_ptr": "*bf16", "stride_t": "i32", "stride_h": "i32",
           "v_stride_t": "i32", "v_stride_h": "i32", "pos_ptr": "*i32", "kc": cache[0],
           "kc8": cache[1], "kch": cache[2], "vc": cache[0], "vc8": cache[1], "vch": cache[2],
           "cells": "i32", "n_q": "i32", "KVH": "i32", "log2_base": "fp32", "freq_scale": "fp32",
           "f_ptr": "*fp32", "mscale": "fp32", "wq_ptr": "*fp32", "wk_ptr": "*fp32",
           "eps": "fp32"}
    const = {"D": 128, "HALF": 64, "NEOX": True, "Q8": q8_cache, "FREQS": False,
             "QK_NORM": qk_norm, "BLOCK_H": 16, "PDL": True}
    sig.update({k: "constexpr" for k in const})
    src = ASTSource(fn=rope._rope_store_kernel, signature=sig, constexprs=const)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def loop_conversions(ttgir: str) -> int:
    """Layout conversions in the first loop of a kernel's TTGIR (``.asm["ttgir"]``): on sm_90
    most go through shared memory with barriers, each step of the loop."""
    body = ttgir[ttgir.index("scf.for"):]
    return body[:body.index("scf.yield")].count("ttg.convert_layout")


def sass(cubin: bytes) -> str:
    """The machine code as text (nvdisasm of the Triton wheel)."""
    import tempfile

    import triton

    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                            "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def sass_counts(cubin: bytes, whole: bool = False) -> Counter:
    """Opcodes of the largest basic block of the machine code; ``whole``: of every block."""
    text = sass(cubin)
    blocks: dict[str, Counter] = {}
    cur = blocks.setdefault("entry", Counter())
    for line in text.splitlines():
        m = re.match(r"^\s*(\.L_x_\d+):", line)
        if m:
            cur = blocks.setdefault(m.group(1), Counter())
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", line)
        if m:
            ins = m.group(1).strip()
            if ins.startswith("@"):  # predicated: count its opcode
                ins = ins.split(None, 1)[1]
            cur[ins.split()[0].split(".")[0]] += 1
    if whole:
        return sum(blocks.values(), Counter())
    return max(blocks.values(), key=lambda c: sum(c.values()))


def loop_counts(ptx: str, whole: bool = False) -> Counter:
    """Opcodes of the largest basic block (the loop over blocks; ``whole``: of every block), as
    {opcode: count}; the moves Triton writes before each load's inline assembly are left out
    (ptxas drops them)."""
    blocks: dict[str, Counter] = {}
    cur = blocks.setdefault("entry", Counter()) if whole else None
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
    if whole:
        return sum(blocks.values(), Counter())
    return max(blocks.values(), key=lambda c: sum(c.values())) if blocks else Counter()


def values_per_step(ggml_type: int, config: tuple[int, int, int]) -> int:
    """Weight values one thread of the loop covers per step."""
    rows, blocks, warps = config
    return rows * blocks * plan(ggml_type).block // (32 * warps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ptx_count", description=__doc__)
    ap.add_argument("type", nargs="?", help="a GGML type name (IQ2_XXS, Q2_K, ...)")
    ap.add_argument("--expert", choices=("glu", "down"), default=None,
                    help="the routed-expert GEMV on int8 x (carve_kernels/gemv_q8.py)")
    ap.add_argument("--rope-store", action="store_true", help="decode's RoPE + cache store")
    ap.add_argument("--qk-norm", action="store_true", help="--rope-store with the q/k norms")
    ap.add_argument("--config", default=None,
                    help="rows,blocks,warps (--t: rows,warps; default: the type's launch)")
    ap.add_argument("--x", choices=("bf16", "f32", "int8"), default="bf16")
    ap.add_argument("--body", choices=("row", "generic"), default=None)
    ap.add_argument("--t", action="store_true", help="the T-layout GEMV (carve_kernels/gemv_t.py)")
    ap.add_argument("--sass", action="store_true", help="count the machine code, not the PTX")
    ap.add_argument("--smem", action=argparse.BooleanOptionalAction, default=None,
                    help="--t: a grid type's grid from shared memory (--no-smem: from L1); "
                         "default: as the type runs")
    ap.add_argument("--split", type=int, default=1,
                    help="--expert glu: Q4_K's gate/up along each row's blocks in this many "
                         "programs (decode's default: 2)")
    ap.add_argument("--json", action="store_true", help="one JSON line instead")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("error: unset TRITON_INTERPRET: the interpreter compiles nothing",
              file=sys.stderr)
        return 2
    if args.rope_store:
        return _report(compile_rope_store(args.qk_norm), args, "rope_store",
                       {"qk_norm": args.qk_norm}, whole=True)
    t = qt.BY_NAME.get((args.type or "").lower())
    if args.expert:
        from carve_kernels import moe_decode_q8

        if t not in moe_decode_q8.Q8_BLOCK:
            print(f"error: no int8-x expert GEMV for type {args.type!r}", file=sys.stderr)
            return 2
        cfg = (tuple(int(v) for v in args.config.split(",")) if args.config
               else moe_decode_q8.EXPERT_Q8_CONFIG[(t, args.expert)])
        rows, blocks, warps = cfg
        per = rows * blocks * moe_decode_q8.Q8_BLOCK[t] * (2 if args.expert == "glu" else 1) \
            // (32 * warps)
        if args.split > 1 and (t != qt.Q4_K or args.expert != "glu"):
            print("error: --split is Q4_K's --expert glu only", file=sys.stderr)
            return 2
        return _report(compile_expert(t, args.expert, cfg, split=args.split), args,
                       qt.type_name(t), {"config": cfg, "part": args.expert,
                                         "split": args.split}, per)
    if t is None or t not in qm.GEMV_CONFIG:
        print(f"error: no GPU GEMV for type {args.type!r}", file=sys.stderr)
        return 2
    if args.t:
        from carve_kernels import t_layout
        from spec import launch

        if t not in t_layout.WORDS:
            print(f"error: no T layout for {args.type}", file=sys.stderr)
            return 2
        rows, warps = (tuple(int(v) for v in args.config.split(",")) if args.config
                       else launch.t_config(t)[:2])
        cfg = (rows, warps)
        kernel = compile_t(t, rows, warps, args.x, smem=args.smem)
        per = rows // (32 * warps) * 128  # half a block of each of its rows a step
    else:
        cfg = (tuple(int(v) for v in args.config.split(",")) if args.config
               else tuple(qm.GEMV_CONFIG[t][:3]))
        if args.x == "int8" and args.body != "row" and t not in qm.ROW_BODY_TYPES:
            print(f"error: {args.type}'s GEMV reads no int8 x (add --body row for a body on "
                  "trial)", file=sys.stderr)
            return 2
        kernel = compile_gemv(t, cfg, args.x, args.body)
        per = values_per_step(t, cfg)
    return _report(kernel, args, qt.type_name(t),
                   {"config": cfg, "x": args.x, "body": "t" if args.t else args.body}, per)


def _report(kernel, args, name: str, what: dict, per: int = 0, whole: bool = False) -> int:
    # the loop's (or, ``whole``, the kernel's) instructions, per value when ``per`` is known
    code = "SASS" if args.sass else "PTX"
    if whole:
        counts = (sass_counts(kernel.asm["cubin"], whole=True) if args.sass
                  else loop_counts(kernel.asm["ptx"], whole=True))
    else:
        counts = sass_counts(kernel.asm["cubin"]) if args.sass else loop_counts(kernel.asm["ptx"])
    n = sum(counts.values())
    if args.json:
        print(json.dumps({"type": name, **what, "code": code, "loop": n,
                          "per_value": n / per if per else None, "counts": dict(counts)}))
        return 0
    print(f"{name} {what}: {n} {code} instructions "
          + ("in the kernel" if whole else "a loop step")
          + (f", {per} values a thread, {n / per:.2f} per value" if per else ""))
    print("  " + ", ".join(f"{op} {c}" for op, c in counts.most_common(16)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

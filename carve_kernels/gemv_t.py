"""Decode GEMV over row-interleaved ("transposed") weights: the layout the runner repacks a
matrix into at load time so that the threads of a GEMV program read the same word of
neighbouring rows side by side, and every activation value they need is the same for the whole
program.

GGUF stores a matrix row by row, block by block. The T layout keeps every byte and only
reorders them: W words of each block go to word planes, the rest of the block (the tail) to a
plane after them (Q4_K: 144 bytes = 36 words, no tail; Q5_K 176 bytes = 44 words; Q3_K 110
bytes = 27 words and its 2-byte d; Q6_K: 210 bytes = 52 words and its
2-byte d; Q2_K 21 words, IQ4_XS 34, IQ1_M 14, no tail; IQ1_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS,
IQ3_S and Q8_0: the 2-byte d at the block's start, then 12 / 16 / 18 / 20 / 24 / 27 / 8 words):

    T[b, u, n] = word u of block b of row n      (word planes [blocks per row, W, rows])
    D[b, n]    = tail of block b of row n        (then the tail plane [blocks per row, rows])

so the words of one block position sit side by side for all rows. A program owns BLOCK_N rows
(BLOCK_N / threads per thread, loaded as one vector per word) and a range of blocks; x for that
range is loaded as scalars (the same address in every thread: one broadcast per warp, no
layout conversion, no shuffle), and each thread keeps its rows' sums in registers to the end.
Programs that split a row's blocks store their sums in their own row of a float32 ``part``
buffer; the last one of a row tile to finish (an atomic counter, acq_rel) adds those rows in
split order (deterministic: spec/launch.py) and writes y. The per-step dot products are in
carve_kernels/gemv_t_dot.py (Q4_K, Q5_K), carve_kernels/gemv_t_q6k.py (Q6_K),
carve_kernels/gemv_t_low.py (Q2_K, Q3_K, IQ4_XS and Q8_0, whose blocks of 32 split a row as
256-value blocks would), carve_kernels/gemv_t_grid.py and carve_kernels/gemv_t_iq1.py (the grid
IQ types): x as float,
or (``xq=``) its int8 copy (carve_kernels/q8x.py) through dp4a; the gate/up launch reads both
matrices' Q4_K (Q5_K) words in one step. The q/k/v launch (``gemv_t3``, with decode's RoPE and
cache store in its epilogue) is carve_kernels/gemv_t3.py's.

Same results as ``quant_matmul.gemv`` on the GGUF layout (the torch twin is ``gemv_t_ref``).
On the H200 1.1-1.3x the GGUF-order GEMV for Q4_K matrices of 12 MB and more, 1.5-2.4x for
Q6_K, slower below ~8 MB (bf16 x); 2.5x for Q2_K and 1.6x for IQ4_XS on int8 x
(carve_kernels/NOTES.md). The GPU runner repacks
its big decode matrices at load time (engine/runtime/gpu/stage.py); prefill reads their
dequant-cache copies, so nothing dequantizes from this layout except ``unpack_rows``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace
from carve_kernels.gemv_iq import grid_fill
from carve_kernels.gemv_t_dot import q4k_t_dot_half
from carve_kernels.gemv_t_grid import (
    iq2s_t_dot,
    iq2xs_t_dot,
    iq2xxs_t_dot,
    iq3s_t_dot,
    iq3xxs_t_dot,
)
from carve_kernels.gemv_t_iq1 import iq1m_t_dot, iq1s_t_dot
from carve_kernels.gemv_t_low import iq4xs_t_dot, q2k_t_dot, q3k_t_dot, q80_t_dot
from carve_kernels.gemv_t_q6k import _q6k_t_dot
from carve_kernels.glu import glu_act
from carve_kernels.lowbit_blocks import lookup_table
from carve_kernels.t_layout import BLOCK_BYTES, BLOCK_VALUES, PAIRED, WORDS, unpack
from spec import launch
from spec import quant_types as qt
from spec.launch import T_CONFIG


@triton.jit
def t_tab(tab_ptr, TYPE: tl.constexpr, BLOCK_N: tl.constexpr, ASM: tl.constexpr):
    # the table t_body reads: with ASM == 2 a grid type's grid copied to shared memory
    # (gemv_iq.grid_fill: once a program, a barrier), else tab_ptr itself
    if ASM == 2 and (TYPE == 16 or TYPE == 21):  # IQ2_XXS, IQ3_S
        tab = grid_fill(tab_ptr, 2048, BLOCK_N)
    elif ASM == 2 and TYPE == 18:  # IQ3_XXS
        tab = grid_fill(tab_ptr, 1024, BLOCK_N)
    elif ASM == 2 and TYPE == 17:  # IQ2_XS
        tab = grid_fill(tab_ptr, 4096, BLOCK_N)
    elif ASM == 2 and TYPE == 22:  # IQ2_S
        tab = grid_fill(tab_ptr, 8192, BLOCK_N)
    elif ASM == 2 and (TYPE == 19 or TYPE == 29):  # IQ1_S, IQ1_M
        tab = grid_fill(tab_ptr, 16384, BLOCK_N)
    else:
        tab = tab_ptr
    return tab


@triton.jit
def t_body(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, xs_ptr, rows, rmask, N, NB, b_lo,
           b_hi, BLOCK_N: tl.constexpr, XV: tl.constexpr, TYPE: tl.constexpr,
           Q8X: tl.constexpr, ASM: tl.constexpr):
    # a program's sums over blocks [b_lo, b_hi) of its rows, by type (carve_kernels/gemv_t_dot.py,
    # gemv_t_low.py, gemv_t_grid.py, gemv_t_iq1.py); rows masked, not clamped: a clamp hides their contiguity and the
    # loads go 4 bytes wide. tab_ptr: the type's value table (lowbit_blocks.lookup_table), or
    # with ASM == 2 what t_tab made of it
    if TYPE == 10:
        acc = q2k_t_dot(wt_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, b_lo, b_hi, BLOCK_N, XV,
                        Q8X, ASM)
    elif TYPE == 8:
        acc = q80_t_dot(wt_ptr, wh_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
                        BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 11:
        acc = q3k_t_dot(wt_ptr, wh_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
                        BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 23:
        acc = iq4xs_t_dot(wt_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, b_lo, b_hi,
                          BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 16:
        acc = iq2xxs_t_dot(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB,
                           b_lo, b_hi, BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 19:
        acc = iq1s_t_dot(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB,
                         b_lo, b_hi, BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 29:
        acc = iq1m_t_dot(wt_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, b_lo, b_hi,
                         BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 17:
        acc = iq2xs_t_dot(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB,
                          b_lo, b_hi, BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 22:
        acc = iq2s_t_dot(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB,
                         b_lo, b_hi, BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 18:
        acc = iq3xxs_t_dot(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB,
                           b_lo, b_hi, BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 21:
        acc = iq3s_t_dot(wt_ptr, wh_ptr, tab_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB,
                         b_lo, b_hi, BLOCK_N, XV, Q8X, ASM)
    elif TYPE == 14:
        acc = _q6k_t_dot(wt_ptr, wh_ptr, xrow, xq_ptr, xd_ptr, rows, rmask, N, NB, b_lo, b_hi,
                         BLOCK_N, XV, Q8X, ASM)
    else:  # Q4_K, Q5_K
        acc, _ = q4k_t_dot_half(wt_ptr, wt_ptr, xrow, xq_ptr, xd_ptr, xs_ptr, rows, rmask, N,
                                b_lo, b_hi, BLOCK_N, XV, False, Q8X, ASM, TYPE == 13)
    return acc


@triton.jit
def _t_tile(N, NB, BPS, BLOCK_N: tl.constexpr):
    # this program's row tile, x row (M index) and block range
    pid = tl.program_id(0)
    b_lo = tl.program_id(1) * BPS
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid, tl.program_id(2).to(tl.int64), rows, rows < N, b_lo, tl.minimum(b_lo + BPS, NB)


@triton.jit
def t_split_sum(p, rows, rmask, N, SPLIT: tl.constexpr):
    # the SPLIT rows of partial sums at p ([SPLIT, N]) added in split order, each thread its
    # own rows, read at L2 (unrolled: the loads go out together)
    tot = tl.load(p + rows, mask=rmask, other=0.0, cache_modifier=".cg")
    for s in tl.static_range(1, SPLIT):
        tot += tl.load(p + s * N + rows, mask=rmask, other=0.0, cache_modifier=".cg")
    return tot


@triton.jit
def t_split_done(prow, acc, rows, rmask, N, cnt, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    # each split of a row tile stores its sums in its own row of part [SPLIT, N]; the last to
    # arrive gets their sum in split order back (1: the same bits whatever order the programs
    # ran in) and leaves its counter at zero for the next call; the others get 0
    tl.store(prow + tl.program_id(1) * N + rows, acc, mask=rmask)
    tl.debug_barrier()  # every thread's stores issued before the counter's release
    done = tl.atomic_add(cnt, 1)
    last = done == SPLIT - 1
    tot = acc
    if last:
        tot = t_split_sum(prow, rows, rmask, N, SPLIT)
        tl.atomic_xchg(cnt, 0)
    return last, tot


@triton.jit
def t_pair_split_done(prow, g, u, rows, rmask, N, cnt, SPLIT: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # t_split_done for a gate/up pair: part [2, SPLIT, N] at prow (gate's splits, then up's);
    # the last split of the row tile gets both sums in split order back
    tl.store(prow + (SPLIT + tl.program_id(1)) * N + rows, u, mask=rmask)
    last, g = t_split_done(prow, g, rows, rmask, N, cnt, SPLIT, BLOCK_N)
    if last:
        u = t_split_sum(prow + SPLIT * N, rows, rmask, N, SPLIT)
    return last, g, u


@triton.jit
def _gemv_t_kernel(wt_ptr, wh_ptr, tab_ptr, x_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, b_ptr,
                   part_ptr, cnt_ptr, N, NB, BPS, stride_xm, stride_ym, trace_ptr,
                   BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, XV: tl.constexpr,
                   HAS_BIAS: tl.constexpr, TYPE: tl.constexpr, Q8X: tl.constexpr,
                   ASM: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    pid, m, rows, rmask, b_lo, b_hi = _t_tile(N, NB, BPS, BLOCK_N)
    tab = t_tab(tab_ptr, TYPE, BLOCK_N, ASM)  # before the wait: no kernel writes the table
    trace.wait(trace_ptr, PDL, TRACE)
    acc = t_body(wt_ptr, wh_ptr, tab, x_ptr + m * stride_xm, xq_ptr, xd_ptr, xs_ptr, rows,
                 rmask, N, NB, b_lo, b_hi, BLOCK_N, XV, TYPE, Q8X, ASM)
    trace.stamp(trace_ptr, 2, TRACE)
    last = True
    if SPLIT > 1:
        last, acc = t_split_done(part_ptr + m * SPLIT * N, acc, rows, rmask, N,
                                 cnt_ptr + m * tl.num_programs(0) + pid, SPLIT, BLOCK_N)
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _gemv_t_glu_kernel(g_ptr, gh_ptr, tab_ptr, u_ptr, uh_ptr, tab2_ptr, x_ptr, xq_ptr, xd_ptr,
                       xs_ptr, y_ptr, oq_ptr, od_ptr, os_ptr, part_ptr, cnt_ptr, N, NB, BPS,
                       stride_xm, stride_ym, trace_ptr, BLOCK_N: tl.constexpr,
                       SPLIT: tl.constexpr, XV: tl.constexpr, TYPE: tl.constexpr,
                       GELU: tl.constexpr, PAIR: tl.constexpr, Q8X: tl.constexpr,
                       QOUT: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                       TRACE: tl.constexpr):
    # gate and up rows of the same outputs in one program (x read once for both); with a
    # split, part holds [M, 2, SPLIT, N] and the last program of a row tile applies the GLU.
    # QOUT: the last program also writes the int8 copy of its y (carve_kernels/q8x.py, M = 1)
    pid, m, rows, rmask, b_lo, b_hi = _t_tile(N, NB, BPS, BLOCK_N)
    tab = t_tab(tab_ptr, TYPE, BLOCK_N, ASM)  # one copy for gate and up, before the wait
    trace.wait(trace_ptr, PDL, TRACE)
    xrow = x_ptr + m * stride_xm
    if PAIR:  # Q4_K, Q5_K: gate and up words in one step, each x value converted once
        g, u = q4k_t_dot_half(g_ptr, u_ptr, xrow, xq_ptr, xd_ptr, xs_ptr, rows, rmask, N,
                              b_lo, b_hi, BLOCK_N, XV, True, Q8X, ASM, TYPE == 13)
    else:
        g = t_body(g_ptr, gh_ptr, tab, xrow, xq_ptr, xd_ptr, xs_ptr, rows, rmask, N, NB,
                   b_lo, b_hi, BLOCK_N, XV, TYPE, Q8X, ASM)
        u = t_body(u_ptr, uh_ptr, tab, xrow, xq_ptr, xd_ptr, xs_ptr, rows, rmask, N, NB,
                   b_lo, b_hi, BLOCK_N, XV, TYPE, Q8X, ASM)
    trace.stamp(trace_ptr, 2, TRACE)
    last = True
    if SPLIT > 1:
        last, g, u = t_pair_split_done(part_ptr + m * 2 * SPLIT * N, g, u, rows, rmask, N,
                                       cnt_ptr + m * tl.num_programs(0) + pid, SPLIT, BLOCK_N)
    if last:
        y = glu_act(g, u, GELU)
        tl.store(y_ptr + m * stride_ym + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)
        if QOUT:
            q8x.store_q8(y, pid * BLOCK_N, N - pid * BLOCK_N, oq_ptr, od_ptr, os_ptr, BLOCK_N)
    trace.stamp(trace_ptr, 3, TRACE)


def _t_words(wt: torch.Tensor, ggml_type: int, rows: int) -> tuple[int, tuple]:
    """(blocks per row, (word view, 16-bit view, value table)) of a T-layout matrix, checked
    (the table: ``lookup_table``'s for the types that read one, else the word view)."""
    if ggml_type not in WORDS:
        raise ValueError(f"no T layout for {qt.type_name(ggml_type)}")
    nb = wt.numel() // (rows * BLOCK_BYTES[ggml_type])
    if wt.numel() != nb * rows * BLOCK_BYTES[ggml_type] or wt.dtype != torch.uint8:
        raise ValueError(f"T weight of {wt.numel()} bytes is not {rows} rows of whole blocks")
    words = wt[: nb * WORDS[ggml_type] * rows * 4].view(torch.int32)
    table = lookup_table(ggml_type, wt.device)
    return nb, (words, wt.view(torch.float16), words if table is None else table)


def _t_grid(rows: list[int], nb: int, x: torch.Tensor, config: tuple[int, int, int] | None,
            parts: int, part: torch.Tensor, counter: torch.Tensor, use_pdl: bool = True,
            block_values: int = 256):
    """(grid, x rows, blocks per split, constexprs, warps) of a T launch over the row tiles
    of ``rows`` (one matrix, or q, k, v one after the other), blocks of ``block_values``. The
    splits are those of the same columns in blocks of 256 (spec/launch.py ``scratch``, what
    pricing reserves), each holding whole blocks."""
    block_n, warps, target = config or T_CONFIG
    x2 = x.reshape(-1, nb * block_values)
    if x2.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    mm = x2.shape[0]
    tiles = launch.tiles(rows, block_n)
    most, _ = launch.split(tiles, max(1, nb * block_values // 256), target)
    bps = -(-nb // most)
    split = -(-nb // bps)
    if split > 1 and (part.numel() < mm * parts * split * sum(rows)
                      or counter.numel() < mm * tiles):
        raise ValueError("part/counter buffers too small for this GEMV")
    meta = {"BLOCK_N": block_n, "SPLIT": split,
            "XV": x2.dtype == torch.bfloat16 and x2.stride(0) % 4 == 0
            and x2.data_ptr() % 8 == 0, **pdl.opts(x2, use_pdl)}
    return (tiles, split, mm), x2, bps, meta, warps


# the grid IQ types, whose T bodies read their grid from a shared copy (gemv_iq.grid_fill) where
# SMEM_TYPES holds them: all seven, measured (H100, benchmarks.t_probe at 7B ffn_up on int8 x, us
# without -> with: IQ2_XXS 18.1 -> 15.7 and IQ3_S 22.4 -> 17.8 on 2026-12-07 (the IQ2_XXS mix
# tg128 428.0 -> 492.1 t/s with the sign masks); IQ3_XXS 20.1 -> 18.6, IQ2_XS 19.6 -> 16.7, IQ2_S
# 25.4 -> 18.2, IQ1_S 24.9 -> 16.3, IQ1_M 26.4 -> 19.4 in session 44, one lease). t_probe
# --no-smem and ptx_count --no-smem empty SMEM_TYPES to compare
GRID_SMEM = frozenset({qt.IQ2_XXS, qt.IQ2_XS, qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S, qt.IQ1_S,
                       qt.IQ1_M})
SMEM_TYPES: frozenset[int] = GRID_SMEM


def _asm(cuda: bool, *types: int) -> bool | int:
    # the bodies' ASM: False under the interpreter, True on a GPU, 2 (inline asm and the grid
    # in shared memory) where a launch runs a type of SMEM_TYPES. One constexpr a launch: a
    # q/k/v launch with one such type gives any other grid type in it the shared grid too
    # (the same sums either way)
    if not cuda:
        return False
    return 2 if any(t in SMEM_TYPES for t in types) else True


# decode's launches by part (qkv, one, attn: attn_output, else one's; glu): (warps, programs,
# rows or 0) in place of their config's, set from CARVE_T_TILES (engine/runtime/options.py) to
# measure a config in the step; programs at most the config's and rows 128 or 256, so the
# splits' scratch (spec/launch.py ``scratch``, priced at both) still holds
T_TUNE: dict[str, tuple[int, int, int]] = {}


def _tuned(config: tuple[int, int, int] | None, default: tuple[int, int, int],
           *parts: str) -> tuple[int, int, int]:
    # a caller's own config, else the first of ``parts``' tuning of the default, else the
    # default
    if config is not None:
        return config
    tune = next((T_TUNE[p] for p in parts if p in T_TUNE), None)
    if tune is None:
        return default
    warps, target, rows = tune
    return rows or default[0], warps, min(target, default[2])


def _t_launch(wt: torch.Tensor, ggml_type: int, rows: int, x: torch.Tensor,
              config: tuple[int, int, int] | None, parts: int, part: torch.Tensor,
              counter: torch.Tensor, use_pdl: bool, tune: tuple[str, ...] = ("one",)):
    """(grid, word view, 16-bit view, x rows, common args, constexprs, warps) of a T GEMV;
    ``tune``: the T_TUNE parts that may set its config, first found first."""
    nb, ptrs = _t_words(wt, ggml_type, rows)
    config = _tuned(config, launch.t_config(ggml_type), *tune)
    grid, x2, bps, meta, warps = _t_grid([rows], nb, x, config, parts, part, counter, use_pdl,
                                         BLOCK_VALUES.get(ggml_type, 256))
    return grid, ptrs, x2, (nb, bps), {**meta, "TYPE": ggml_type}, warps


def _q8_in(xq, ggml_type: int, x2: torch.Tensor):
    """(q, d, s, use): the int8 copy of x (carve_kernels/q8x.py) where the kernel can use it (a
    T matrix, one row of x), else x's own pointers and False."""
    if ggml_type not in WORDS or not q8x.usable(xq, x2):
        return x2, x2, x2, False
    return (*xq, True)


def gemv_t(wt: torch.Tensor, ggml_type: int, rows: int, x: torch.Tensor, out: torch.Tensor,
           part: torch.Tensor, counter: torch.Tensor, bias: torch.Tensor | None = None,
           config: tuple[int, int, int] | None = None, xq=None,
           use_pdl: bool = True, attn_output: bool = False) -> torch.Tensor:
    """y[M, rows] = x[M, cols] @ W^T (+ bias) for W in the T layout ``wt`` (from ``repack``).
    ``part``: float32 scratch (>= M x splits x rows, spec/launch.py ``scratch``);
    ``counter``: int32 zeros (>= M x row tiles), left zero. No allocation. ``xq``: x's int8
    copy (q, d, s of carve_kernels/q8x.py), which the matrix multiplies by dp4a when M = 1.
    ``use_pdl``: launch with PDL where the GPU has it (carve_kernels/pdl.py).
    ``attn_output``: the launch is a layer's attn_output (T_TUNE's part attn)."""
    grid, ptrs, x2, (nb, bps), meta, warps = _t_launch(
        wt, ggml_type, rows, x, config, 1, part, counter, use_pdl,
        ("attn", "one") if attn_output else ("one",))
    q, d, s, use = _q8_in(xq, ggml_type, x2)
    y = out.view(x2.shape[0], rows)
    _gemv_t_kernel[grid](*ptrs, x2, q, d, s, y, bias if bias is not None else y, part, counter,
                         rows, nb, bps, x2.stride(0), y.stride(0),
                         **trace.args("gemv_t", grid, y), HAS_BIAS=bias is not None,
                         Q8X=use, ASM=_asm(wt.is_cuda, ggml_type), **meta,
                         num_warps=warps)
    return out


def gemv_t_glu(gate: torch.Tensor, up: torch.Tensor, ggml_type: int, rows: int,
               x: torch.Tensor, out: torch.Tensor, part: torch.Tensor, counter: torch.Tensor,
               act: str = "silu", config: tuple[int, int, int] | None = None,
               paired: bool = True, xq=None, out_q=None, use_pdl: bool = True) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) [M, rows] for gate and up in the T layout, one launch.
    ``part`` >= M x 2 x splits x rows floats. Q4_K reads gate and up words in the same steps
    (``paired=False``: one matrix after the other, for comparison). ``xq`` as in ``gemv_t``;
    ``out_q``: (q, d, s) to receive the int8 copy of the output too (M = 1, rows a multiple
    of 32), the input of the next GEMV. ``use_pdl`` as in ``gemv_t``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    config = _tuned(config, launch.t_config(ggml_type, glu=True), "glu")
    grid, gp, x2, (nb, bps), meta, warps = _t_launch(gate, ggml_type, rows, x, config, 2, part,
                                                     counter, use_pdl)
    _, up_p, _, _, _, _ = _t_launch(up, ggml_type, rows, x, config, 2, part, counter, use_pdl)
    q, d, s, use = _q8_in(xq, ggml_type, x2)
    if out_q is not None and (x2.shape[0] != 1 or rows % 32 or config[0] % 32
                              or not q8x.fits(out_q, rows)):
        raise ValueError(f"no int8 copy of a GLU output of {x2.shape[0]} x {rows} here")
    oq, od, os_ = out_q if out_q is not None else (x2, x2, x2)
    y = out.view(x2.shape[0], rows)
    _gemv_t_glu_kernel[grid](*gp, *up_p, x2, q, d, s, y, oq, od, os_, part, counter, rows, nb,
                             bps, x2.stride(0), y.stride(0), **trace.args("gemv_t_glu", grid, y),
                             GELU=act == "gelu",
                             PAIR=paired and ggml_type in PAIRED, Q8X=use,
                             QOUT=out_q is not None, ASM=_asm(gate.is_cuda, ggml_type),
                             **meta, num_warps=warps)
    return out


def gemv_t_ref(wt: torch.Tensor, ggml_type: int, rows: int, x: torch.Tensor,
               out: torch.Tensor, part: torch.Tensor, counter: torch.Tensor,
               bias: torch.Tensor | None = None, config=None) -> torch.Tensor:
    from carve_kernels.quant_matmul import gemv_ref

    return gemv_ref(unpack(wt, ggml_type, rows), ggml_type, x, out=out, bias=bias)

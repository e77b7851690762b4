"""The fused q/k/v launch of the T-layout decode GEMVs: ``gemv_t3`` runs three matrices of the
same x (each its own type) as one grid, outputs side by side, and with ``rope=`` rotates and
stores decode's k/v heads in its epilogue where the row tiles hold whole heads (``rope_fits``).
The layout, the bodies, the grid and the single-matrix and gate/up launches are
carve_kernels/gemv_t.py's; the tunings (``T_TUNE``, ``SMEM_TYPES``) stay there and are read there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import rope as rope_mod
from carve_kernels import trace
from carve_kernels.gemv_t import (
    _asm,
    _q8_in,
    _t_grid,
    _t_words,
    _tuned,
    t_body,
    t_split_done,
    t_tab,
)
from carve_kernels.kv_cache import _kv_store_one
from carve_kernels.t_layout import BLOCK_VALUES
from spec.launch import T_CONFIG


@triton.jit
def _gemv_t3_kernel(w1, h1, g1, w2, h2, g2, w3, h3, g3, b1, b2, b3, x_ptr, xq_ptr, xd_ptr,
                    xs_ptr, y_ptr, part_ptr, cnt_ptr, N1, N2, N3, NB, BPS, stride_xm, stride_ym,
                    pos_ptr, kc, kc8, kch, vc, vc8, vch, cells, n_q, KVH, log2_base,
                    freq_scale, f_ptr, mscale, wq_ptr, wk_ptr, eps, trace_ptr,
                    BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, XV: tl.constexpr,
                    HAS_BIAS: tl.constexpr, T1: tl.constexpr, T2: tl.constexpr,
                    T3: tl.constexpr, Q8X: tl.constexpr, ASM: tl.constexpr, ROPE: tl.constexpr,
                    D: tl.constexpr, HALF: tl.constexpr, NEOX: tl.constexpr, Q8: tl.constexpr,
                    FREQS: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
                    TRACE: tl.constexpr):
    # three matrices of the same x (q, k, v) as one grid: row tiles [0, P1) are the first's,
    # [P1, P2) the second's, the rest the third's; each keeps its own type, outputs side by side.
    # ROPE (decode): the program that writes a tile's rows then rotates its heads (whole heads:
    # BLOCK_N a multiple of D) and stores its k and v heads into the cache, as
    # carve_kernels/rope.py rope_store does (pos_ptr .. eps: its arguments); no launch of its own
    pid = tl.program_id(0)
    p1 = tl.cdiv(N1, BLOCK_N)
    p2 = p1 + tl.cdiv(N2, BLOCK_N)
    b_lo = tl.program_id(1) * BPS
    b_hi = tl.minimum(b_lo + BPS, NB)
    m = tl.program_id(2).to(tl.int64)
    off = tl.where(pid < p1, 0, tl.where(pid < p2, N1, N1 + N2))  # its first output column
    n = tl.where(pid < p1, N1, tl.where(pid < p2, N2, N3))
    r0 = (pid - tl.where(pid < p1, 0, tl.where(pid < p2, p1, p2))) * BLOCK_N  # in its matrix
    rows = r0 + tl.arange(0, BLOCK_N)
    rmask = rows < n
    trace.wait(trace_ptr, PDL, TRACE)
    xrow = x_ptr + m * stride_xm
    if pid >= p2:
        acc = t_body(w3, h3, t_tab(g3, T3, BLOCK_N, ASM), xrow, xq_ptr, xd_ptr, xs_ptr, rows,
                     rmask, N3, NB, b_lo, b_hi,
                     BLOCK_N, XV, T3, Q8X, ASM)
    elif T1 == T2:
        # q and k of one type (the usual case): one body for both, its matrix chosen per
        # program. The same code, but a third less of it to compile: Triton's coalescing
        # pass grows with (loads x operations), most of a cold compile of three bodies
        first = pid < p1
        acc = t_body(tl.where(first, w1, w2), tl.where(first, h1, h2),
                     t_tab(tl.where(first, g1, g2), T1, BLOCK_N, ASM), xrow, xq_ptr, xd_ptr,
                     xs_ptr, rows, rmask, tl.where(first, N1, N2), NB,
                     b_lo, b_hi, BLOCK_N, XV, T1, Q8X, ASM)
    elif pid < p1:
        acc = t_body(w1, h1, t_tab(g1, T1, BLOCK_N, ASM), xrow, xq_ptr, xd_ptr, xs_ptr, rows,
                     rmask, N1, NB, b_lo, b_hi,
                     BLOCK_N, XV, T1, Q8X, ASM)
    else:
        acc = t_body(w2, h2, t_tab(g2, T2, BLOCK_N, ASM), xrow, xq_ptr, xd_ptr, xs_ptr, rows,
                     rmask, N2, NB, b_lo, b_hi,
                     BLOCK_N, XV, T2, Q8X, ASM)
    trace.stamp(trace_ptr, 2, TRACE)
    last = True
    if SPLIT > 1:
        # each matrix's [SPLIT, n] partial sums after the ones before it
        last, acc = t_split_done(part_ptr + (m * (N1 + N2 + N3) + off) * SPLIT, acc, rows,
                                 rmask, n, cnt_ptr + m * tl.num_programs(0) + pid, SPLIT,
                                 BLOCK_N)
    if last:
        if HAS_BIAS:
            if pid < p1:
                acc += tl.load(b1 + rows, mask=rmask, other=0.0).to(tl.float32)
            elif pid < p2:
                acc += tl.load(b2 + rows, mask=rmask, other=0.0).to(tl.float32)
            else:
                acc += tl.load(b3 + rows, mask=rmask, other=0.0).to(tl.float32)
        tl.store(y_ptr + m * stride_ym + off + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)
        if ROPE:
            # the rows just stored, read back by heads: every thread's stores first
            tl.debug_barrier()
            h0 = (off + r0) // D  # the tile's first head (q heads, then k, then v)
            if pid < p2:
                rope_mod.rope_store_heads(y_ptr, pos_ptr, kc, kc8, kch, cells, n_q, KVH,
                                          stride_ym, D, log2_base, freq_scale, f_ptr, mscale,
                                          wq_ptr, wk_ptr, eps, m, h0, (off + n) // D, D, HALF,
                                          NEOX, BLOCK_N // D, Q8, FREQS, QK_NORM)
            else:
                for j in tl.static_range(BLOCK_N // D):
                    h = h0 - n_q - KVH + j  # a value head
                    if h < KVH:
                        _kv_store_one(y_ptr + N1 + N2, pos_ptr, vc, vc8, vch, cells, KVH,
                                      stride_ym, D, m, h, D, Q8)
    trace.stamp(trace_ptr, 3, TRACE)


def rope_fits(rows: list[int], head_dim: int, config: tuple[int, int, int] | None) -> bool:
    """Whether ``gemv_t3`` of q, k, v with ``rows`` rows can rotate and store in its epilogue
    (``rope=``): whole heads of a power-of-two head_dim in every row tile of ``config``, and as
    many value heads as key heads."""
    block_n = (config or T_CONFIG)[0]
    d = head_dim
    return (d > 1 and not d & (d - 1) and block_n % d == 0 and rows[0] % d == 0
            and rows[1] == rows[2] and rows[1] % d == 0)


def gemv_t3(mats: list[tuple[torch.Tensor, int, int]], x: torch.Tensor, out: torch.Tensor,
            part: torch.Tensor, counter: torch.Tensor, biases: list[torch.Tensor] | None = None,
            config: tuple[int, int, int] | None = None, xq=None, rope: dict | None = None,
            use_pdl: bool = True) -> torch.Tensor:
    """Three GEMVs of the same x (q, k, v) in one launch, outputs side by side in ``out``
    [M, n1 + n2 + n3]: ``mats`` is three (T weight, type, rows), each its own type. ``part``
    >= M x splits x (n1 + n2 + n3) floats; ``counter``, ``biases``, ``xq``, ``use_pdl`` as in
    ``gemv_t``. ``rope``: decode's rotation and cache store in the same launch, the keyword
    arguments of carve_kernels/rope.py ``store_args`` but n_q and n_kv (from the rows and
    ``head_dim``); M rows are M tokens at positions[:M]; needs ``rope_fits``."""
    if len(mats) != 3 or (biases is not None and len(biases) != 3):
        raise ValueError("gemv_t3 takes three matrices (and three biases or none)")
    words = [_t_words(wt, t, r) for wt, t, r in mats]
    nb, values = words[0][0], BLOCK_VALUES.get(mats[0][1], 256)
    if any(w[0] != nb or BLOCK_VALUES.get(t, 256) != values
           for w, (_, t, _) in zip(words, mats)):
        raise ValueError("gemv_t3's matrices must have the same number of columns, in blocks "
                         "of one size")
    rows = [r for _, _, r in mats]
    config = _tuned(config, T_CONFIG, "qkv")
    grid, x2, bps, meta, warps = _t_grid(rows, nb, x, config, 1, part, counter, use_pdl, values)
    y = out if out.dim() == 2 else out.view(x2.shape[0], -1)
    if y.shape != (x2.shape[0], sum(rows)) or y.stride(1) != 1:
        raise ValueError("out must hold the three outputs side by side")
    q, d, s, use = _q8_in(xq, mats[0][1], x2)
    b = biases if biases is not None else [y, y, y]
    if rope is None:
        r_args, r_meta = rope_mod.no_store_args(y)
    else:
        hd = rope["head_dim"]
        if not rope_fits(rows, hd, config):
            raise ValueError(f"gemv_t3 cannot rotate heads of {hd} in row tiles of "
                             f"{(config or T_CONFIG)[0]} (rows {rows})")
        r_args, r_meta = rope_mod.store_args(n_q=rows[0] // hd, n_kv=rows[1] // hd, **rope)
    _gemv_t3_kernel[grid](*words[0][1], *words[1][1], *words[2][1], *b, x2, q, d, s, y, part,
                          counter, *rows, nb, bps, x2.stride(0), y.stride(0), *r_args,
                          **trace.args("gemv_t3", grid, y), HAS_BIAS=biases is not None, T1=mats[0][1], T2=mats[1][1],
                          T3=mats[2][1], Q8X=use,
                          ASM=_asm(x2.is_cuda, *(t for _, t, _ in mats)), ROPE=rope is not None,
                          **r_meta, **meta, num_warps=warps)
    return out

"""Mixture-of-experts decode on x's int8 copy (carve_kernels/q8x.py): the routed experts'
gate/up and down GEMVs of one row with the int8-x bodies of carve_kernels/gemv_q8.py, for the
types and row lengths that have one (``q8_able``); carve_kernels/moe_decode.py has the bf16-x
kernels, their references and the gather of host experts. Gate/up's GLU epilogue writes the
int8 copy of its outputs, down's input; down sums its k rows in order by each row tile's last
program (a counter) or by ``combine``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace
from carve_kernels.gemv_q8 import Q8_BLOCK, Q8_TYPES, q4k_q8_rows_dot, q8_rows_dot
from carve_kernels.gemv_q8_blocks import lut_words
from carve_kernels.gemv_t import t_pair_split_done
from carve_kernels.moe import _ACTS, _act, combine, expert_rows
from carve_kernels.quant_matmul import row_cols
from spec import quant_types as qt

# decode expert GEMVs on x's int8 copy (carve_kernels/gemv_q8.py, one row of x), tiles by (type,
# part): rows per program (a multiple of 32: the GLU writes its output's int8 copy 32 values a
# group), blocks per step, warps; `python -m benchmarks.device_check --moe` sweeps them.
# The bodies of a thread per 32-value block share MXFP4's tiles (BLOCK_TILES):
# - MXFP4 (17-byte blocks): the sweep's best at gpt-oss-20b's shape, gate/up 27.5 us, down 17.6
#   (device_check --moe, H200, 2026-12-03);
# - Q5_0 (q50_q8_rows_dot): GLM-4.5-Air Q4_K_M (24 of its 45 routed downs Q5_0, the fallback
#   for Q4_K on 1408-value rows) tg64 155.8 against 148.7 t/s on bf16 x (H200, 2026-12-04, same
#   greedy ids);
# - Q8_0 (gemv_dot's q80_rows_dot): GLM-4.5-Air Q4_K_M (22 of its routed downs Q8_0, Q6_K's
#   fallback on 1408-value rows) tg64 168.5 against 155.9 t/s on the generic bf16-x walk (H200,
#   2026-12-04, same greedy ids);
# - on trial: IQ4_NL (iq4nl_experts). Q4_0, Q4_1 and Q5_1 experts on the dense GEMVs' bodies
#   at these tiles lost (30B-A3B all Q4_0 tg128 301.6 against 350.7 t/s on bf16 x, H100,
#   2026-12-07): they read bf16 x.
BLOCK_TILES = {"glu": (32, 16, 8), "down": (16, 32, 4)}
EXPERT_Q8_CONFIG: dict[tuple[int, str], tuple[int, int, int]] = {
    (qt.Q4_K, "glu"): (32, 4, 4), (qt.Q6_K, "glu"): (32, 1, 4),
    # Q6_K down at 16 rows x 1 block x 2 warps: 12.9 against 14.3 us at 32 x 1 x 4 (30B-A3B,
    # device_check --moe), 30B-A3B tg128 396.0 against 391.0 t/s in the step (2026-12-03)
    (qt.Q4_K, "down"): (64, 4, 8), (qt.Q6_K, "down"): (16, 1, 2),
    # Q3_K: device_check --moe --types Q3_K's best at GLM-4.5-Air's shape (2026-12-04): gate/up
    # 47.6 us (bf16 x 50.3; 79.5 at 32x1x4), down 4096 x 1536 32.7 us with the in-kernel sum
    # (bf16 x, split 40.6; 41.9 at 16x1x2); GLM-4.5-Air Q3_K_M (its gate/up experts Q3_K) tg64
    # 146.5 against 135.9 t/s on bf16 x (H200, 2026-12-04, same greedy ids)
    (qt.Q3_K, "glu"): (32, 8, 8), (qt.Q3_K, "down"): (128, 4, 8),
    **{(t, part): cfg for t in (qt.MXFP4, qt.Q5_0, qt.Q8_0, qt.IQ4_NL)
       for part, cfg in BLOCK_TILES.items()},
}

# the int8-x bodies on trial that decode's experts take (gemv_q8.Q8_TRIAL_TYPES; set by
# RunnerOptions.apply for the trials CARVE_TRIAL names)
Q8_ON_TRIAL: frozenset[int] = frozenset()


def _lut(*types: int) -> dict:
    # IQ4_NL's value table as the kernels' constants L0..L3 (none for the other types, so
    # their variants are as before)
    if qt.IQ4_NL not in types:
        return {}
    return dict(zip(("L0", "L1", "L2", "L3"), lut_words(qt.IQ4_NL), strict=True))


def q8_able(ggml_type: int, cols: int) -> bool:
    """Whether decode's expert GEMVs of this type and row length multiply x's int8 copy (the
    types with a body in carve_kernels/gemv_q8.py: Q4_K, Q6_K, MXFP4, Q5_0, Q3_K, Q8_0; IQ4_NL
    on trial)."""
    return ((ggml_type in Q8_TYPES or ggml_type in Q8_ON_TRIAL)
            and cols % Q8_BLOCK[ggml_type] == 0)


def _q8_views(w: torch.Tensor, ggml_type: int, what: str):
    if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"{what} must be contiguous uint8 [rows, row_bytes]")
    # Q4_K reads int32 words (its 144-byte blocks keep rows 4-byte aligned), Q6_K and Q3_K
    # 16-bit ones, MXFP4, Q5_0, IQ4_NL and Q8_0 the aligned int32 words around their 17-, 22-,
    # 18- and 34-byte blocks (the tensor 4-byte aligned; their d 16-bit loads)
    if ggml_type in (qt.MXFP4, qt.Q5_0, qt.IQ4_NL, qt.Q8_0):
        if w.data_ptr() % 4:
            raise ValueError(f"{what}: {qt.type_name(ggml_type)} experts must start 4-byte "
                             "aligned for the int8-x body")
        return w, (w if ggml_type == qt.MXFP4 else w.view(torch.float16)), w
    wi = w.view(torch.int32) if ggml_type == qt.Q4_K else w
    return w, w.view(torch.float16), wi


@triton.jit
def _expert_glu_q8_kernel(g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr, ui_ptr, gb_ptr, ub_ptr, xq_ptr,
                          xd_ptr, xs_ptr, ids_ptr, h_ptr, oq_ptr, od_ptr, os_ptr, N, NB, g_rb,
                          u_rb, limit, trace_ptr, part_ptr, cnt_ptr, BPS, KU: tl.constexpr,
                          TG: tl.constexpr, TU: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ACT: tl.constexpr, QOUT: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_B: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                          TRACE: tl.constexpr, LATE: tl.constexpr = False,
                          SPLIT: tl.constexpr = 1, L0: tl.constexpr = 0,
                          L1: tl.constexpr = 0, L2: tl.constexpr = 0, L3: tl.constexpr = 0):
    trace.wait(trace_ptr, PDL, TRACE, LATE)
    if SPLIT == 1:
        # one row of x: slot j (program axis 1) is its j-th expert
        _glu_q8_tile(tl.program_id(0), tl.program_id(1), g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr,
                     ui_ptr, gb_ptr, ub_ptr, xq_ptr, xd_ptr, xs_ptr, ids_ptr, h_ptr, oq_ptr,
                     od_ptr, os_ptr, N, NB, g_rb, u_rb, limit, trace_ptr, TG, TU, HAS_BIAS,
                     ACT, QOUT, BLOCK_R, BLOCK_B, ASM, TRACE, L0, L1, L2, L3)
    else:
        # Q4_K gate and up, each row's blocks in SPLIT ranges: split (program axis 1) of slot
        # j (axis 2)
        _glu_q8_split(tl.program_id(0), tl.program_id(2), gi_ptr, ui_ptr, gb_ptr, ub_ptr,
                      xq_ptr, xd_ptr, xs_ptr, ids_ptr, h_ptr, oq_ptr, od_ptr, os_ptr, N, NB,
                      BPS, g_rb, limit, trace_ptr, part_ptr, cnt_ptr, HAS_BIAS, ACT, QOUT,
                      BLOCK_R, BLOCK_B, SPLIT, ASM, TRACE)
    if LATE:
        pdl.release(PDL)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _glu_q8_tile(pid, slot, g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr, ui_ptr, gb_ptr, ub_ptr, xq_ptr,
                 xd_ptr, xs_ptr, ids_ptr, h_ptr, oq_ptr, od_ptr, os_ptr, N, NB, g_rb, u_rb, limit,
                 trace_ptr, TG: tl.constexpr, TU: tl.constexpr, HAS_BIAS: tl.constexpr,
                 ACT: tl.constexpr, QOUT: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_B: tl.constexpr, ASM: tl.constexpr, TRACE: tl.constexpr,
                 L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr, L3: tl.constexpr):
    # row tile ``pid`` of the ``slot``-th chosen expert's gate and up, the activation, and its
    # int8 copy (QOUT); the main loop's end stamped (carve_kernels/trace.py)
    eid = tl.load(ids_ptr + slot)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    rows_c = eid * N + tl.minimum(rows, N - 1)
    if TG == 12 and TU == 12:  # gate and up words in one step, x's words loaded once
        g, u = q4k_q8_rows_dot(gi_ptr, ui_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, NB, g_rb,
                               BLOCK_R, BLOCK_B, True, ASM)
    else:
        g = q8_rows_dot(g_ptr, gh_ptr, gi_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, NB, g_rb, TG,
                        BLOCK_R, BLOCK_B, ASM, L0, L1, L2, L3)
        u = q8_rows_dot(u_ptr, uh_ptr, ui_ptr, xq_ptr, xd_ptr, xs_ptr, rows_c, NB, u_rb, TU,
                        BLOCK_R, BLOCK_B, ASM, L0, L1, L2, L3)
    trace.stamp(trace_ptr, 2, TRACE)
    _glu_q8_out(pid, slot, g, u, rows, rmask, rows_c, gb_ptr, ub_ptr, h_ptr, oq_ptr, od_ptr,
                os_ptr, N, limit, HAS_BIAS, ACT, QOUT, BLOCK_R)


@triton.jit
def _glu_q8_out(pid, slot, g, u, rows, rmask, rows_c, gb_ptr, ub_ptr, h_ptr, oq_ptr, od_ptr,
                os_ptr, N, limit, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                QOUT: tl.constexpr, BLOCK_R: tl.constexpr):
    # a gate/up tile's epilogue: the biases, the activation, h stored, and its int8 copy
    # (QOUT), the down GEMV's input
    if HAS_BIAS:
        g += tl.load(gb_ptr + rows_c).to(tl.float32)
        u += tl.load(ub_ptr + rows_c).to(tl.float32)
    h = _act(g, u, ACT, limit)
    tl.store(h_ptr + slot * N + rows, h.to(h_ptr.dtype.element_ty), mask=rmask)
    if QOUT:
        q8x.store_q8(h, slot * N + pid * BLOCK_R, N - pid * BLOCK_R, oq_ptr, od_ptr, os_ptr,
                     BLOCK_R)


@triton.jit
def _glu_q8_split(pid, slot, gi_ptr, ui_ptr, gb_ptr, ub_ptr, xq_ptr, xd_ptr, xs_ptr, ids_ptr,
                  h_ptr, oq_ptr, od_ptr, os_ptr, N, NB, BPS, g_rb, limit, trace_ptr, part_ptr,
                  cnt_ptr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr, QOUT: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, SPLIT: tl.constexpr,
                  ASM: tl.constexpr, TRACE: tl.constexpr):
    # row tile ``pid`` of the ``slot``-th chosen expert's Q4_K gate and up over blocks
    # [b_lo, b_lo + BPS) of its rows: the body walks them as whole rows of their own, its
    # weight words, x's words and x's scales advanced to b_lo (the row stride unchanged). The
    # sums go to part [slot, 2, SPLIT, N]; the tile's last split to finish adds them in split
    # order (the same bits whatever order the programs ran in) and runs the activation and
    # the int8 copy, as the unsplit tile does
    eid = tl.load(ids_ptr + slot)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    rows_c = eid * N + tl.minimum(rows, N - 1)
    b_lo = tl.program_id(1) * BPS
    g, u = q4k_q8_rows_dot(gi_ptr + b_lo * 36, ui_ptr + b_lo * 36, xq_ptr + b_lo * 64,
                           xd_ptr + b_lo * 8, xs_ptr + b_lo * 8, rows_c,
                           tl.minimum(BPS, NB - b_lo), g_rb, BLOCK_R, BLOCK_B, True, ASM)
    trace.stamp(trace_ptr, 2, TRACE)
    last, g, u = t_pair_split_done(part_ptr + slot * (2 * SPLIT * N), g, u, rows, rmask, N,
                                   cnt_ptr + slot * tl.num_programs(0) + pid, SPLIT, BLOCK_R)
    if last:
        _glu_q8_out(pid, slot, g, u, rows, rmask, rows_c, gb_ptr, ub_ptr, h_ptr, oq_ptr, od_ptr,
                    os_ptr, N, limit, HAS_BIAS, ACT, QOUT, BLOCK_R)


# decode's Q4_K expert gate/up split along each row's blocks into this many programs (1: not
# split): more, shorter programs where the k experts' row tiles alone leave SMs short of
# warps (Qwen3-30B-A3B: 8 x 24 tiles of 32 rows on 132 SMs; 2: 429.7 against 425.4 t/s on an
# H100, NOTES.md), in the scratch of the T GEMVs' splits where it holds the partial sums
GLU_SPLIT = 2


def expert_glu_q8(gate: torch.Tensor, gate_type: int, up: torch.Tensor, up_type: int,
                  n_expert: int, xq, ids: torch.Tensor, out: torch.Tensor, act: str = "silu",
                  gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                  limit: float = 0.0, out_q=None, config: tuple[int, int, int] | None = None,
                  use_pdl: bool = True, late: bool = False, scratch=None,
                  split: int | None = None) -> torch.Tensor:
    """``expert_glu`` for one row of x given as its int8 copy ``xq`` (q words, d, s of
    carve_kernels/q8x.py), gate and up Q4_K, Q6_K or MXFP4:
    ``out[j] = act(x @ gate_e^T) * (x @ up_e^T)``, e = ids[0, j]. ``out_q``: (q, d, s)
    buffers for the int8 copy of ``out`` ([k * rows] values), the input of
    ``expert_down_q8``. ``late``: the next kernel becomes resident after the tiles' writes, not
    at their start (carve_kernels/pdl.py ``release``). ``scratch``: float32 and int32 zeros
    (the T GEMVs' ``t_part`` and ``t_count``, left zero) for ``split`` (default GLU_SPLIT)
    programs along each row's blocks, used for Q4_K gate and up where they hold the split
    (else not split)."""
    n, k = expert_rows(gate, n_expert), row_cols(gate, gate_type)
    if up.shape[0] != gate.shape[0] or row_cols(up, up_type) != k:
        raise ValueError("gate and up experts differ in shape")
    if not (q8_able(gate_type, k) and q8_able(up_type, k)):
        raise ValueError(f"no int8-x expert GEMV for {qt.type_name(gate_type)}/"
                         f"{qt.type_name(up_type)} rows of {k}")
    if ids.shape[0] != 1 or not q8x.fits(xq, k):
        raise ValueError("expert_glu_q8 takes one row of x and its int8 copy")
    ku = ids.shape[1]
    br, bb, warps = config or EXPERT_Q8_CONFIG[(gate_type, "glu")]
    if out_q is not None and (n % 32 or br % 32 or not q8x.fits(out_q, ku * n)):
        raise ValueError(f"no int8 copy of {ku} x {n} expert outputs here")
    oq, od, os_ = out_q if out_q is not None else xq
    gp, upp = _q8_views(gate, gate_type, "gate"), _q8_views(up, up_type, "up")
    bias = gate_bias is not None
    nb, tiles = k // Q8_BLOCK[gate_type], triton.cdiv(n, br)
    split = _glu_split(split or GLU_SPLIT, gate_type, up_type, nb, ku, n, tiles, scratch)
    bps = triton.cdiv(nb, split)
    part, count = scratch if split > 1 else (out, ids)
    grid = (tiles, split, ku) if split > 1 else (tiles, ku)
    _expert_glu_q8_kernel[grid](
        *gp, *upp, gate_bias if bias else out, up_bias if bias else out, *xq, ids, out, oq, od,
        os_, n, nb, gate.shape[1], up.shape[1], float(limit),
        **trace.args("expert_glu_q8", grid, out), part_ptr=part, cnt_ptr=count, BPS=bps,
        KU=ku, TG=gate_type, TU=up_type, HAS_BIAS=bias, ACT=_ACTS[act],
        QOUT=out_q is not None, BLOCK_R=br,
        BLOCK_B=min(bb, triton.next_power_of_2(bps if split > 1 else nb)),
        ASM=gate.is_cuda, num_warps=warps, LATE=late and pdl.enabled(out, use_pdl),
        SPLIT=split, **_lut(gate_type, up_type), **pdl.opts(out, use_pdl))
    return out


def _glu_split(split: int, gate_type: int, up_type: int, nb: int, ku: int, n: int, tiles: int,
               scratch) -> int:
    # the split expert_glu_q8 runs: Q4_K gate and up only, each split at least one block (as
    # many splits as whole ranges of ceil(nb / split) blocks), where the scratch holds
    # k x 2 x split x n partial sums and k x tiles counters
    split = triton.cdiv(nb, triton.cdiv(nb, max(1, min(split, nb))))
    if split <= 1 or scratch is None or not gate_type == up_type == qt.Q4_K:
        return 1
    part, count = scratch
    if part.numel() < ku * 2 * split * n or count.numel() < ku * tiles:
        return 1
    return split


@triton.jit
def _expert_down_q8_kernel(w_ptr, wh_ptr, wi_ptr, b_ptr, hq_ptr, hd_ptr, hs_ptr, ids_ptr, y_ptr,
                           rw_ptr, out_ptr, cnt_ptr, N, K, row_bytes, stride_ym, trace_ptr,
                           KU: tl.constexpr, HAS_BIAS: tl.constexpr, COMBINE: tl.constexpr,
                           ACCUM: tl.constexpr, TYPE: tl.constexpr, QK: tl.constexpr,
                           BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr,
                           PDL: tl.constexpr, TRACE: tl.constexpr, L0: tl.constexpr = 0,
                           L1: tl.constexpr = 0, L2: tl.constexpr = 0, L3: tl.constexpr = 0):
    # one expert per program: its rows (+ bias), unweighted, into y's routed row; COMBINE: the
    # row tile's last expert program to finish adds the k rows in order with their weights
    # onto out (the same sum as ``combine``, whatever order the programs ran in)
    trace.wait(trace_ptr, PDL, TRACE)
    _down_q8_tile(tl.program_id(0), tl.program_id(1), w_ptr, wh_ptr, wi_ptr, b_ptr, hq_ptr,
                  hd_ptr, hs_ptr, ids_ptr, y_ptr, rw_ptr, out_ptr, cnt_ptr, N, K, row_bytes,
                  stride_ym, trace_ptr, KU, HAS_BIAS, COMBINE, ACCUM, TYPE, QK, BLOCK_R, BLOCK_B,
                  ASM, TRACE, L0, L1, L2, L3)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _down_q8_tile(pid, slot, w_ptr, wh_ptr, wi_ptr, b_ptr, hq_ptr, hd_ptr, hs_ptr, ids_ptr, y_ptr,
                  rw_ptr, out_ptr, cnt_ptr, N, K, row_bytes, stride_ym, trace_ptr,
                  KU: tl.constexpr, HAS_BIAS: tl.constexpr, COMBINE: tl.constexpr,
                  ACCUM: tl.constexpr, TYPE: tl.constexpr, QK: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, ASM: tl.constexpr,
                  TRACE: tl.constexpr, L0: tl.constexpr, L1: tl.constexpr, L2: tl.constexpr,
                  L3: tl.constexpr):
    # row tile ``pid`` of the ``slot``-th chosen expert's down rows, and (COMBINE) the tile's
    # sum over the k experts by the last of its programs; the main loop's end stamped
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    rows_c = tl.load(ids_ptr + slot) * N + tl.minimum(rows, N - 1)
    g = slot * (K // 32)
    y = q8_rows_dot(w_ptr, wh_ptr, wi_ptr, hq_ptr + slot * (K // 4), hd_ptr + g, hs_ptr + g,
                    rows_c, K // QK, row_bytes, TYPE, BLOCK_R, BLOCK_B, ASM, L0, L1, L2, L3)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows_c).to(tl.float32)
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(y_ptr + slot.to(tl.int64) * stride_ym + rows, y, mask=rmask)
    if COMBINE:
        tl.debug_barrier()  # every thread's stores issued before the counter's release
        if tl.atomic_add(cnt_ptr + pid, 1) == KU - 1:
            acc = tl.zeros([BLOCK_R], dtype=tl.float32)
            for j in tl.static_range(KU):
                acc += tl.load(rw_ptr + j) * tl.load(y_ptr + j * stride_ym + rows, mask=rmask,
                                                     other=0.0, cache_modifier=".cg")
            if ACCUM:
                acc += tl.load(out_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
            tl.store(out_ptr + rows, acc.to(out_ptr.dtype.element_ty), mask=rmask)
            tl.atomic_xchg(cnt_ptr + pid, 0)  # zero again for the next call


def expert_down_q8(down: torch.Tensor, ggml_type: int, n_expert: int, hq, ids: torch.Tensor,
                   weights: torch.Tensor, out: torch.Tensor, rows_out: torch.Tensor,
                   bias: torch.Tensor | None = None, accumulate: bool = False,
                   config: tuple[int, int, int] | None = None, use_pdl: bool = True,
                   counter: torch.Tensor | None = None) -> torch.Tensor:
    """``expert_down`` (with ``rows_out``) for one row whose k GLU outputs come as their int8
    copy ``hq`` (q words, d, s; ``expert_glu_q8``'s ``out_q``), down Q4_K, Q6_K or MXFP4: the
    k experts' rows in parallel programs into ``rows_out``, then summed in order onto ``out``:
    by each row tile's last program with ``counter`` (int32 zeros, one per tile of the
    config's rows, left zero), else by ``combine`` (a second launch)."""
    n, k = expert_rows(down, n_expert), row_cols(down, ggml_type)
    ku = ids.shape[1]
    if not q8_able(ggml_type, k):
        raise ValueError(f"no int8-x expert GEMV for {qt.type_name(ggml_type)} rows of {k}")
    if ids.shape[0] != 1 or not q8x.fits(hq, ku * k):
        raise ValueError("expert_down_q8 takes one row's k expert inputs as their int8 copy")
    if rows_out.shape != (ku, n) or rows_out.dtype != torch.float32 or not rows_out.is_contiguous():
        raise ValueError(f"rows_out must be contiguous float32 [{ku}, {n}]")
    br, bb, warps = config or EXPERT_Q8_CONFIG[(ggml_type, "down")]
    tiles = triton.cdiv(n, br)
    fused = counter is not None
    if fused and (counter.dtype != torch.int32 or counter.numel() < tiles
                  or out.numel() != n or not out.is_contiguous()):
        raise ValueError(f"counter must hold {tiles} int32 zeros and out one row of {n}")
    _expert_down_q8_kernel[(tiles, ku)](
        *_q8_views(down, ggml_type, "down"), bias if bias is not None else rows_out, *hq, ids,
        rows_out, weights, out, counter if fused else ids, n, k, down.shape[1],
        rows_out.stride(0), **trace.args("expert_down_q8", (tiles, ku), rows_out), KU=ku,
        HAS_BIAS=bias is not None, COMBINE=fused, ACCUM=accumulate, TYPE=ggml_type,
        QK=Q8_BLOCK[ggml_type], BLOCK_R=br,
        BLOCK_B=min(bb, triton.next_power_of_2(k // Q8_BLOCK[ggml_type])), ASM=down.is_cuda,
        num_warps=warps, **_lut(ggml_type), **pdl.opts(rows_out, use_pdl))
    if not fused:
        combine(rows_out, None, weights, out, accumulate)
    return out

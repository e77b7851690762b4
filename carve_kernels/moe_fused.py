"""Decode's routed experts in one launch (on trial: ``CARVE_TRIAL=expert_ffn_fused``): gate/up
with the activation and down with the in-kernel sum, the two launches of
carve_kernels/moe_decode.py (``expert_glu_q8`` then ``expert_down_q8``) as one grid.

Programs ``[0, NT_G * k)`` are the gate/up row tiles (slot-major: expert slot j's tiles
together), the rest the down row tiles, also slot-major. A gate/up program ends by counting
itself into its slot's counter (``ready``, release); a down program of slot j waits until
slot j's NT_G gate/up programs have counted (reading the counter, then one acquire), so it
starts as soon as its own expert's GLU outputs and their int8 copy are written, while other
experts' gate/up programs still run, and no launch boundary lies between the two halves.
Each down program counts itself in after its tile; the last of a slot sets the counter back
to zero for the next call.

Why this does not deadlock: every program a down program waits for has a lower program id,
and NVIDIA GPUs start a grid's programs in id order (what the single-pass scans' look-back
relies on too, though CUDA does not promise it), so the gate/up programs are resident (and
need nothing) before any down program waits; the interpreter runs programs one by one in id
order, so its down programs find their counters full. The bits are those of the two launches:
the same tiles, and the same in-order sum of the k rows by each row tile's last program.

The down tiles run with the gate/up tiles' warps (one launch has one warp count): rows and
blocks from ``EXPERT_Q8_CONFIG``'s down entry, warps from its glu entry.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace
from carve_kernels.gemv_q8 import Q8_BLOCK
from carve_kernels.moe import _ACTS, expert_rows
from carve_kernels.moe_decode import (
    EXPERT_Q8_CONFIG,
    _down_q8_tile,
    _glu_q8_tile,
    _lut,
    _q8_views,
    q8_able,
)
from carve_kernels.quant_matmul import row_cols
from spec import quant_types as qt

# set by RunnerOptions.apply when CARVE_TRIAL names expert_ffn_fused: the stage's decode then
# launches `expert_ffn_q8` instead of the two kernels
ON = False


@triton.jit
def _expert_ffn_q8_kernel(g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr, ui_ptr, gb_ptr, ub_ptr, xq_ptr,
                          xd_ptr, xs_ptr, ids_ptr, h_ptr, oq_ptr, od_ptr, os_ptr, w_ptr, wh_ptr,
                          wi_ptr, db_ptr, y_ptr, rw_ptr, out_ptr, cnt_ptr, ready_ptr, F, NB, g_rb,
                          u_rb, E, d_rb, stride_ym, limit, NT_G, NT_D, trace_ptr,
                          KU: tl.constexpr, TG: tl.constexpr, TU: tl.constexpr,
                          TD: tl.constexpr, QKD: tl.constexpr, HAS_BIAS: tl.constexpr,
                          ACT: tl.constexpr, ACCUM: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_B: tl.constexpr, DOWN_R: tl.constexpr, DOWN_B: tl.constexpr,
                          ASM: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr,
                          L0: tl.constexpr = 0, L1: tl.constexpr = 0, L2: tl.constexpr = 0,
                          L3: tl.constexpr = 0):
    trace.stamp(trace_ptr, 0, TRACE)
    pdl.start(PDL)
    pid = tl.program_id(0)
    n_glu = NT_G * KU
    if pid < n_glu:
        trace.stamp(trace_ptr, 1, TRACE)
        slot = pid // NT_G
        _glu_q8_tile(pid % NT_G, slot, g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr, ui_ptr, gb_ptr,
                     ub_ptr, xq_ptr, xd_ptr, xs_ptr, ids_ptr, h_ptr, oq_ptr, od_ptr, os_ptr, F,
                     NB, g_rb, u_rb, limit, trace_ptr, TG, TU, HAS_BIAS, ACT, True, BLOCK_R,
                     BLOCK_B, ASM, TRACE, L0, L1, L2, L3)
        tl.debug_barrier()  # every thread's stores issued before the counter's release
        tl.atomic_add(ready_ptr + slot, 1, sem="release")
    else:
        j = pid - n_glu
        slot = j // NT_D
        seen = tl.load(ready_ptr + slot, volatile=True)
        while seen < NT_G:  # this expert's gate/up tiles, all of lower program ids
            seen = tl.load(ready_ptr + slot, volatile=True)
        tl.atomic_add(ready_ptr + slot, 0, sem="acquire")  # their outputs visible from here
        trace.stamp(trace_ptr, 1, TRACE)  # a down program's wait: PDL's, then its expert's
        _down_q8_tile(j % NT_D, slot, w_ptr, wh_ptr, wi_ptr, db_ptr, oq_ptr, od_ptr, os_ptr,
                      ids_ptr, y_ptr, rw_ptr, out_ptr, cnt_ptr, E, F, d_rb, stride_ym, trace_ptr,
                      KU, HAS_BIAS, True, ACCUM, TD, QKD, DOWN_R, DOWN_B, ASM, TRACE, L0, L1, L2,
                      L3)
        if tl.atomic_add(ready_ptr + slot, 1) == NT_G + NT_D - 1:
            tl.atomic_xchg(ready_ptr + slot, 0)  # the slot's last program: zero for next call
    trace.stamp(trace_ptr, 3, TRACE)


def expert_ffn_q8(gate: torch.Tensor, gate_type: int, up: torch.Tensor, up_type: int,
                  down: torch.Tensor, down_type: int, n_expert: int, xq, ids: torch.Tensor,
                  weights: torch.Tensor, h: torch.Tensor, hq, out: torch.Tensor,
                  rows_out: torch.Tensor, counter: torch.Tensor, ready: torch.Tensor,
                  act: str = "silu", gate_bias: torch.Tensor | None = None,
                  up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  limit: float = 0.0, accumulate: bool = False,
                  use_pdl: bool = True) -> torch.Tensor:
    """One row's routed experts, ``out (+)= sum_j w_j down_e(act(x gate_e^T) * (x up_e^T))``
    (e = ids[0, j]), in one launch: ``expert_glu_q8`` (writing ``h`` [k, F] and its int8 copy
    ``hq``) then ``expert_down_q8`` with its in-kernel sum (``rows_out`` float32 [k, E],
    ``counter`` int32 zeros, one per down row tile), the same bits. ``ready``: k int32 zeros
    (left zero). ``xq``: the row's int8 copy (q words, d, s)."""
    f, e_in = expert_rows(gate, n_expert), row_cols(gate, gate_type)
    e, f_in = expert_rows(down, n_expert), row_cols(down, down_type)
    ku = ids.shape[1]
    if up.shape[0] != gate.shape[0] or row_cols(up, up_type) != e_in or f_in != f or e != e_in:
        raise ValueError("gate, up and down experts differ in shape")
    if not (q8_able(gate_type, e_in) and q8_able(up_type, e_in) and q8_able(down_type, f)):
        raise ValueError(f"no int8-x expert GEMVs for {qt.type_name(gate_type)}/"
                         f"{qt.type_name(up_type)}/{qt.type_name(down_type)}")
    if ids.shape[0] != 1 or not q8x.fits(xq, e_in) or not q8x.fits(hq, ku * f):
        raise ValueError("expert_ffn_q8 takes one row of x and the int8 copies of x and of h")
    br, bb, warps = EXPERT_Q8_CONFIG[(gate_type, "glu")]
    dr, db, _ = EXPERT_Q8_CONFIG[(down_type, "down")]
    nt_g, nt_d = triton.cdiv(f, br), triton.cdiv(e, dr)
    if f % 32 or br % 32 or h.shape != (ku, f):
        raise ValueError(f"h must be [{ku}, {f}] and its rows whole 32-value groups")
    if rows_out.shape != (ku, e) or rows_out.dtype != torch.float32 or not rows_out.is_contiguous():
        raise ValueError(f"rows_out must be contiguous float32 [{ku}, {e}]")
    if (counter.dtype != torch.int32 or counter.numel() < nt_d or ready.dtype != torch.int32
            or ready.numel() < ku or out.numel() != e or not out.is_contiguous()):
        raise ValueError(f"counter must hold {nt_d} int32 zeros, ready {ku}, out one row of {e}")
    gp, upp = _q8_views(gate, gate_type, "gate"), _q8_views(up, up_type, "up")
    bias = gate_bias is not None
    grid = (nt_g * ku + nt_d * ku,)
    _expert_ffn_q8_kernel[grid](
        *gp, *upp, gate_bias if bias else h, up_bias if bias else h, *xq, ids, h, *hq,
        *_q8_views(down, down_type, "down"), down_bias if bias else rows_out, rows_out, weights,
        out, counter, ready, f, e_in // Q8_BLOCK[gate_type], gate.shape[1], up.shape[1], e,
        down.shape[1], rows_out.stride(0), float(limit), nt_g, nt_d,
        **trace.args("expert_ffn_q8", grid, rows_out,
                     parts=(("expert_ffn_glu", nt_g * ku), ("expert_ffn_down", nt_d * ku))),
        KU=ku, TG=gate_type, TU=up_type, TD=down_type, QKD=Q8_BLOCK[down_type], HAS_BIAS=bias,
        ACT=_ACTS[act], ACCUM=accumulate, BLOCK_R=br,
        BLOCK_B=min(bb, triton.next_power_of_2(e_in // Q8_BLOCK[gate_type])), DOWN_R=dr,
        DOWN_B=min(db, triton.next_power_of_2(f // Q8_BLOCK[down_type])), ASM=gate.is_cuda,
        num_warps=warps, **_lut(gate_type, up_type, down_type), **pdl.opts(rows_out, use_pdl))
    return out

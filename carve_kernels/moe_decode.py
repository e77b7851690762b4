"""Mixture-of-experts decode: the routed experts' GEMVs (carve_kernels/moe.py has the routing and
the layout of expert tensors). Each program reads its expert id from the device and walks only that
expert's rows with ``gemv_dot.row_dot``, so every GPU type serves experts; gate and up in one
launch with the activation, down with the routing weights (in order, no atomics). The same
GEMVs on x's int8 copy: carve_kernels/moe_decode_q8.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl
from carve_kernels.gemv_dot import row_dot
from carve_kernels.moe import _ACTS, _act, _act_ref, _expert_ref, combine, expert_rows
from carve_kernels.quant_matmul import _launch_args, gemv_config, row_cols


@triton.jit
def _expert_glu_kernel(g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr, ui_ptr, gb_ptr, ub_ptr, x_ptr,
                       ids_ptr, h_ptr, N, K, g_rb, u_rb, stride_xm, limit, KU: tl.constexpr,
                       HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                       TG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr,
                       NPG: tl.constexpr, LG: tl.constexpr, LSG: tl.constexpr,
                       SPG: tl.constexpr, MGG: tl.constexpr,
                       TU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr,
                       NPU: tl.constexpr, LU: tl.constexpr, LSU: tl.constexpr,
                       SPU: tl.constexpr, MGU: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pid = tl.program_id(0)
    j = tl.program_id(1)
    m = tl.program_id(2)
    slot = m * KU + j
    eid = tl.load(ids_ptr + slot)  # the expert, read on the device
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_c = eid * N + tl.minimum(rows, N - 1)  # expert eid's rows of the 3-D tensor
    xrow = x_ptr + m.to(tl.int64) * stride_xm
    g = row_dot(g_ptr, gh_ptr, gi_ptr, xrow, rows_c, K, g_rb, TG, BSG, TSG, NPG, LG, BLOCK_R,
                BLOCK_B, LSG, SPG, MGG)
    u = row_dot(u_ptr, uh_ptr, ui_ptr, xrow, rows_c, K, u_rb, TU, BSU, TSU, NPU, LU, BLOCK_R,
                BLOCK_B, LSU, SPU, MGU)
    if HAS_BIAS:
        g += tl.load(gb_ptr + rows_c).to(tl.float32)
        u += tl.load(ub_ptr + rows_c).to(tl.float32)
    h = _act(g, u, ACT, limit)
    tl.store(h_ptr + slot.to(tl.int64) * N + rows, h.to(h_ptr.dtype.element_ty), mask=rows < N)


# decode's down runs its k experts in parallel programs into the routed rows' buffer, then sums
# them in order (expert_down's rows_out); device_check --moe times both ways
DOWN_SPLIT = True


# decode expert GEMV tiles (rows per program, blocks per step, warps) by type where they differ
# from the dense GEMV's: one expert's matrix is small (768 x 2048 at Qwen3-30B-A3B) and its k
# experts share a grid; `python -m benchmarks.device_check --moe` sweeps them
EXPERT_CONFIG: dict[tuple[int, str], tuple[int, ...]] = {}


def expert_config(ggml_type: int, rows: int, cols: int, part: str) -> tuple[int, ...]:
    """The tile of a decode expert GEMV: ``part`` "glu" (gate/up) or "down", ``rows`` x
    ``cols`` one expert's shape."""
    return EXPERT_CONFIG.get((ggml_type, part)) or gemv_config(ggml_type, rows, cols)


def _pair_meta(w: torch.Tensor, t: int, config, x_dtype, tag: str):
    ptrs, meta, warps, _ = _launch_args(w, t, config, x_dtype)
    keys = {"TYPE": "T", "BS": "BS", "TS": "TS", "NPART": "NP", "L": "L", "LANE_SUM": "LS",
            "SPECIAL": "SP", "MAGIC": "MG"}
    return ptrs, {f"{v}{tag}": meta[k] for k, v in keys.items()}, meta, warps


def expert_glu(gate: torch.Tensor, gate_type: int, up: torch.Tensor, up_type: int,
               n_expert: int, x: torch.Tensor, ids: torch.Tensor, out: torch.Tensor,
               act: str = "silu", gate_bias: torch.Tensor | None = None,
               up_bias: torch.Tensor | None = None, limit: float = 0.0,
               config: tuple[int, ...] | None = None, use_pdl: bool = True) -> torch.Tensor:
    """Decode's routed gate/up: ``out[m * k + j] = act(x[m] @ gate_e^T) * (x[m] @ up_e^T)`` with
    e = ids[m, j], reading only expert e's rows ([M * k, rows], one launch). ``act``: "silu",
    "gelu" or "swiglu_oai" (gpt-oss, clamped at ``limit``); biases [experts * rows]."""
    n, k = expert_rows(gate, n_expert), row_cols(gate, gate_type)
    if up.shape[0] != gate.shape[0] or row_cols(up, up_type) != k:
        raise ValueError("gate and up experts differ in shape")
    m, ku = ids.shape
    x2 = x.reshape(m, k)
    gp, gmeta, meta, warps = _pair_meta(gate, gate_type, config, x.dtype, "G")
    upp, umeta, _, _ = _pair_meta(up, up_type, config, x.dtype, "U")
    grid = (triton.cdiv(n, meta["BLOCK_R"]), ku, m)
    _expert_glu_kernel[grid](
        *gp, *upp, gate_bias if gate_bias is not None else x2,
        up_bias if up_bias is not None else x2, x2, ids, out, n, k, gate.shape[1], up.shape[1],
        x2.stride(0), float(limit), KU=ku, HAS_BIAS=gate_bias is not None, ACT=_ACTS[act],
        **gmeta, **umeta, BLOCK_R=meta["BLOCK_R"], BLOCK_B=meta["BLOCK_B"], num_warps=warps,
        **pdl.opts(out, use_pdl))
    return out


def expert_glu_ref(gate, gate_type, up, up_type, n_expert, x, ids, out, act="silu",
                   gate_bias=None, up_bias=None, limit=0.0, config=None, use_pdl=True):
    n = expert_rows(gate, n_expert)
    m, ku = ids.shape
    x2 = x.reshape(m, -1).float()
    for i in range(m):
        for j in range(ku):
            e = int(ids[i, j])
            g = x2[i] @ _expert_ref(gate, gate_type, n_expert, e).T
            u = x2[i] @ _expert_ref(up, up_type, n_expert, e).T
            if gate_bias is not None:
                g = g + gate_bias[e * n:(e + 1) * n].float()
                u = u + up_bias[e * n:(e + 1) * n].float()
            out[i * ku + j] = _act_ref(g, u, act, limit).to(out.dtype)
    return out


@triton.jit
def _expert_down_kernel(w_ptr, wh_ptr, wi_ptr, b_ptr, h_ptr, ids_ptr, rw_ptr, y_ptr, N, K,
                        row_bytes, stride_ym, KU: tl.constexpr, HAS_BIAS: tl.constexpr,
                        ACCUM: tl.constexpr, TYPE: tl.constexpr, BS: tl.constexpr,
                        TS: tl.constexpr, NPART: tl.constexpr, L: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, LANE_SUM: tl.constexpr,
                        SPECIAL: tl.constexpr, MAGIC: tl.constexpr, SPLIT: tl.constexpr,
                        PDL: tl.constexpr):
    pdl.start(PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < N
    if SPLIT:  # one expert per program: its row (+ bias), unweighted, into y's routed row
        slot = m * KU + tl.program_id(2)
        rows_c = tl.load(ids_ptr + slot) * N + tl.minimum(rows, N - 1)
        y = row_dot(w_ptr, wh_ptr, wi_ptr, h_ptr + slot.to(tl.int64) * K, rows_c, K, row_bytes,
                    TYPE, BS, TS, NPART, L, BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows_c).to(tl.float32)
        tl.store(y_ptr + slot.to(tl.int64) * stride_ym + rows, y, mask=rmask)
        return
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    # the k experts in order (the sum does not depend on launch order), unrolled so that the
    # k experts' id, weight and row loads are in flight together
    for j in tl.static_range(KU):
        slot = m * KU + j
        eid = tl.load(ids_ptr + slot)
        wt = tl.load(rw_ptr + slot)
        rows_c = eid * N + tl.minimum(rows, N - 1)
        y = row_dot(w_ptr, wh_ptr, wi_ptr, h_ptr + slot.to(tl.int64) * K, rows_c, K, row_bytes,
                    TYPE, BS, TS, NPART, L, BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC)
        if HAS_BIAS:
            y += tl.load(b_ptr + rows_c).to(tl.float32)
        acc += wt * y
    yp = y_ptr + m.to(tl.int64) * stride_ym + rows
    if ACCUM:
        acc += tl.load(yp, mask=rmask, other=0.0).to(tl.float32)
    tl.store(yp, acc.to(y_ptr.dtype.element_ty), mask=rmask)


def expert_down(down: torch.Tensor, ggml_type: int, n_expert: int, h: torch.Tensor,
                ids: torch.Tensor, weights: torch.Tensor, out: torch.Tensor,
                bias: torch.Tensor | None = None, accumulate: bool = False,
                config: tuple[int, ...] | None = None, use_pdl: bool = True,
                rows_out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode's routed down projection with the routing weights folded in:
    ``out[m] (+)= sum_j weights[m, j] * (h[m * k + j] @ down_e^T (+ bias_e))``, e = ids[m, j].
    Without ``rows_out``: one launch, the k experts summed in order inside each program. With
    ``rows_out`` (float32 [M * k, rows], contiguous): the k experts in parallel programs into
    it, then ``combine`` sums them in the same order (two launches, k times the programs:
    each program waits on one expert's rows, not on k in a row)."""
    n, k = expert_rows(down, n_expert), row_cols(down, ggml_type)
    m, ku = ids.shape
    ptrs, meta, warps, stages = _launch_args(down, ggml_type, config, h.dtype)
    if h.shape[-1] != k or not h.is_contiguous():
        raise ValueError("h must be contiguous [M * k, cols of down]")
    split = rows_out is not None
    if split and (rows_out.shape != (m * ku, n) or rows_out.dtype != torch.float32
                  or not rows_out.is_contiguous()):
        raise ValueError(f"rows_out must be contiguous float32 [{m * ku}, {n}]")
    y = rows_out if split else out
    grid = (triton.cdiv(n, meta["BLOCK_R"]), m, ku if split else 1)
    _expert_down_kernel[grid](*ptrs, bias if bias is not None else h, h, ids, weights, y, n, k,
                              down.shape[1], y.stride(0), KU=ku, HAS_BIAS=bias is not None,
                              ACCUM=accumulate, **meta, SPLIT=split, num_warps=warps,
                              **pdl.opts(y, use_pdl))
    if split:
        combine(rows_out, None, weights, out, accumulate)
    return out


def expert_down_ref(down, ggml_type, n_expert, h, ids, weights, out, bias=None,
                    accumulate=False, config=None, use_pdl=True, rows_out=None):
    n = expert_rows(down, n_expert)
    m, ku = ids.shape
    for i in range(m):
        acc = out[i].float() if accumulate else torch.zeros(n, device=out.device)
        for j in range(ku):
            e = int(ids[i, j])
            y = h[i * ku + j].float() @ _expert_ref(down, ggml_type, n_expert, e).T
            if bias is not None:
                y = y + bias[e * n:(e + 1) * n].float()
            acc = acc + weights[i, j].float() * y
        out[i] = acc.to(out.dtype)
    return out


# --- experts in host memory ------------------------------------------------------------------
GATHER_BLOCK = 4096  # words a gather program copies (16 KiB of int32)


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, ids_ptr, per, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)  # the ids are the routing kernel's
    c = tl.program_id(0)
    e = tl.load(ids_ptr + tl.program_id(1)).to(tl.int64)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    mask = offs < per
    v = tl.load(src_ptr + e * per + offs, mask=mask)
    tl.store(dst_ptr + e * per + offs, v, mask=mask)


def gather_experts(srcs: list[torch.Tensor], dsts: list[torch.Tensor], n_expert: int,
                   ids: torch.Tensor, use_pdl: bool = True) -> None:
    """Copy the experts ``ids`` (int32 [M, k], on the device) of each expert tensor in
    ``srcs`` (in host memory the GPU can read: pinned and mapped) to the same place of its
    twin in ``dsts`` (device memory of the same size): expert e's bytes at e * (bytes /
    n_expert). Wide sequential reads, so the bytes cross PCIe near the copy engines' rate,
    with the ids read on the device (no host sync: a decode graph holds it). An expert
    chosen by two rows is copied twice to the same place."""
    n = ids.numel()
    for src, dst in zip(srcs, dsts, strict=True):
        s, d = src.reshape(-1).view(torch.uint8), dst.reshape(-1).view(torch.uint8)
        if s.numel() != d.numel() or s.numel() % n_expert:
            raise ValueError("gather_experts: a source and its twin differ, or split unevenly")
        per = s.numel() // n_expert  # bytes an expert
        if per % 4 == 0 and s.data_ptr() % 4 == 0 and d.data_ptr() % 4 == 0:
            s, d, per = s.view(torch.int32), d.view(torch.int32), per // 4
        grid = (triton.cdiv(per, GATHER_BLOCK), n)
        _gather_kernel[grid](s, d, ids, per, BLOCK=GATHER_BLOCK, **pdl.opts(d, use_pdl))

"""Mixture-of-experts kernels: the router, the top-k routing, the expert GEMVs of decode and the
grouped GEMMs of prefill, each beside its plain-torch twin (``*_ref``, same signature).

An expert tensor is its GGUF bytes: a 3-D GGUF tensor ``[ne0 = cols, ne1 = rows, ne2 =
experts]`` whose expert e is a contiguous slice, held as uint8 ``[experts * rows, row_bytes]``
(global row ``e * rows + r`` is expert e's row r). Expert ids and weights stay on the device:
decode reads them inside its kernels (so the step stays one captured graph, no host sync), and
prefill sorts the routed rows by expert on the device too.

    router(w, x, bias, out)                 # logits [M, E] = x @ w^T (+ bias), float32
    route(logits, k, gating, ...)           # ids [M, k] int32, weights [M, k] float32
    expert_glu(gate, up, types, x, ids)     # decode: h[m*k + j] = act(g) * u of expert ids[m, j]
    expert_down(down, type, h, ids, w, out) # decode: out[m] (+)= sum_j w[m, j] down_ids[m,j](h)
    sort_routes(ids, n_expert, rows, pos, tiles)   # prefill: routed rows grouped by expert
    grouped_glu(...), grouped_down(...)     # prefill: one GEMM per expert over its rows
    combine(out_rows, pos, weights, out)    # prefill: out[m] (+)= sum_j w[m, j] out_rows[pos]

Gating (engine.gguf.hparams.HParams.expert_gating): "softmax" (qwen3moe: softmax over every
expert, top-k of the probabilities), "softmax_topk" (gpt-oss: top-k of the logits, softmax over
those k), "sigmoid" (glm4moe: top-k of sigmoid + the selection bias, the weights are the plain
sigmoids). Then, optionally, the k weights divided by their sum (at least 2^-14, as llama.cpp
clamps it) and multiplied by a scale. Ties pick the lower expert id.

The decode down kernel sums a row's k experts in order inside one program (no atomics): the
output bits do not depend on launch order, so a split over stages gives the same greedy ids.
Prefill's grouped GEMMs dequantize the expert's blocks into registers tile by tile and
multiply with ``tl.dot``: no dequantized copy of any expert exists anywhere (kernels/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.gemv_dot import row_dot
from kernels.glu import glu_act
from kernels.quant_blocks import dequant_part, plan
from kernels.quant_matmul import _launch_args, dequantize_ref, gemv_config, row_cols
from spec.launch import MOE_TILE_ROWS, moe_tiles

GATINGS = {"softmax": 0, "softmax_topk": 1, "sigmoid": 2}
NORM_MIN = 6.103515625e-5  # the smallest sum of weights the norm divides by (llama.cpp's)
OAI_ALPHA = 1.702  # gpt-oss's clamped SwiGLU: g * sigmoid(1.702 g) * (u + 1)


# --- the router and the routing -----------------------------------------------------------
@triton.jit
def _router_kernel(w_ptr, x_ptr, b_ptr, y_ptr, E, K, stride_xm, HAS_BIAS: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    rows = pid * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < E
    acc = tl.zeros([BLOCK_E, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        cm = c < K
        x = tl.load(x_ptr + m * stride_xm + c, mask=cm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * K + c[None, :],
                    mask=rmask[:, None] & cm[None, :], other=0.0)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0)
    tl.store(y_ptr + m * E + rows, y, mask=rmask)


@triton.jit
def _router_mm_kernel(w_ptr, x_ptr, b_ptr, y_ptr, M, E, K, stride_xm, HAS_BIAS: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # prefill: a tile of rows times a tile of experts, so that the router's weights are read
    # once per BLOCK_M rows, not once per row; float32 products (a tf32 rounding could change
    # which experts a near tie picks)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    rm, em = rows < M, ex < E
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        cm = c < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + c[None, :],
                    mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ex.to(tl.int64)[None, :] * K + c[:, None],
                    mask=em[None, :] & cm[:, None], other=0.0)
        acc = tl.dot(x, w, acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + ex, mask=em, other=0.0)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * E + ex[None, :], acc,
             mask=rm[:, None] & em[None, :])


ROUTER_GEMV_ROWS = 8  # up to this many rows the router runs as a GEMV (decode)


def router(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, use_pdl: bool = True) -> torch.Tensor:
    """Router logits [M, E] float32 = x [M, K] @ w^T (+ bias); ``w`` float32 [E, K] (the file
    keeps routers in F32). Up to ROUTER_GEMV_ROWS rows a GEMV, else a tiled float32 GEMM."""
    e, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, e, dtype=torch.float32, device=x.device) if out is None else out
    if m > ROUTER_GEMV_ROWS:
        # tiles of 16 rows x 32 experts: 128 programs at 512 rows x 128 experts (tiles of 32 x
        # 64 gave 32 programs on 132 SMs: 157 us on an H200 for 0.27 GFLOP)
        be = min(32, max(16, triton.next_power_of_2(e))) if x.is_cuda else max(
            16, triton.next_power_of_2(e))
        _router_mm_kernel[(triton.cdiv(e, be), triton.cdiv(m, 16))](
            w, x2, bias if bias is not None else w, out, m, e, k, x2.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_E=be, BLOCK_K=64, num_warps=4)
        return out
    block_e = 2 if x.is_cuda else triton.next_power_of_2(e)
    block_k = 512 if x.is_cuda else triton.next_power_of_2(k)
    _router_kernel[(triton.cdiv(e, block_e), m)](
        w, x2, bias if bias is not None else w, out, e, k, x2.stride(0),
        HAS_BIAS=bias is not None, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        **pdl.opts(out, use_pdl))
    return out


def router_ref(w, x, bias=None, out=None, use_pdl=True):
    y = x.reshape(-1, w.shape[1]).float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y if out is None else out.copy_(y)


@triton.jit
def _route_kernel(l_ptr, sb_ptr, ids_ptr, w_ptr, E, scale, GATING: tl.constexpr,
                  KU: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, HAS_SB: tl.constexpr,
                  BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    m = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    logit = tl.load(l_ptr + m * E + e, mask=emask, other=-float("inf"))
    if GATING == 0:  # softmax over all experts; select and weigh by probability
        p = tl.exp(logit - tl.max(logit, axis=0))
        val = p / tl.sum(p, axis=0)
        sel = val
    elif GATING == 1:  # select by logit, softmax over the chosen k below
        val = logit
        sel = logit
    else:  # sigmoid; select by sigmoid + bias, weigh by the sigmoid
        val = 1.0 / (1.0 + tl.exp(-logit))
        sel = val
        if HAS_SB:
            sel = val + tl.load(sb_ptr + e, mask=emask, other=0.0)
    sel = tl.where(emask, sel, -float("inf"))
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    wts = tl.zeros([KP], dtype=tl.float32)
    for i in tl.static_range(KU):
        best = tl.max(sel, axis=0)
        pick = tl.min(tl.where(sel == best, e, BLOCK_E), axis=0)
        pick = tl.minimum(pick, E - 1)  # NaN logits: some valid id all the same
        ids = tl.where(j == i, pick, ids)
        wts = tl.where(j == i, tl.sum(tl.where(e == pick, val, 0.0), axis=0), wts)
        sel = tl.where(e == pick, -float("inf"), sel)
    kmask = j < KU
    if GATING == 1:
        z = tl.where(kmask, tl.exp(wts - tl.max(tl.where(kmask, wts, -float("inf")), axis=0)),
                     0.0)
        wts = z / tl.sum(z, axis=0)
    if NORM:
        wts = wts / tl.maximum(tl.sum(tl.where(kmask, wts, 0.0), axis=0), 6.103515625e-5)
    wts = wts * scale
    tl.store(ids_ptr + m * KU + j, ids, mask=kmask)
    tl.store(w_ptr + m * KU + j, wts, mask=kmask)


def route(logits: torch.Tensor, k: int, gating: str, norm: bool = False, scale: float = 1.0,
          sel_bias: torch.Tensor | None = None, ids: torch.Tensor | None = None,
          weights: torch.Tensor | None = None,
          use_pdl: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each row of ``logits`` [M, E]: (ids [M, k] int32, weights [M, k]
    float32) by the ``gating`` rule, then ``norm`` and ``scale``; ``sel_bias`` [E]: glm4moe's
    selection bias (sigmoid gating only). One program per row; nothing leaves the device."""
    m, e = logits.shape
    if gating not in GATINGS:
        raise ValueError(f"unknown expert gating {gating!r}")
    ids = torch.empty(m, k, dtype=torch.int32, device=logits.device) if ids is None else ids
    weights = (torch.empty(m, k, dtype=torch.float32, device=logits.device)
               if weights is None else weights)
    _route_kernel[(m,)](logits, sel_bias if sel_bias is not None else logits, ids, weights, e,
                        float(scale), GATING=GATINGS[gating], KU=k,
                        KP=triton.next_power_of_2(k), NORM=norm, HAS_SB=sel_bias is not None,
                        BLOCK_E=triton.next_power_of_2(e), num_warps=1,
                        **pdl.opts(weights, use_pdl))
    return ids, weights


def route_ref(logits, k, gating, norm=False, scale=1.0, sel_bias=None, ids=None, weights=None,
              use_pdl=True):
    lg = logits.float()
    if gating == "softmax":
        val = torch.softmax(lg, dim=-1)
        sel = val
    elif gating == "softmax_topk":
        val = sel = lg
    else:
        val = torch.sigmoid(lg)
        sel = val + sel_bias.float() if sel_bias is not None else val
    # ties to the lower id: a stable sort of the negated scores
    top = torch.sort(-sel, dim=-1, stable=True).indices[:, :k]
    w = val.gather(-1, top)
    if gating == "softmax_topk":
        w = torch.softmax(w, dim=-1)
    if norm:
        w = w / w.sum(-1, keepdim=True).clamp_min(NORM_MIN)
    w = w * scale
    top = top.to(torch.int32)
    if ids is not None:
        ids.copy_(top)
        weights.copy_(w)
        return ids, weights
    return top, w


# --- decode: the routed experts' GEMVs ------------------------------------------------------
@triton.jit
def _act(g, u, ACT: tl.constexpr, limit):
    if ACT == 2:  # gpt-oss: gate clamped above, up clamped both ways, (up + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-1.702 * g)) * (u + 1.0)
    return glu_act(g, u, ACT == 1)


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


_ACTS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}
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


def expert_rows(w: torch.Tensor, n_expert: int) -> int:
    """Rows of one expert of a 3-D expert tensor held as [experts * rows, row_bytes]."""
    if w.shape[0] % n_expert:
        raise ValueError(f"{w.shape[0]} rows are not {n_expert} experts")
    return w.shape[0] // n_expert


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


def _act_ref(g, u, act, limit):
    if act == "swiglu_oai":
        g = g.clamp(max=limit)
        u = u.clamp(-limit, limit)
        return g * torch.sigmoid(OAI_ALPHA * g) * (u + 1)
    return (torch.nn.functional.gelu(g, approximate="tanh") if act == "gelu"
            else torch.nn.functional.silu(g)) * u


def _expert_ref(w, t, n_expert, e):
    n = expert_rows(w, n_expert)
    return dequantize_ref(w[e * n:(e + 1) * n], t, torch.float32)


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


# --- prefill: routed rows sorted by expert, one GEMM per expert -----------------------------
SORT_BLOCK = 128  # routed rows per program of the sort (at least k: see sort_routes)


@triton.jit
def _sort_count_kernel(ids_ptr, cnt_ptr, A, E, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr):
    # one program per BLOCK_A routed rows: how many of them each expert holds
    b = tl.program_id(0)
    a = b * BLOCK_A + tl.arange(0, BLOCK_A)
    e = tl.arange(0, BLOCK_E)
    ex = tl.load(ids_ptr + a, mask=a < A, other=-1)
    counts = tl.sum((ex[:, None] == e[None, :]).to(tl.int32), axis=0)
    tl.store(cnt_ptr + b * E + e, counts, mask=e < E)


@triton.jit
def _sort_place_kernel(ids_ptr, cnt_ptr, rows_ptr, pos_ptr, tiles_ptr, A, E, T, NB,
                       TILE: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_T: tl.constexpr):
    # the same BLOCK_A rows: each expert's start (the counts of all blocks) plus the rows of
    # that expert in the blocks before this one; program 0 also writes the tiles
    b = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    em = e < E
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    before = tl.zeros([BLOCK_E], dtype=tl.int32)
    for i in range(NB):
        c = tl.load(cnt_ptr + i * E + e, mask=em, other=0)
        counts += c
        before += tl.where(i < b, c, 0)
    start = tl.cumsum(counts, axis=0) - counts  # each expert's first sorted row
    if b == 0:
        nt = (counts + TILE - 1) // TILE
        tend = tl.cumsum(nt, axis=0)
        tstart = tend - nt  # each expert's first tile
        # tile t belongs to the expert whose tiles [tstart, tend) hold it; past the last: -1
        for t0 in range(0, T, BLOCK_T):
            t = t0 + tl.arange(0, BLOCK_T)
            ex = tl.sum((tend[None, :] <= t[:, None]).to(tl.int32), axis=1)
            sel = e[None, :] == ex[:, None]
            r0 = (tl.sum(tl.where(sel, start[None, :], 0), axis=1)
                  + (t - tl.sum(tl.where(sel, tstart[None, :], 0), axis=1)) * TILE)
            r1 = tl.minimum(r0 + TILE,
                            tl.sum(tl.where(sel, (start + counts)[None, :], 0), axis=1))
            tm = t < T
            tl.store(tiles_ptr + t, tl.where(ex < E, ex, -1), mask=tm)
            tl.store(tiles_ptr + T + t, r0, mask=tm)
            tl.store(tiles_ptr + 2 * T + t, r1, mask=tm)
    # each routed row's place: its expert's start + the rows of that expert before it
    a = b * BLOCK_A + tl.arange(0, BLOCK_A)
    am = a < A
    oh = (tl.load(ids_ptr + a, mask=am, other=-1)[:, None] == e[None, :]).to(tl.int32)
    place = tl.cumsum(oh, axis=0) - 1 + (start + before)[None, :]
    pos = tl.sum(oh * place, axis=1)
    tl.store(pos_ptr + a, pos, mask=am)
    tl.store(rows_ptr + pos, a, mask=am)


def sort_routes(ids: torch.Tensor, n_expert: int, rows: torch.Tensor, pos: torch.Tensor,
                tiles: torch.Tensor, scratch: torch.Tensor | None = None) -> None:
    """Group the routed rows (``ids`` [M, k]: row a = m * k + j) by expert, on the device:
    ``rows[s]`` the routed row at sorted place s (experts in order, rows in order within one),
    ``pos[a]`` the place of routed row a, ``tiles`` [3, T] (T = spec.launch.moe_tiles) each
    tile's expert (-1: unused), first and end sorted place; tiles hold one expert's rows.
    Two launches of one program per SORT_BLOCK routed rows (a count, then the places), the
    counts in ``scratch`` (int32, at least M * n_expert: the router's logits, read by then,
    hold them in the runner)."""
    a = ids.numel()
    t = tiles.shape[1]
    if t < moe_tiles(a, n_expert):
        raise ValueError(f"{t} tiles cannot hold {a} routed rows of {n_expert} experts")
    block = SORT_BLOCK if ids.is_cuda else 64
    nb = triton.cdiv(a, block)
    if scratch is None:
        scratch = torch.empty(nb * n_expert, dtype=torch.int32, device=ids.device)
    if scratch.dtype != torch.int32 or scratch.numel() < nb * n_expert:
        raise ValueError(f"the sort needs {nb * n_expert} int32 of scratch")
    be = triton.next_power_of_2(n_expert)
    _sort_count_kernel[(nb,)](ids, scratch, a, n_expert, BLOCK_A=block, BLOCK_E=be,
                              num_warps=4)
    _sort_place_kernel[(nb,)](ids, scratch, rows, pos, tiles, a, n_expert, t, nb,
                              TILE=MOE_TILE_ROWS, BLOCK_A=block, BLOCK_E=be, BLOCK_T=64,
                              num_warps=4)


def sort_routes_ref(ids, n_expert, rows, pos, tiles, scratch=None):
    flat = ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    rows.copy_(order.to(torch.int32))
    pos[order] = torch.arange(flat.numel(), dtype=torch.int32, device=ids.device)
    counts = torch.bincount(flat, minlength=n_expert)
    start = torch.cumsum(counts, 0) - counts
    recs = [(e, int(start[e]) + s, min(int(start[e]) + s + MOE_TILE_ROWS,
                                       int(start[e] + counts[e])))
            for e in range(n_expert) for s in range(0, int(counts[e]), MOE_TILE_ROWS)]
    tiles.copy_(torch.tensor([[-1, 0, 0]] * tiles.shape[1], dtype=torch.int32).T)
    tiles[:, :len(recs)] = torch.tensor(recs, dtype=torch.int32).T
    tiles[1:, len(recs):] = -1  # places of unused tiles: nothing reads them
    return rows, pos, tiles


@triton.jit
def _tile_dot(acc, w_ptr, wh_ptr, g_ptr, n_c, xrows, rm, K, row_bytes, TYPE: tl.constexpr,
              BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr, L: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
              DOT_F32: tl.constexpr):
    # acc [M, N] += x[rows, :] @ W[n_c, :]^T, W's blocks dequantized part by part into
    # registers: each part is [N, B, L] values and the element index of each lane
    nblk = K // BS
    lane = tl.arange(0, L)
    tb = tl.arange(0, BLOCK_B)
    row_base = n_c.to(tl.int64)[:, None, None] * row_bytes
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bm = blk < nblk
        base = row_base + tl.minimum(blk, nblk - 1)[None, :, None] * TS
        for p in tl.static_range(NPART):
            v, el = dequant_part(w_ptr, wh_ptr, base, lane, TYPE, p, False, g_ptr)
            cols = blk[:, None] * BS + el[None, :]  # [B, L]
            xv = tl.load(xrows[:, None, None] + cols[None, :, :],
                         mask=rm[:, None, None] & bm[None, :, None], other=0.0)
            xa = tl.reshape(xv, (BLOCK_M, BLOCK_B * L))
            wt = tl.trans(tl.reshape(v, (BLOCK_N, BLOCK_B * L)))
            if DOT_F32:
                acc = tl.dot(xa.to(tl.float32), wt, acc, input_precision="ieee")
            else:
                acc = tl.dot(xa, wt.to(xa.dtype), acc)
    return acc


@triton.jit
def _grouped_glu_kernel(g_ptr, gh_ptr, gg_ptr, u_ptr, uh_ptr, ug_ptr, gb_ptr, ub_ptr, x_ptr, rows_ptr,
                        tiles_ptr, h_ptr, N, K, g_rb, u_rb, stride_xm, T, limit,
                        KU: tl.constexpr, HAS_BIAS: tl.constexpr, ACT: tl.constexpr,
                        TG: tl.constexpr, BSG: tl.constexpr, TSG: tl.constexpr,
                        NPG: tl.constexpr, LG: tl.constexpr, BBG: tl.constexpr,
                        TU: tl.constexpr, BSU: tl.constexpr, TSU: tl.constexpr,
                        NPU: tl.constexpr, LU: tl.constexpr, BBU: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr):
    t = tl.program_id(0)
    ex = tl.load(tiles_ptr + t)
    if ex >= 0:  # tiles past the chunk's last do nothing
        r = tl.load(tiles_ptr + T + t) + tl.arange(0, BLOCK_M)
        rm = r < tl.load(tiles_ptr + 2 * T + t)
        tok = tl.load(rows_ptr + r, mask=rm, other=0) // KU  # the token of each routed row
        xrows = x_ptr + tok.to(tl.int64) * stride_xm
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_c = ex * N + tl.minimum(n, N - 1)
        g = _tile_dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), g_ptr, gh_ptr, gg_ptr, n_c,
                      xrows, rm, K, g_rb, TG, BSG, TSG, NPG, LG, BLOCK_M, BLOCK_N, BBG,
                      DOT_F32)
        u = _tile_dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), u_ptr, uh_ptr, ug_ptr, n_c,
                      xrows, rm, K, u_rb, TU, BSU, TSU, NPU, LU, BLOCK_M, BLOCK_N, BBU,
                      DOT_F32)
        if HAS_BIAS:
            g += tl.load(gb_ptr + n_c).to(tl.float32)[None, :]
            u += tl.load(ub_ptr + n_c).to(tl.float32)[None, :]
        h = _act(g, u, ACT, limit)
        tl.store(h_ptr + r.to(tl.int64)[:, None] * N + n[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=rm[:, None] & (n < N)[None, :])


def _gemm_meta(w: torch.Tensor, t: int, tag: str) -> tuple[tuple, dict]:
    p = plan(t)
    # bytes, 16-bit view, and the IQ types' value table (the weight itself for other types)
    _, wh, table = _launch_args(w, t, x_dtype=torch.float32)[0]
    return (w, wh, table), {f"T{tag}": t, f"BS{tag}": p.block, f"TS{tag}": p.nbytes,
                     f"NP{tag}": p.parts, f"L{tag}": p.lanes,
                     f"BB{tag}": max(1, 64 // p.block)}  # 16-64 values per tl.dot step


# prefill's grouped GEMM tile on a GPU: (columns per program, warps); a program's rows are one
# tile of MOE_TILE_ROWS sorted rows. `python -m benchmarks.device_check --moe` sweeps it
GROUPED_CONFIG = (64, 4)


def _grouped_tile(n: int, on_gpu: bool, config: tuple[int, int] | None) -> tuple[int, int]:
    if config is not None:
        return config
    return GROUPED_CONFIG if on_gpu else (max(16, min(256, triton.next_power_of_2(n))), 4)


def grouped_glu(gate: torch.Tensor, gate_type: int, up: torch.Tensor, up_type: int,
                n_expert: int, x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                tiles: torch.Tensor, out: torch.Tensor, act: str = "silu",
                gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                limit: float = 0.0, config: tuple[int, int] | None = None) -> torch.Tensor:
    """Prefill's routed gate/up over the rows ``sort_routes`` grouped: ``out[s] = act(x[m] @
    gate_e^T) * (x[m] @ up_e^T)`` for the routed row a = rows[s] = m * k + j of expert e; one
    launch, a program per (tile, column block). ``config``: (columns per program, warps)."""
    n, k = expert_rows(gate, n_expert), row_cols(gate, gate_type)
    m, ku = ids.shape
    x2 = x.reshape(m, k)
    gp, gmeta = _gemm_meta(gate, gate_type, "G")
    upp, umeta = _gemm_meta(up, up_type, "U")
    bn, warps = _grouped_tile(n, x.is_cuda, config)
    t = tiles.shape[1]
    _grouped_glu_kernel[(t, triton.cdiv(n, bn))](
        *gp, *upp, gate_bias if gate_bias is not None else x2,
        up_bias if up_bias is not None else x2, x2, rows, tiles, out, n, k, gate.shape[1],
        up.shape[1], x2.stride(0), t, float(limit), KU=ku, HAS_BIAS=gate_bias is not None,
        ACT=_ACTS[act], **gmeta, **umeta, BLOCK_M=MOE_TILE_ROWS, BLOCK_N=bn,
        DOT_F32=x.dtype == torch.float32, num_warps=warps)
    return out


def grouped_glu_ref(gate, gate_type, up, up_type, n_expert, x, ids, rows, tiles, out,
                    act="silu", gate_bias=None, up_bias=None, limit=0.0, config=None):
    m, ku = ids.shape
    h = torch.empty(m * ku, expert_rows(gate, n_expert), dtype=out.dtype, device=out.device)
    expert_glu_ref(gate, gate_type, up, up_type, n_expert, x, ids, h, act, gate_bias, up_bias,
                   limit)
    out[:m * ku] = h[rows[:m * ku].long()]
    return out


@triton.jit
def _grouped_down_kernel(w_ptr, wh_ptr, wg_ptr, b_ptr, h_ptr, tiles_ptr, y_ptr, N, K, row_bytes, T,
                         HAS_BIAS: tl.constexpr, TD: tl.constexpr, BSD: tl.constexpr,
                         TSD: tl.constexpr, NPD: tl.constexpr, LD: tl.constexpr,
                         BBD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         DOT_F32: tl.constexpr):
    t = tl.program_id(0)
    ex = tl.load(tiles_ptr + t)
    if ex >= 0:
        r = tl.load(tiles_ptr + T + t) + tl.arange(0, BLOCK_M)
        rm = r < tl.load(tiles_ptr + 2 * T + t)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_c = ex * N + tl.minimum(n, N - 1)
        y = _tile_dot(tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), w_ptr, wh_ptr, wg_ptr, n_c,
                      h_ptr + r.to(tl.int64) * K, rm, K, row_bytes, TD, BSD, TSD, NPD, LD,
                      BLOCK_M, BLOCK_N, BBD, DOT_F32)
        if HAS_BIAS:
            y += tl.load(b_ptr + n_c).to(tl.float32)[None, :]
        tl.store(y_ptr + r.to(tl.int64)[:, None] * N + n[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=rm[:, None] & (n < N)[None, :])


def grouped_down(down: torch.Tensor, ggml_type: int, n_expert: int, h: torch.Tensor,
                 tiles: torch.Tensor, out: torch.Tensor,
                 bias: torch.Tensor | None = None,
                 config: tuple[int, int] | None = None) -> torch.Tensor:
    """Prefill's routed down projection, row by sorted row: ``out[s] = h[s] @ down_e^T (+
    bias_e)`` for the expert e of the tile holding s (weights applied by ``combine``);
    ``config`` as in ``grouped_glu``."""
    n, k = expert_rows(down, n_expert), row_cols(down, ggml_type)
    ptrs, meta = _gemm_meta(down, ggml_type, "D")
    bn, warps = _grouped_tile(n, h.is_cuda, config)
    t = tiles.shape[1]
    _grouped_down_kernel[(t, triton.cdiv(n, bn))](
        *ptrs, bias if bias is not None else h, h, tiles, out, n, k, down.shape[1], t,
        HAS_BIAS=bias is not None, **meta, BLOCK_M=MOE_TILE_ROWS, BLOCK_N=bn,
        DOT_F32=h.dtype == torch.float32, num_warps=warps)
    return out


def grouped_down_ref(down, ggml_type, n_expert, h, tiles, out, bias=None, config=None):
    n = expert_rows(down, n_expert)
    for i in range(tiles.shape[1]):
        e = int(tiles[0, i])
        if e < 0:
            continue
        r0, r1 = int(tiles[1, i]), int(tiles[2, i])
        y = h[r0:r1].float() @ _expert_ref(down, ggml_type, n_expert, e).T
        if bias is not None:
            y = y + bias[e * n:(e + 1) * n].float()
        out[r0:r1] = y.to(out.dtype)
    return out


@triton.jit
def _combine_kernel(y_rows_ptr, pos_ptr, rw_ptr, out_ptr, C, stride_om, KU: tl.constexpr,
                    ACCUM: tl.constexpr, IDENT: tl.constexpr, BLOCK_C: tl.constexpr):
    m = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KU):  # in order, as the decode kernel sums
        if IDENT:  # the rows in routed order (decode's split down)
            s = (m * KU + j).to(tl.int64)
        else:
            s = tl.load(pos_ptr + m * KU + j).to(tl.int64)
        acc += tl.load(rw_ptr + m * KU + j) * tl.load(y_rows_ptr + s * C + c, mask=cm,
                                                      other=0.0).to(tl.float32)
    op = out_ptr + m.to(tl.int64) * stride_om + c
    if ACCUM:
        acc += tl.load(op, mask=cm, other=0.0).to(tl.float32)
    tl.store(op, acc.to(out_ptr.dtype.element_ty), mask=cm)


def combine(y_rows: torch.Tensor, pos: torch.Tensor | None, weights: torch.Tensor,
            out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """``out[m] (+)= sum_j weights[m, j] * y_rows[pos[m * k + j]]``: the routed rows back to
    their tokens, weighted, summed in order of j (``pos`` None: row m * k + j itself)."""
    m, ku = weights.shape
    c = out.shape[-1]
    bc = 256 if out.is_cuda else triton.next_power_of_2(c)
    _combine_kernel[(m, triton.cdiv(c, bc))](y_rows, weights if pos is None else pos, weights,
                                            out, c, out.stride(0), KU=ku, ACCUM=accumulate,
                                            IDENT=pos is None, BLOCK_C=bc, num_warps=4)
    return out


def combine_ref(y_rows, pos, weights, out, accumulate=False):
    m, ku = weights.shape
    y = (y_rows[:m * ku] if pos is None else y_rows[pos[:m * ku].long()]).float().view(m, ku, -1)
    s = (weights.float()[:, :, None] * y).sum(1)
    out.copy_((out.float() + s if accumulate else s).to(out.dtype))
    return out

"""Mixture-of-experts kernels: the router, the top-k routing, the expert GEMVs of decode and the
grouped GEMMs of prefill, each beside its plain-torch twin (``*_ref``, same signature).

An expert tensor is its GGUF bytes: a 3-D GGUF tensor ``[ne0 = cols, ne1 = rows, ne2 =
experts]`` whose expert e is a contiguous slice, held as uint8 ``[experts * rows, row_bytes]``
(global row ``e * rows + r`` is expert e's row r). Expert ids and weights stay on the device:
decode reads them inside its kernels (so the step stays one captured graph, no host sync), and
prefill sorts the routed rows by expert on the device too. This module holds the router, the
routing, ``combine`` and what the expert kernels share; carve_kernels/moe_decode.py the expert GEMVs
of decode, carve_kernels/moe_prefill.py the sort and the grouped GEMMs of prefill.

    router(w, x, bias, out)                 # logits [M, E] = x @ w^T (+ bias), float32
    route(logits, k, gating, ...)           # ids [M, k] int32, weights [M, k] float32
    moe_decode.expert_glu(gate, up, types, x, ids)  # decode: h[m*k + j] = act(g) * u of expert ids[m, j]
    moe_decode.expert_down(down, type, h, ids, w, out)  # decode: out[m] (+)= sum_j w[m, j] down_ids[m,j](h)
    moe_prefill.sort_routes(ids, n_expert, rows, pos, tiles)  # prefill: routed rows grouped by expert
    moe_prefill.grouped_glu(...), grouped_down(...)  # prefill: one GEMM per expert over its rows
    combine(out_rows, pos, weights, out)    # prefill: out[m] (+)= sum_j w[m, j] out_rows[pos]

Gating (engine.gguf.hparams.HParams.expert_gating): "softmax" (qwen3moe: softmax over every
expert, top-k of the probabilities), "softmax_topk" (gpt-oss: top-k of the logits, softmax over
those k), "sigmoid" (glm4moe: top-k of sigmoid + the selection bias, the weights are the plain
sigmoids). Then, optionally, the k weights divided by their sum (at least 2^-14, as llama.cpp
clamps it) and multiplied by a scale. Ties pick the lower expert id.

The decode down kernel sums a row's k experts in order inside one program (no atomics): the
output bits do not depend on launch order, so a split over stages gives the same greedy ids.
Prefill's grouped GEMMs dequantize the expert's blocks into registers tile by tile and
multiply with ``tl.dot``: no dequantized copy of any expert exists anywhere
(carve_kernels/NOTES.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace
from carve_kernels.glu import glu_act
from carve_kernels.norm import rmsnorm_ref, row_warps
from carve_kernels.quant_matmul import dequantize_ref

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
                      BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr):
    # prefill: a tile of rows times a tile of experts, so that the router's weights are read
    # once per BLOCK_M rows, not once per row. PRECISION "tf32x3": three tensor-core products of
    # each operand's tf32 high part and remainder, float32's accuracy (a single tf32 rounding
    # could change which experts a near tie picks); "ieee" under the interpreter
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ex = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    rm, em = rows < M, ex < E
    acc = tl.zeros([BLOCK_M, BLOCK_E], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        c = k0 + tl.arange(0, BLOCK_K)
        cm = c < K
        x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + c[None, :],
                    mask=rm[:, None] & cm[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ex.to(tl.int64)[:, None] * K + c[None, :],
                    mask=em[:, None] & cm[None, :], other=0.0)  # rows of w, read along K
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + ex, mask=em, other=0.0)[None, :]
    tl.store(y_ptr + rows.to(tl.int64)[:, None] * E + ex[None, :], acc,
             mask=rm[:, None] & em[None, :])


# prefill's router tile on a GPU: (rows, experts, columns a step, warps)
ROUTER_MM_CONFIG = (16, 32, 128, 4)


ROUTER_GEMV_ROWS = 8  # up to this many rows the router runs as a GEMV (decode)


def router(w: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None = None,
           out: torch.Tensor | None = None, use_pdl: bool = True) -> torch.Tensor:
    """Router logits [M, E] float32 = x [M, K] @ w^T (+ bias); ``w`` float32 [E, K] (the file
    keeps routers in F32). Up to ROUTER_GEMV_ROWS rows a GEMV, else a tiled float32 GEMM.
    The route runs as a launch of its own (``route``): the router's last program routing the
    row was measured twice and lost both times (carve_kernels/NOTES.md, Tried and rejected)."""
    e, k = w.shape
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    out = torch.empty(m, e, dtype=torch.float32, device=x.device) if out is None else out
    if m > ROUTER_GEMV_ROWS:
        if x.is_cuda:
            bm, be, bk, warps = ROUTER_MM_CONFIG
            precision = "tf32x3"
        else:
            bm, be, bk, warps = 16, max(16, triton.next_power_of_2(e)), 64, 4
            precision = "ieee"
        _router_mm_kernel[(triton.cdiv(e, be), triton.cdiv(m, bm))](
            w, x2, bias if bias is not None else w, out, m, e, k, x2.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_E=be, BLOCK_K=bk, PRECISION=precision,
            num_warps=warps)
        return out
    # a program per expert over the whole row (up to 4096 columns a step: one round trip to
    # memory): H200 tg128 Qwen3-30B-A3B 412.1 against 409.1 t/s, gpt-oss-20b 456.4 against
    # 449.9 with 2 experts in steps of 512 (one call, 2026-12-04); 2 experts over the row 411.5
    # and 450.4
    block_e = 1 if x.is_cuda else triton.next_power_of_2(e)
    block_k = min(4096, triton.next_power_of_2(k))
    _router_kernel[(triton.cdiv(e, block_e), m)](
        w, x2, bias if bias is not None else w, out, e, k, x2.stride(0),
        HAS_BIAS=bias is not None, BLOCK_E=block_e, BLOCK_K=block_k, num_warps=4,
        **pdl.opts(out, use_pdl))
    return out


@triton.jit
def _norm_router_kernel(x_ptr, res_ptr, nw_ptr, w_ptr, b_ptr, y_ptr, q_ptr, d_ptr, s_ptr,
                        l_ptr, cnt_ptr, E, H, eps, trace_ptr, HAS_BIAS: tl.constexpr,
                        Q8: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                        TRACE: tl.constexpr):
    # a program per expert: the fused add-and-norm of one row (as norm._rmsnorm_kernel), each
    # program on its own copy, then the expert's logit of the stored normed row (as the
    # router's GEMV reads it). Program 0 writes the normed row and its int8 copy; the residual
    # stream is written back by the last program to finish (a counter, left zero), after
    # every program has read it
    e = tl.program_id(0)
    c = tl.arange(0, BLOCK)
    mask = c < H
    # the norm's and the router's weights are no kernel's output: read them before the wait
    nw = tl.load(nw_ptr + c, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + e.to(tl.int64) * H + c, mask=mask, other=0.0).to(tl.float32)
    trace.wait(trace_ptr, PDL, TRACE)
    h = tl.load(x_ptr + c, mask=mask, other=0.0).to(tl.float32)
    h += tl.load(res_ptr + c, mask=mask, other=0.0).to(tl.float32)
    hs = h.to(res_ptr.dtype.element_ty)  # the stream as stored
    h = hs.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / H + eps)
    y = h * inv * nw
    ys = y.to(y_ptr.dtype.element_ty)
    logit = tl.sum(w * ys.to(tl.float32), axis=0)
    if HAS_BIAS:
        logit += tl.load(b_ptr + e)
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(l_ptr + e, logit)
    if e == 0:
        tl.store(y_ptr + c, ys, mask=mask)
        if Q8:
            q8x.store_q8(y, 0, H, q_ptr, d_ptr, s_ptr, BLOCK)
    tl.debug_barrier()  # every thread's reads of the stream done before the counter
    if tl.atomic_add(cnt_ptr, 1) == E - 1:
        tl.store(res_ptr + c, hs, mask=mask)
        tl.atomic_xchg(cnt_ptr, 0)  # zero again for the next call
    trace.stamp(trace_ptr, 3, TRACE)


def norm_router(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                w: torch.Tensor, bias: torch.Tensor | None, normed: torch.Tensor,
                logits: torch.Tensor, counter: torch.Tensor, q8=None,
                use_pdl: bool = True) -> torch.Tensor:
    """Decode's FFN norm and the router in one launch, for one row: ``residual += x``, then
    ``normed = rmsnorm(residual) * norm_w`` (and its int8 copy into ``q8``: (q, d, s), as
    norm.rmsnorm writes them) and ``logits = normed @ w^T (+ bias)`` (float32 [1, E]),
    the same values as norm.rmsnorm then ``router``. ``counter``: one int32 zero (left zero)."""
    h = x.shape[-1]
    e = w.shape[0]
    if (x.numel() != h or residual.numel() != h or normed.numel() != h or w.shape[1] != h
            or logits.numel() < e or not w.is_contiguous()):
        raise ValueError(f"norm_router takes one row of {h}: x, residual, normed, logits [1, "
                         f"{e}] and a contiguous router of {h} columns")
    if counter.dtype != torch.int32 or counter.numel() < 1:
        raise ValueError("norm_router: counter must be an int32 zero")
    block = triton.next_power_of_2(h)
    if q8 is not None and (h % 32 or not q8x.fits(q8, h)):
        raise ValueError(f"no int8 copy of a row of {h} in these buffers")
    q, d, s = q8 if q8 is not None else (normed, normed, normed)
    _norm_router_kernel[(e,)](x, residual, norm_w, w, bias if bias is not None else w, normed,
                              q, d, s, logits, counter, e, h, eps,
                              **trace.args("norm_router", (e,), logits),
                              HAS_BIAS=bias is not None, Q8=q8 is not None, BLOCK=block,
                              num_warps=row_warps(block), **pdl.opts(logits, use_pdl))
    return logits


def norm_router_ref(x, residual, norm_w, eps, w, bias, normed, logits, counter, q8=None,
                    use_pdl=True):
    rmsnorm_ref(x.view(1, -1), norm_w, eps, residual=residual.view(1, -1),
                out=normed.view(1, -1))
    return router_ref(w, normed, bias, out=logits.view(1, -1))


def router_ref(w, x, bias=None, out=None, use_pdl=True):
    y = x.reshape(-1, w.shape[1]).float() @ w.float().T
    if bias is not None:
        y = y + bias.float()
    return y if out is None else out.copy_(y)


@triton.jit
def _route_kernel(l_ptr, sb_ptr, ids_ptr, w_ptr, E, scale, trace_ptr, GATING: tl.constexpr,
                  KU: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, HAS_SB: tl.constexpr,
                  BLOCK_E: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr,
                  NGU: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    trace.wait(trace_ptr, PDL, TRACE)
    m = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    logit = tl.load(l_ptr + m * E + e, mask=emask, other=-float("inf"))
    if GATING == 0:  # softmax over all experts; select (+ bias) and weigh by probability
        p = tl.exp(logit - tl.max(logit, axis=0))
        val = p / tl.sum(p, axis=0)
        sel = val
        if HAS_SB:
            sel = val + tl.load(sb_ptr + e, mask=emask, other=0.0)
    elif GATING == 1:  # select by logit, softmax over the chosen k below
        val = logit
        sel = logit
    else:  # sigmoid; select by sigmoid + bias, weigh by the sigmoid
        val = 1.0 / (1.0 + tl.exp(-logit))
        sel = val
        if HAS_SB:
            sel = val + tl.load(sb_ptr + e, mask=emask, other=0.0)
    sel = tl.where(emask, sel, -float("inf"))
    if NG > 1:  # DeepSeek-V3: only among the NGU groups whose two best scores sum highest
        gs = E // NG
        grp = e // gs
        gi = tl.arange(0, NGP)
        gscore = tl.full([NGP], -float("inf"), dtype=tl.float32)
        for g in tl.static_range(NG):
            s_g = tl.where(grp == g, sel, -float("inf"))
            b1 = tl.max(s_g, axis=0)
            p1 = tl.min(tl.where(s_g == b1, e, BLOCK_E), axis=0)
            b2 = tl.max(tl.where(e == p1, -float("inf"), s_g), axis=0)
            two = tl.where(gs > 1, b1 + b2, b1)
            gscore = tl.where(gi == g, two, gscore)
        keep = tl.zeros([BLOCK_E], dtype=tl.int32)
        for _ in tl.static_range(NGU):
            best = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == best, gi, NGP), axis=0)
            keep = tl.where(grp == pick, 1, keep)
            gscore = tl.where(gi == pick, -float("inf"), gscore)
        sel = tl.where(keep != 0, sel, -float("inf"))
    j = tl.arange(0, KP)
    ids = tl.zeros([KP], dtype=tl.int32)
    wts = tl.zeros([KP], dtype=tl.float32)
    for i in tl.static_range(KU):
        best = tl.max(sel, axis=0)
        pick = tl.min(tl.where(sel == best, e, BLOCK_E), axis=0)
        sel = tl.where(e == pick, -float("inf"), sel)
        pick = tl.minimum(pick, E - 1)  # NaN logits: some valid id all the same
        ids = tl.where(j == i, pick, ids)
        wts = tl.where(j == i, tl.sum(tl.where(e == pick, val, 0.0), axis=0), wts)
    kmask = j < KU
    if GATING == 1:
        z = tl.where(kmask, tl.exp(wts - tl.max(tl.where(kmask, wts, -float("inf")), axis=0)),
                     0.0)
        wts = z / tl.sum(z, axis=0)
    if NORM:
        wts = wts / tl.maximum(tl.sum(tl.where(kmask, wts, 0.0), axis=0), 6.103515625e-5)
    wts = wts * scale
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(ids_ptr + m * KU + j, ids, mask=kmask)
    tl.store(w_ptr + m * KU + j, wts, mask=kmask)
    trace.stamp(trace_ptr, 3, TRACE)


def route(logits: torch.Tensor, k: int, gating: str, norm: bool = False, scale: float = 1.0,
          sel_bias: torch.Tensor | None = None, ids: torch.Tensor | None = None,
          weights: torch.Tensor | None = None, use_pdl: bool = True,
          groups: tuple[int, int] = (0, 0)) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k experts of each row of ``logits`` [M, E]: (ids [M, k] int32, weights [M, k]
    float32) by the ``gating`` rule, then ``norm`` and ``scale``; ``sel_bias`` [E]: the selection
    bias (glm4moe's with sigmoid gating, ERNIE-4.5's with softmax), added to the scores the
    experts are chosen by, never to their weights. ``groups`` (n_groups, n_used), n_groups > 1
    (DeepSeek-V3): the experts are n_groups equal groups, and each row chooses only among those
    of its n_used groups whose two best selection scores sum highest (ties to the lower
    group). One program per row; nothing leaves the device."""
    m, e = logits.shape
    if gating not in GATINGS:
        raise ValueError(f"unknown expert gating {gating!r}")
    ng, ngu = groups
    if not 0 < k <= e:
        raise ValueError(f"{e} experts cannot give {k} a row")
    if ng > 1 and (e % ng or not 0 < ngu <= ng or ngu * (e // ng) < k):
        raise ValueError(f"{e} experts in {ng} groups, {ngu} used, cannot give {k}")
    ids = torch.empty(m, k, dtype=torch.int32, device=logits.device) if ids is None else ids
    weights = (torch.empty(m, k, dtype=torch.float32, device=logits.device)
               if weights is None else weights)
    _route_kernel[(m,)](logits, sel_bias if sel_bias is not None else logits, ids, weights, e,
                        float(scale), **trace.args("route", (m,), weights),
                        GATING=GATINGS[gating], KU=k,
                        KP=triton.next_power_of_2(k), NORM=norm, HAS_SB=sel_bias is not None,
                        BLOCK_E=triton.next_power_of_2(e), NG=ng if ng > 1 else 1,
                        NGP=triton.next_power_of_2(max(ng, 1)), NGU=ngu if ng > 1 else 1,
                        num_warps=1, **pdl.opts(weights, use_pdl))
    return ids, weights


def route_ref(logits, k, gating, norm=False, scale=1.0, sel_bias=None, ids=None, weights=None,
              use_pdl=True, groups=(0, 0)):
    lg = logits.float()
    if gating == "softmax":
        val = torch.softmax(lg, dim=-1)
        sel = val + sel_bias.float() if sel_bias is not None else val
    elif gating == "softmax_topk":
        val = sel = lg
    else:
        val = torch.sigmoid(lg)
        sel = val + sel_bias.float() if sel_bias is not None else val
    ng, ngu = groups
    if ng > 1:  # each row's ngu groups of the best two-score sums (ties to the lower group)
        g = sel.view(sel.shape[0], ng, -1)
        score = g.topk(min(2, g.shape[-1]), dim=-1).values.sum(-1)
        best = torch.sort(-score, dim=-1, stable=True).indices[:, :ngu]
        keep = torch.zeros_like(score, dtype=torch.bool).scatter_(1, best, True)
        sel = g.masked_fill(~keep[..., None], float("-inf")).view(sel.shape)
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



# --- what the expert kernels share ---------------------------------------------------------
# --- decode: the routed experts' GEMVs ------------------------------------------------------
@triton.jit
def _act(g, u, ACT: tl.constexpr, limit):
    if ACT == 2:  # gpt-oss: gate clamped above, up clamped both ways, (up + 1)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return g / (1.0 + tl.exp(-1.702 * g)) * (u + 1.0)
    return glu_act(g, u, ACT == 1)


_ACTS = {"silu": 0, "gelu": 1, "swiglu_oai": 2}


def expert_rows(w: torch.Tensor, n_expert: int) -> int:
    """Rows of one expert of a 3-D expert tensor held as [experts * rows, row_bytes]."""
    if w.shape[0] % n_expert:
        raise ValueError(f"{w.shape[0]} rows are not {n_expert} experts")
    return w.shape[0] // n_expert


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



# --- prefill and host experts: each token's k rows, weighted, in order --------------------
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


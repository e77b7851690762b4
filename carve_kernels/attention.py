"""Attention over the KV cache: split-K decode (one query token) and flash-style causal prefill.

Both handle GQA (n_head = G * n_kv_heads), sliding windows (a key at position p is seen from
query position i when i - p < window, llama.cpp's rule) and f16 or q8_0 caches. A cache of
``cells`` cells is a ring: position p lives in cell p % cells (carve_kernels/kv_cache.py).

Decode reads the query position from a device tensor, so a CUDA graph captured once replays at
every depth: its grid covers all cells and splits past the current length exit at once.
Prefill takes the chunk's own keys/values from the projections (not the cache), so a ring
smaller than the chunk never overwrites a key that a query of the chunk still needs; the caller
stores them into the cache afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace
from carve_kernels.kv_cache import kv_load_ref
from spec.launch import ATTN_SPLITS

_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": masked scores use -inf, running maxima start here


@triton.jit
def _load_kv(c_ptr, c8_ptr, ch_ptr, cell, kvh, KVH, dd, cmask, D: tl.constexpr, Q8: tl.constexpr):
    # [BLOCK_N, D] of one kv head at cells ``cell`` as f16
    row = (cell.to(tl.int64) * KVH + kvh)[:, None]
    m = cmask[:, None]
    if Q8:
        # whole 34-byte blocks: one scale load per block, 32 contiguous quants, then [N, D]
        blk = row * (D // 32) + tl.arange(0, D // 32)[None, :]  # [N, D/32]
        j = tl.arange(0, 32)
        q = tl.load(c8_ptr + blk[:, :, None] * 34 + 2 + j[None, None, :], mask=m[:, :, None],
                    other=0).to(tl.float32)
        s = tl.load(ch_ptr + blk * 17, mask=m, other=0.0).to(tl.float32)
        return tl.reshape(q * s[:, :, None], [q.shape[0], D]).to(tl.float16)
    else:
        return tl.load(c_ptr + row * D + dd[None, :], mask=m, other=0.0).to(tl.float16)


@triton.jit
def _attend(q, k, v, c, cm, pos, n_pos, cells, window, m_i, l_i, acc):
    # one block of cells c (cm: in the split) into the running max m_i, sum l_i and acc
    # (prefill's online-softmax step, ``_online``, on the cells this query sees):
    # position held by cell c: c itself until the ring wraps, else the newest p = c mod cells
    p = tl.where(n_pos <= cells, c, pos - ((pos - c) % cells))
    ok = cm & ((window <= 0) | (pos - p < window))
    return _online(q, k, v, ok[None, :], m_i, l_i, acc)


@triton.jit(do_not_specialize=["cells", "window"])
def _decode_partial_kernel(q_ptr, c_k, c8_k, ch_k, c_v, c8_v, ch_v, pos_ptr, po_ptr, pml_ptr,
                           cnt_ptr, o_ptr, sink_ptr, oq_ptr, od_ptr, os_ptr, cells, window, scale,
                           KVH, NS, stride_qh, stride_oh, CNT_STRIDE, trace_ptr,
                           G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                           SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, Q8: tl.constexpr,
                           FUSED: tl.constexpr, NSP: tl.constexpr, MERGE: tl.constexpr,
                           SINK: tl.constexpr, OUT_Q8: tl.constexpr, PDL: tl.constexpr,
                           TRACE: tl.constexpr, LATE: tl.constexpr = 0):
    # the split's first block of cached keys and values is read before the PDL wait: the
    # position was advanced by the step before (its kernel long finished) and no cell but the
    # newest one is written this step (by the q/k/v launch before this one), so only the
    # newest cell is read after the wait (H100, tg128, 2026-12-05: Qwen2-7B 413.3 / 413.0
    # against 411.2 / 411.0 t/s, Qwen3-30B-A3B 424.3 / 424.4 against 420.3 / 420.8)
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    dd = tl.arange(0, D)
    pos = tl.load(pos_ptr).to(tl.int32)
    n_pos = pos + 1
    n_valid = tl.minimum(n_pos, cells)
    start = s * SPLIT
    end = tl.minimum(start + SPLIT, n_valid)
    c0 = start + tl.arange(0, BLOCK_N)
    cm0 = c0 < end
    newest = c0 == pos % cells
    k0 = _load_kv(c_k, c8_k, ch_k, c0, kvh, KVH, dd, cm0 & ~newest, D, Q8)
    v0 = _load_kv(c_v, c8_v, ch_v, c0, kvh, KVH, dd, cm0 & ~newest, D, Q8)
    trace.wait(trace_ptr, PDL, TRACE, LATE)
    gi = tl.arange(0, GP)
    gmask = gi < G
    heads = kvh * G + gi
    q = tl.load(q_ptr + heads[:, None] * stride_qh + dd[None, :], mask=gmask[:, None], other=0.0)
    q = (q.to(tl.float32) * scale).to(tl.float16)
    m_i = tl.full([GP], _NEG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    # the first block from what was read before the wait, its newest cell read now (an
    # inactive split's block is all masked: it leaves m, l and acc as they are)
    new = cm0 & newest
    k0 = tl.where(new[:, None], _load_kv(c_k, c8_k, ch_k, c0, kvh, KVH, dd, new, D, Q8), k0)
    v0 = tl.where(new[:, None], _load_kv(c_v, c8_v, ch_v, c0, kvh, KVH, dd, new, D, Q8), v0)
    m_i, l_i, acc = _attend(q, k0, v0, c0, cm0, pos, n_pos, cells, window, m_i, l_i, acc)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        c = n0 + tl.arange(0, BLOCK_N)
        cm = c < end
        k = _load_kv(c_k, c8_k, ch_k, c, kvh, KVH, dd, cm, D, Q8)
        v = _load_kv(c_v, c8_v, ch_v, c, kvh, KVH, dd, cm, D, Q8)
        m_i, l_i, acc = _attend(q, k, v, c, cm, pos, n_pos, cells, window, m_i, l_i, acc)
    # a split past the current length stores o = 0 and lse = -1e30 (weight 0 in the reduce)
    out = (heads.to(tl.int64) * NS + s)
    lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), _NEG)
    tl.store(po_ptr + out[:, None] * D + dd[None, :], acc / tl.maximum(l_i, 1e-30)[:, None],
             mask=gmask[:, None])
    tl.store(pml_ptr + out, lse, mask=gmask)
    if LATE == 1:  # the next kernel becomes resident once every split has stored its partial
        pdl.release(PDL)
    trace.stamp(trace_ptr, 2, TRACE)
    if FUSED:
        # the last of this kv head's NS programs to finish merges the active splits (no
        # reduce launch): the counter's acq_rel add orders the partials before it, and the
        # merger sets it back to 0 for the next layer. The add is one thread's: the barrier
        # puts every thread's partial stores before it (without one, the T-layout GEMV's
        # same pattern read sums that were still arriving on the H200)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + kvh * CNT_STRIDE, 1)
        if done == NS - 1:
            n_act = tl.cdiv(n_valid, SPLIT)
            row = heads.to(tl.int64) * NS
            si = tl.arange(0, NSP)
            lse_all = tl.load(pml_ptr + row[:, None] + si[None, :],
                              mask=gmask[:, None] & (si < n_act)[None, :], other=_NEG,
                              cache_modifier=".cg")
            mx = tl.max(lse_all, axis=1)
            num = tl.zeros([GP, D], tl.float32)
            den = tl.zeros([GP], tl.float32)
            # MERGE splits per step, their loads independent (issued together: one L2
            # round trip per step rather than per split)
            for s0 in range(0, n_act, MERGE):
                for j in tl.static_range(MERGE):
                    ok = gmask & (gi * 0 + s0 + j < n_act)
                    w = tl.exp(tl.load(pml_ptr + row + s0 + j, mask=ok, other=_NEG,
                                       cache_modifier=".cg") - mx)
                    o = tl.load(po_ptr + (row + s0 + j)[:, None] * D + dd[None, :],
                                mask=ok[:, None], other=0.0, cache_modifier=".cg")
                    num += o * w[:, None]
                    den += w
            if SINK:  # gpt-oss: one more logit per head, in the denominator only
                den += tl.exp(tl.load(sink_ptr + heads, mask=gmask, other=_NEG) - mx)
            o = num / den[:, None]
            tl.store(o_ptr + heads[:, None] * stride_oh + dd[None, :],
                     o.to(o_ptr.dtype.element_ty), mask=gmask[:, None])
            if OUT_Q8:  # the output row's int8 copy (attn_output's x): its G heads are
                # G * D consecutive values from head kvh * G, whole groups of 32
                q8x.store_q8(tl.reshape(o.to(o_ptr.dtype.element_ty).to(tl.float32), [GP * D]),
                             kvh * G * D, G * D, oq_ptr, od_ptr, os_ptr, GP * D)
            tl.atomic_xchg(cnt_ptr + kvh * CNT_STRIDE, 0)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _decode_reduce_kernel(po_ptr, pml_ptr, o_ptr, sink_ptr, NS, stride_oh, D: tl.constexpr,
                          NSP: tl.constexpr, SINK: tl.constexpr,
                          PDL: tl.constexpr):
    pdl.start(PDL)
    h = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NSP)
    sm = s < NS
    lse = tl.load(pml_ptr + h * NS + s, mask=sm, other=_NEG)
    mx = tl.max(lse, axis=0)
    w = tl.exp(lse - mx)
    dd = tl.arange(0, D)
    o = tl.load(po_ptr + (h * NS + s)[:, None] * D + dd[None, :], mask=sm[:, None], other=0.0)
    den = tl.sum(w, axis=0)
    if SINK:
        den += tl.exp(tl.load(sink_ptr + h) - mx)
    out = tl.sum(o * w[:, None], axis=0) / den
    tl.store(o_ptr + h * stride_oh + dd, out.to(o_ptr.dtype.element_ty))


def _views(cache: torch.Tensor):
    if cache.dtype == torch.uint8:
        return cache, cache.view(torch.int8), cache.view(torch.float16), True
    return cache, cache, cache, False


def decode_split(cells: int, n_splits: int = ATTN_SPLITS) -> int:
    """Cells per split-K program: a multiple of 64 so that at most ``n_splits`` programs per
    KV head cover every cell (engine/planning/buffers.py sizes the partials for ATTN_SPLITS)."""
    return max(64, triton.cdiv(triton.cdiv(cells, n_splits), 64) * 64)


def decode_workspace(n_head: int, head_dim: int, cells: int,
                     device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """Partial outputs [n_head, ATTN_SPLITS, head_dim] and their log-sum-exp [n_head,
    ATTN_SPLITS]: the shapes of buf.attn_partial / buf.attn_lse."""
    return (torch.empty(n_head, ATTN_SPLITS, head_dim, dtype=torch.float32, device=device),
            torch.empty(n_head, ATTN_SPLITS, dtype=torch.float32, device=device))


def attn_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                positions: torch.Tensor, n_kv_heads: int, cells: int, window: int, scale: float,
                out: torch.Tensor | None = None,
                workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                counter: torch.Tensor | None = None, use_pdl: bool = True,
                sinks: torch.Tensor | None = None, out_q=None) -> torch.Tensor:
    """One query token q [n_head, head_dim] at position positions[0] (the key/value of that
    position already stored) -> [n_head, head_dim]. No allocation given out and workspace.
    ``sinks``: float32 [n_head] (gpt-oss), one more logit per head that takes its share of
    each softmax and adds no value.
    ``counter``: int32 zeros [n_kv_heads] or [n_kv_heads, k] (left zero); with it the splits
    are merged by the last program of each kv head instead of a second launch. ``use_pdl``:
    launch with PDL where the GPU has it (carve_kernels/pdl.py). ``out_q``: (q words, d, s)
    buffers (carve_kernels/q8x.py) that the merging programs fill with the int8 copy of the
    output row as stored (the next GEMV's int8 x); needs ``counter`` and head_dim a multiple
    of 32. With it the next launch becomes resident only once every split's partial is stored,
    not at the kernel's start: its programs are placed when the SMs empty, not squeezed beside
    the attention's (H100, 2026-12-07, tg128: the IQ3_S mix 418.1 against 395.5 t/s; the
    release late without the copy lost ~1 %, carve_kernels/NOTES.md "int8 x")."""
    nh, d = q.shape
    g = nh // n_kv_heads
    if workspace is None:
        workspace = decode_workspace(nh, d, cells, q.device)
    po, pml = workspace
    ns_buf = po.shape[1]
    split = decode_split(cells, ns_buf)
    ns = triton.cdiv(cells, split)
    if out is None:
        out = torch.empty_like(q)
    ck, ck8, ckh, q8 = _views(k_cache)
    cv, cv8, cvh, _ = _views(v_cache)
    gp = max(16, triton.next_power_of_2(g))
    fused = counter is not None
    if out_q is not None and (not fused or d % 32 or out.stride(0) != d
                              or not q8x.fits(out_q, nh * d)):
        raise ValueError("an int8 copy of the attention output needs the merging programs "
                         "(counter), whole groups of 32 a head, contiguous heads and buffers "
                         f"for {nh * d} values")
    oq, od, os_ = out_q if out_q is not None else (pml, pml, pml)
    _decode_partial_kernel[(n_kv_heads, ns)](
        q, ck, ck8, ckh, cv, cv8, cvh, positions, po, pml, counter if fused else pml, out,
        sinks if sinks is not None else pml, oq, od, os_, cells, window, scale, n_kv_heads, ns,
        q.stride(0), out.stride(0), counter.stride(0) if fused else 0,
        **trace.args("attention_decode", (n_kv_heads, ns), out), G=g, GP=gp, D=d,
        SPLIT=split, BLOCK_N=64, Q8=q8, FUSED=fused, NSP=triton.next_power_of_2(ns),
        MERGE=max(1, 8192 // (gp * d)), SINK=sinks is not None, OUT_Q8=out_q is not None,
        LATE=1 if out_q is not None and pdl.enabled(out, use_pdl) else 0,
        num_warps=4,
        **pdl.opts(out, use_pdl))
    if not fused:
        _decode_reduce_kernel[(nh,)](po, pml, out, sinks if sinks is not None else pml, ns,
                                     out.stride(0), D=d, NSP=triton.next_power_of_2(ns),
                                     SINK=sinks is not None, num_warps=4,
                                     **pdl.opts(out, use_pdl))
    return out


def _attend_ref(q, keys, vals, kpos, qpos, window, scale, g, sinks=None):
    # q [T, H, D], keys/vals [N, KVH, D], kpos [N], qpos [T] -> [T, H, D] (float32); sinks
    # [H]: one more logit per head in each softmax, with no value
    k = keys.repeat_interleave(g, dim=1)
    v = vals.repeat_interleave(g, dim=1)
    s = torch.einsum("thd,nhd->htn", q.float() * scale, k)
    ok = kpos[None, :] <= qpos[:, None]
    if window > 0:
        ok &= (qpos[:, None] - kpos[None, :]) < window
    s = s.masked_fill(~ok[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(-1, 1, 1).expand(s.shape[0], s.shape[1], 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1)[..., :-1]
        return torch.einsum("htn,nhd->thd", p, v)
    return torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v)


def attn_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    positions: torch.Tensor, n_kv_heads: int, cells: int, window: int,
                    scale: float, out: torch.Tensor | None = None,
                    workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                    counter=None, use_pdl=True, sinks=None) -> torch.Tensor:
    nh, d = q.shape
    pos = int(positions.reshape(-1)[0])
    n_valid = min(pos + 1, cells)
    c = torch.arange(n_valid, device=q.device)
    kpos = c if pos + 1 <= cells else pos - ((pos - c) % cells)
    k = kv_load_ref(k_cache, cells, n_kv_heads, d)[:n_valid]
    v = kv_load_ref(v_cache, cells, n_kv_heads, d)[:n_valid]
    qpos = torch.tensor([pos], device=q.device)
    y = _attend_ref(q[None], k, v, kpos, qpos, window, scale, nh // n_kv_heads,
                    sinks)[0].to(q.dtype)
    return y if out is None else out.copy_(y)


@triton.jit
def _online(q, k, v, ok, m_i, l_i, acc):
    sc = tl.dot(q, tl.trans(k))
    sc = tl.where(ok, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    alpha = tl.exp(m_i - m_new)
    pr = tl.exp(sc - m_new[:, None])
    l_i = l_i * alpha + tl.sum(pr, axis=1)
    acc = acc * alpha[:, None] + tl.dot(pr.to(tl.float16), v)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["T", "pos0", "cells", "window"])
def _prefill_kernel(q_ptr, kn_ptr, vn_ptr, c_k, c8_k, ch_k, c_v, c8_v, ch_v, o_ptr, sink_ptr,
                    pos_ptr, T, pos0, cells, window, scale, KVH, stride_qt, stride_qh,
                    stride_kt, stride_kh, stride_ot, stride_oh,
                    G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, Q8: tl.constexpr, SINK: tl.constexpr,
                    POS_DEV: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)
    if POS_DEV:  # the chunk's first position, read on the device (a captured chunk replays
        pos0 = tl.load(pos_ptr).to(tl.int32)  # at any position)
    mb = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    i = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    im = i < T
    qpos = pos0 + i
    dd = tl.arange(0, D)
    q = tl.load(q_ptr + i.to(tl.int64)[:, None] * stride_qt + h * stride_qh + dd[None, :],
                mask=im[:, None], other=0.0)
    q = (q.to(tl.float32) * scale).to(tl.float16)
    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # 1) keys of earlier chunks, from the cache (the ring holds the last `cells` positions)
    lo = tl.maximum(pos0 - cells, 0)
    lo = tl.where(window > 0, tl.maximum(lo, pos0 + mb * BLOCK_M - window + 1), lo)
    for p0 in range(lo, pos0, BLOCK_N):
        p = p0 + tl.arange(0, BLOCK_N)
        pm = p < pos0
        k = _load_kv(c_k, c8_k, ch_k, p % cells, kvh, KVH, dd, pm, D, Q8)
        v = _load_kv(c_v, c8_v, ch_v, p % cells, kvh, KVH, dd, pm, D, Q8)
        ok = pm[None, :] & ((window <= 0) | (qpos[:, None] - p[None, :] < window))
        m_i, l_i, acc = _online(q, k, v, ok, m_i, l_i, acc)
    # 2) keys of this chunk, causal
    hi = tl.minimum(T, (mb + 1) * BLOCK_M)
    jlo = tl.maximum(0, mb * BLOCK_M - window + 1)
    jlo = tl.where(window > 0, (jlo // BLOCK_N) * BLOCK_N, 0)
    for j0 in range(jlo, hi, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        jm = j < T
        kv_off = j.to(tl.int64)[:, None] * stride_kt + kvh * stride_kh + dd[None, :]
        k = tl.load(kn_ptr + kv_off, mask=jm[:, None], other=0.0).to(tl.float16)
        v = tl.load(vn_ptr + kv_off, mask=jm[:, None], other=0.0).to(tl.float16)
        ok = jm[None, :] & (j[None, :] <= i[:, None])
        ok = ok & ((window <= 0) | (i[:, None] - j[None, :] < window))
        m_i, l_i, acc = _online(q, k, v, ok, m_i, l_i, acc)
    if SINK:  # gpt-oss: the sink's share of each softmax, no value
        l_i += tl.exp(tl.load(sink_ptr + h) - m_i)
    o = acc / l_i[:, None]
    tl.store(o_ptr + i.to(tl.int64)[:, None] * stride_ot + h * stride_oh + dd[None, :],
             o.to(o_ptr.dtype.element_ty), mask=im[:, None])


def attn_prefill(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int | torch.Tensor,
                 cells: int, window: int, scale: float, out: torch.Tensor | None = None,
                 use_pdl: bool = True, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of a chunk q [T, n_head, D] at positions pos0.. over the cache's
    earlier positions plus the chunk's own k_new/v_new [T, n_kv_heads, D] -> [T, n_head, D].
    ``pos0``: the first position, a host int or an int32/int64 tensor on the device whose
    first element it is (the chunk's positions: the kernel reads it there, so that nothing of the
    launch depends on the position). ``use_pdl`` and ``sinks`` as in ``attn_decode``."""
    t, nh, d = q.shape
    kvh = k_new.shape[1]
    if out is None:
        out = torch.empty_like(q)
    ck, ck8, ckh, q8 = _views(k_cache)
    cv, cv8, cvh, _ = _views(v_cache)
    bm, bn = (64, 64) if d <= 128 else (32, 32)
    grid = (triton.cdiv(t, bm), nh)
    dev = isinstance(pos0, torch.Tensor)
    if dev and (pos0.dtype not in (torch.int32, torch.int64) or pos0.numel() < 1
                or pos0.device != q.device):
        raise ValueError("attn_prefill: pos0 must be an int, or an int32 or int64 tensor on "
                         "q's device")
    _prefill_kernel[grid](q, k_new, v_new, ck, ck8, ckh, cv, cv8, cvh, out,
                          sinks if sinks is not None else out, pos0 if dev else out, t,
                          0 if dev else pos0, cells, window, scale, kvh, q.stride(0),
                          q.stride(1), k_new.stride(0), k_new.stride(1), out.stride(0),
                          out.stride(1), G=nh // kvh, D=d, BLOCK_M=bm, BLOCK_N=bn, Q8=q8,
                          SINK=sinks is not None, POS_DEV=dev, num_warps=4,
                          **pdl.opts(out, use_pdl))
    return out


def attn_prefill_ref(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, pos0: int, cells: int,
                     window: int, scale: float, out: torch.Tensor | None = None,
                     use_pdl=True, sinks=None) -> torch.Tensor:
    t, nh, d = q.shape
    kvh = k_new.shape[1]
    pos0 = int(pos0.reshape(-1)[0]) if isinstance(pos0, torch.Tensor) else pos0
    lo = max(0, pos0 - cells)
    kpos_old = torch.arange(lo, pos0, device=q.device)
    kc = kv_load_ref(k_cache, cells, kvh, d)[kpos_old % cells]
    vc = kv_load_ref(v_cache, cells, kvh, d)[kpos_old % cells]
    keys = torch.cat([kc, k_new.float()])
    vals = torch.cat([vc, v_new.float()])
    kpos = torch.cat([kpos_old, torch.arange(pos0, pos0 + t, device=q.device)])
    qpos = torch.arange(pos0, pos0 + t, device=q.device)
    y = _attend_ref(q, keys, vals, kpos, qpos, window, scale, nh // kvh, sinks).to(q.dtype)
    return y if out is None else out.copy_(y)

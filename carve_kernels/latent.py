"""Multi-head latent attention (DeepSeek-V2/V3's MLA) as llama.cpp's deepseek2 graph runs it with
the absorption trick: the KV cache holds one latent row per token, [latent (C) | rotated key
(R)], shared by every head, so attention is one key head for all queries.

- ``head_matmul``: each head's own small matrix, out[t, h] = W[h] a[t, h] (attn_k_b carries a
  head's position-free query into the latent space, attn_v_b the attention-weighted latent
  out of it), for decode's one row and prefill's chunks alike.
- ``latent_store``: the chunk's rows into the cache at cell = position % cells (a padded
  chunk's repeated rows skipped, as carve_kernels/kv_cache.py does).
- ``latent_attention``: softmax(q . row * scale) over the cached rows, weighting each row's
  latent (its first C values): split-K over cells for decode (partials, then
  ``latent_merge``), one program per token and head tile for prefill. The query of each
  token is its latent part [H, C] and its rotated part [H, R]; Mistral Large 3's attention
  temperature (1 + scale ln(floor(pos / length) + 1)) multiplies it on the way in.

The cache is f16 [cells, 1, C + R], or q8_0 (each row's C + R values in 34-byte blocks of 32,
ggml's rounding, as carve_kernels/kv_cache.py quantizes); the chunk's rows are stored before its
attention reads them (a latent model has no sliding window, so the cache never drops a position
a query needs), so a chunk attends its own rows as the cache gives them back.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import attention, pdl, q8x, trace
from carve_kernels.attention import _NEG  # the running maxima's finite start
from carve_kernels.kv_cache import kv_load_ref


@triton.jit(do_not_specialize=["T", "H", "J", "K"])
def _head_matmul_kernel(a_ptr, w_ptr, o_ptr, T, H, J, K, sat, sah, swh, swj, swk, sot, soh,
                        trace_ptr, BT: tl.constexpr, BJ: tl.constexpr, BK: tl.constexpr,
                        IEEE: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    trace.wait(trace_ptr, PDL, TRACE)
    tb = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    jb = tl.program_id(2)
    t = tb * BT + tl.arange(0, BT)
    j = jb * BJ + tl.arange(0, BJ)
    tm, jm = t < T, j < J
    acc = tl.zeros([BT, BJ], tl.float32)
    for k0 in range(0, K, BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        a = tl.load(a_ptr + t.to(tl.int64)[:, None] * sat + h * sah + k[None, :],
                    mask=tm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + h * swh + j.to(tl.int64)[:, None] * swj + k[None, :] * swk,
                    mask=jm[:, None] & km[None, :], other=0.0)
        if IEEE:  # float32 activations (the CPU interpreter's): no tf32 rounding
            acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # f16 products (bf16 inputs too: the attention kernels' choice)
            acc += tl.dot(a.to(tl.float16), tl.trans(w.to(tl.float16)))
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(o_ptr + t.to(tl.int64)[:, None] * sot + h * soh + j[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=tm[:, None] & jm[None, :])
    trace.stamp(trace_ptr, 3, TRACE)


def head_matmul(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                use_pdl: bool = True) -> torch.Tensor:
    """out[t, h, j] = sum_k a[t, h, k] w[h, j, k]: a [T, H, K] and out [T, H, J] with their last
    dim contiguous, w [H, J, K] of any strides (a legacy attn_kv_b's blocks read transposed)
    and any float dtype (multiplied in float16, or float32 for float32 a). No allocation."""
    t, h, k = a.shape
    j = w.shape[1]
    if a.stride(2) != 1 or out.stride(2) != 1 or w.shape != (h, j, k) or out.shape != (t, h, j):
        raise ValueError(f"head_matmul: a {tuple(a.shape)}, w {tuple(w.shape)}, out "
                         f"{tuple(out.shape)} (last dims of a and out contiguous)")
    bt = 16 if t <= 16 else 64
    bj = 64
    grid = (triton.cdiv(t, bt), h, triton.cdiv(j, bj))
    _head_matmul_kernel[grid](a, w, out, t, h, j, k, a.stride(0), a.stride(1), w.stride(0),
                              w.stride(1), w.stride(2), out.stride(0), out.stride(1),
                              **trace.args("head_matmul", grid, out), BT=bt,
                              BJ=bj, BK=64, IEEE=a.dtype == torch.float32, num_warps=4,
                              **pdl.opts(out, use_pdl))
    return out


def head_matmul_ref(a, w, out, use_pdl=True):
    return out.copy_(torch.einsum("thk,hjk->thj", a.float(), w.float()))


@triton.jit
def _latent_store_kernel(src_ptr, pos_ptr, c_ptr, c8_ptr, ch_ptr, cells, stride_t, W,
                         BLOCK: tl.constexpr, NBP: tl.constexpr, Q8: tl.constexpr,
                         PDL: tl.constexpr):
    pdl.start(PDL)
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t)
    before = tl.load(pos_ptr + tl.maximum(t - 1, 0))
    if t > 0 and before == p:  # a padded chunk's repeated last row
        return
    cell = (p % cells).to(tl.int64)
    src = src_ptr + t.to(tl.int64) * stride_t
    if Q8:  # the row's W / 32 blocks: a half-float scale, then 32 int8 values each
        b = tl.arange(0, NBP)
        j = tl.arange(0, 32)
        bm = b < W // 32
        x = tl.load(src + b[:, None] * 32 + j[None, :], mask=bm[:, None], other=0.0)
        d, q = q8x.quant32(x.to(tl.float32), 1)
        blk = cell * (W // 32) + b
        tl.store(ch_ptr + blk * 17, d.to(tl.float16), mask=bm)
        tl.store(c8_ptr + blk[:, None] * 34 + 2 + j[None, :], q.to(tl.int8), mask=bm[:, None])
    else:
        d = tl.arange(0, BLOCK)
        m = d < W
        x = tl.load(src + d, mask=m)
        tl.store(c_ptr + cell * W + d, x.to(c_ptr.dtype.element_ty), mask=m)


def _views(cache: torch.Tensor, w: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(f16 rows, int8 bytes, f16 words, q8) of a latent cache: f16 [cells, 1, w], or q8_0
    bytes (w a multiple of 32)."""
    if cache.dtype == torch.uint8:
        if w % 32 or cache.numel() % (w // 32 * 34):
            raise ValueError(f"a q8_0 latent cache of {cache.numel()} bytes for rows of {w}")
    elif cache.dtype != torch.float16 or cache.shape[-1] != w:
        raise ValueError(f"a {cache.dtype} latent cache of {tuple(cache.shape)} for rows of {w}")
    return attention._views(cache)  # the views the attention kernels read a cache through


def latent_store(rows: torch.Tensor, cache: torch.Tensor, positions: torch.Tensor, cells: int,
                 use_pdl: bool = True) -> None:
    """rows [T, W] (last dim contiguous) into cache (f16 [cells, 1, W] or q8_0 bytes) at
    position % cells."""
    t, w = rows.shape
    if rows.stride(1) != 1:
        raise ValueError("latent_store: rows need their last dim contiguous")
    c, c8, ch, q8 = _views(cache, w)
    _latent_store_kernel[(t,)](rows, positions, c, c8, ch, cells, rows.stride(0), w,
                               BLOCK=triton.next_power_of_2(w),
                               NBP=triton.next_power_of_2(max(1, w // 32)), Q8=q8, num_warps=4,
                               **pdl.opts(cache, use_pdl))


@triton.jit
def _rows(c_ptr, c8_ptr, ch_ptr, cell, cols, mask, W, Q8: tl.constexpr):
    # [N, cols] of the cached rows at cells ``cell`` as stored: f16, or q8_0 dequantized (f32)
    if Q8:
        blk = cell[:, None] * (W // 32) + cols[None, :] // 32
        q = tl.load(c8_ptr + blk * 34 + 2 + cols[None, :] % 32, mask=mask, other=0)
        d = tl.load(ch_ptr + blk * 17, mask=mask, other=0.0)
        v = q.to(tl.float32) * d.to(tl.float32)
    else:
        v = tl.load(c_ptr + cell[:, None] * W + cols[None, :], mask=mask, other=0.0)
        v = v.to(tl.float32)
    return v


@triton.jit(do_not_specialize=["cells", "NS"])
def _latent_attn_kernel(ql_ptr, qp_ptr, c_ptr, c8_ptr, ch_ptr, pos_ptr, o_ptr, po_ptr, pml_ptr,
                        H, cells, NS,
                        scale, temp_scale, temp_len, sqt, sqh, spt, sph, sot, soh, trace_ptr,
                        C: tl.constexpr, CP: tl.constexpr, R: tl.constexpr, RP: tl.constexpr,
                        SPLIT: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr,
                        PARTIAL: tl.constexpr, TEMP: tl.constexpr, IEEE: tl.constexpr,
                        Q8: tl.constexpr, PDL: tl.constexpr, TRACE: tl.constexpr):
    trace.wait(trace_ptr, PDL, TRACE)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    s = tl.program_id(2)
    hm = heads < H
    pos = tl.load(pos_ptr + t).to(tl.int32)
    n_valid = tl.minimum(pos + 1, cells)
    start = s * SPLIT
    end = tl.minimum(start + SPLIT, n_valid)
    cc = tl.arange(0, CP)
    rr = tl.arange(0, RP)
    cm, rm = cc < C, rr < R
    f = scale
    if TEMP:  # Mistral Large 3: queries warmer with distance
        f = scale * (1.0 + temp_scale * tl.log((pos // temp_len).to(tl.float32) + 1.0))
    ql = tl.load(ql_ptr + t * sqt + heads[:, None] * sqh + cc[None, :],
                 mask=hm[:, None] & cm[None, :], other=0.0)
    qp = tl.load(qp_ptr + t * spt + heads[:, None] * sph + rr[None, :],
                 mask=hm[:, None] & rm[None, :], other=0.0)
    # products in f16 (the cache's type) for 16-bit activations, in float32 for float32 ones
    ql = ql.to(tl.float32) * f
    qp = qp.to(tl.float32) * f
    if not IEEE:
        ql = ql.to(tl.float16)
        qp = qp.to(tl.float16)
    m_i = tl.full([BH], _NEG, tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, CP], tl.float32)
    W = C + R
    for n0 in range(start, end, BN):
        c = n0 + tl.arange(0, BN)
        ok = c < end
        cell = c.to(tl.int64)
        kl = _rows(c_ptr, c8_ptr, ch_ptr, cell, cc, ok[:, None] & cm[None, :], W, Q8)
        kp = _rows(c_ptr, c8_ptr, ch_ptr, cell, C + rr, ok[:, None] & rm[None, :], W, Q8)
        if not IEEE:
            kl = kl.to(tl.float16)
            kp = kp.to(tl.float16)
        if IEEE:
            kl = kl.to(tl.float32)
            sc = (tl.dot(ql, tl.trans(kl), input_precision="ieee")
                  + tl.dot(qp, tl.trans(kp.to(tl.float32)), input_precision="ieee"))
        else:
            sc = tl.dot(ql, tl.trans(kl)) + tl.dot(qp, tl.trans(kp))  # [BH, BN]
        sc = tl.where(ok[None, :], sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, axis=1))
        alpha = tl.exp(m_i - m_new)
        pr = tl.exp(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(pr, axis=1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(pr, kl, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(pr.to(tl.float16), kl)
        m_i = m_new
    o = acc / tl.maximum(l_i, 1e-30)[:, None]
    trace.stamp(trace_ptr, 2, TRACE)
    if PARTIAL:  # a split past the current length: o = 0 and lse = -1e30 (weight 0 in the merge)
        out = heads.to(tl.int64) * NS + s
        lse = tl.where(l_i > 0, m_i + tl.log(tl.maximum(l_i, 1e-30)), _NEG)
        tl.store(po_ptr + out[:, None] * CP + cc[None, :], o, mask=hm[:, None])
        tl.store(pml_ptr + out, lse, mask=hm)
    else:
        tl.store(o_ptr + t * sot + heads[:, None] * soh + cc[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=hm[:, None] & cm[None, :])
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _latent_merge_kernel(po_ptr, pml_ptr, o_ptr, NS, soh, trace_ptr, C: tl.constexpr,
                         CP: tl.constexpr, NSP: tl.constexpr, PDL: tl.constexpr,
                         TRACE: tl.constexpr):
    trace.wait(trace_ptr, PDL, TRACE)
    h = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, NSP)
    sm = s < NS
    lse = tl.load(pml_ptr + h * NS + s, mask=sm, other=_NEG)
    w = tl.exp(lse - tl.max(lse, axis=0))
    cc = tl.arange(0, CP)
    o = tl.load(po_ptr + (h * NS + s)[:, None] * CP + cc[None, :], mask=sm[:, None], other=0.0)
    out = tl.sum(o * w[:, None], axis=0) / tl.sum(w, axis=0)
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(o_ptr + h * soh + cc, out.to(o_ptr.dtype.element_ty), mask=cc < C)
    trace.stamp(trace_ptr, 3, TRACE)


def workspace_width(kv_lora: int) -> int:
    """The partials' last dim for a latent of ``kv_lora`` values (buf.attn_partial's)."""
    return triton.next_power_of_2(kv_lora)


def latent_attention(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                     positions: torch.Tensor, cells: int, scale: float, out: torch.Tensor,
                     workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                     temperature: tuple[float, int] | None = None,
                     use_pdl: bool = True) -> torch.Tensor:
    """out [T, H, C] = softmax over each token's cached positions of ([q_lat | q_pe] . row *
    scale) times the rows' latents, for q_lat [T, H, C] and q_pe [T, H, R] (last dims
    contiguous) at positions [T] (on the device) over cache [cells, 1, C + R] f16 or its q8_0
    bytes (the chunk's own rows already stored). ``workspace``: (partials [H, S, CP] f32, lse [H, S]
    f32): one row (decode) splits its cells over up to S programs a head tile and merges them
    in a second launch; without it every token is one program per head tile. The products are
    f16 (the cache's type) for 16-bit queries, float32 for float32 ones.
    ``temperature``: (scale, length) of Mistral Large 3's attention temperature."""
    t, h, c = q_lat.shape
    r = q_pe.shape[2]
    if q_lat.stride(2) != 1 or q_pe.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError(f"latent_attention: q_lat {tuple(q_lat.shape)} and q_pe "
                         f"{tuple(q_pe.shape)} need their last dims contiguous")
    cf, c8, ch, q8 = _views(cache, c + r)
    cp, rp = max(16, triton.next_power_of_2(c)), max(16, triton.next_power_of_2(r))
    bh = 16
    split_k = workspace is not None and t == 1
    if split_k:
        po, pml = workspace  # [H, S, >= CP] and [H, S], read as [H, ns, CP] and [H, ns]
        split = attention.decode_split(cells, pml.shape[1])
        ns = triton.cdiv(cells, split)
        if po.numel() < h * ns * cp or pml.numel() < h * ns:
            raise ValueError(f"latent_attention: a workspace of {tuple(po.shape)} for {h} "
                             f"heads of {cp}")
    else:
        split, ns, po, pml = triton.cdiv(max(cells, 1), 64) * 64, 1, out, out
    ts, tl_ = temperature if temperature is not None else (0.0, 1)
    grid = (t, triton.cdiv(h, bh), ns)
    _latent_attn_kernel[grid](
        q_lat, q_pe, cf, c8, ch, positions, out, po, pml, h, cells, ns, float(scale), float(ts),
        int(tl_), q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), **trace.args("latent_attention", grid, out), C=c, CP=cp,
        R=r, RP=rp, SPLIT=split, BH=bh, BN=32,
        PARTIAL=split_k, TEMP=temperature is not None, IEEE=q_lat.dtype == torch.float32,
        Q8=q8, num_warps=4, **pdl.opts(out, use_pdl))
    if split_k:
        _latent_merge_kernel[(h,)](po, pml, out, ns, out.stride(1),
                                   **trace.args("latent_merge", (h,), out), C=c, CP=cp,
                                   NSP=triton.next_power_of_2(ns), num_warps=4,
                                   **pdl.opts(out, use_pdl))
    return out


def latent_attention_ref(q_lat, q_pe, cache, positions, cells, scale, out, workspace=None,
                         temperature=None, use_pdl=True):
    """The same in float32 torch (positions below cells: no ring)."""
    c, r = q_lat.shape[2], q_pe.shape[2]
    rows = kv_load_ref(cache, cells, 1, c + r)[:, 0]
    q = torch.cat((q_lat.float(), q_pe.float()), dim=-1)  # [T, H, C + R]
    pos = positions.long()
    if temperature is not None:
        ts, tl_ = temperature
        q = q * (1 + ts * torch.log(torch.floor(pos.double() / tl_) + 1)).float()[:, None, None]
    s = torch.einsum("thd,nd->thn", q, rows) * scale
    n = torch.arange(rows.shape[0], device=q.device)
    s = s.masked_fill(~(n[None, :] <= pos[:, None])[:, None, :], float("-inf"))
    return out.copy_(torch.einsum("thn,nc->thc", torch.softmax(s, dim=-1), rows[:, :c]))

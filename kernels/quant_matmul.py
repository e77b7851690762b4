"""Quantized matrix kernels: fused dequantize x vector (decode), dequantize to f16/bf16 (prefill
GEMMs and the dequant cache), and embedding gather with dequantize.

A weight is its GGUF bytes as a uint8 tensor ``[rows, row_bytes]`` (torch shape of a GGUF
``[ne0=cols, ne1=rows]`` matrix), so ``y = W @ x`` with ``x`` of ``cols`` values.
Each function has a plain-torch twin ``*_ref`` of the same signature built on
``engine.dequant`` (itself held bit-equal to ``gguf.quants.dequantize``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine import dequant as _dq
from engine import quant_types as qt
from kernels.quant_blocks import dequant_part, plan

# (rows per program, blocks per step, warps) per type, for M<=8 decode GEMV; picked by
# kernels/device_check.py on an H200 (see kernels/NOTES.md).
GEMV_CONFIG: dict[int, tuple[int, ...]] = {
    # (rows, blocks per step, warps[, pipeline stages]): a tile must give each thread ~16
    # contiguous weight bytes per part, or loads stay 2 bytes wide and the scale loads
    # dominate; best of the sweeps on an H200 (kernels/NOTES.md)
    qt.F16: (4, 16, 4),
    qt.BF16: (4, 16, 4),
    qt.Q4_0: (4, 32, 4),
    qt.Q5_0: (4, 16, 4),
    qt.Q8_0: (4, 16, 4),
    qt.Q4_K: (4, 16, 4),
    qt.Q5_K: (4, 16, 4),
    qt.Q6_K: (2, 16, 4),
}
# types whose parts are summed over their lanes at once (LANE_SUM; faster for these on the H200)
LANE_SUM_TYPES = frozenset({qt.Q5_0, qt.Q8_0})


@triton.jit
def _gemv_kernel(w_ptr, wh_ptr, x_ptr, y_ptr, b_ptr, N, K, row_bytes, stride_xm, stride_ym,
                 TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr,
                 L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                 HAS_BIAS: tl.constexpr, LANE_SUM: tl.constexpr):
    # rows on axis 0: a 152064-row output matrix in 2-row programs passes the 65535 limit of
    # grid axes 1 and 2
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_c = tl.minimum(rows, N - 1)  # clamp instead of masking every weight load
    nblk = K // BS
    tb = tl.arange(0, BLOCK_B)
    lane = tl.arange(0, L)
    row_base = rows_c.to(tl.int64)[:, None, None] * row_bytes
    xrow = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_R, BLOCK_B, L], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_R, BLOCK_B], dtype=tl.float32)
    for b0 in range(0, nblk, BLOCK_B):
        blk = b0 + tb
        bmask = blk < nblk
        blk_c = tl.minimum(blk, nblk - 1)
        base = row_base + blk_c[None, :, None] * TS
        for p in tl.static_range(NPART):
            v, e = dequant_part(w_ptr, wh_ptr, base, lane, TYPE, p)
            # blocks past the row end read x as 0 (their weight values are a clamped, finite copy)
            # x loaded as a full [R, B, L] tile (rows re-read it from L1) so that it comes in: no shared-memory layout conversion per part
            # the weight tile's register layout: no shared-memory layout conversion per part.
            # F16/BF16 weights are as wide as x, so there one x load per row costs more.
            if TYPE == 1 or TYPE == 30:
                xv = tl.load(xrow + blk[:, None] * BS + e[None, :], mask=bmask[:, None],
                             other=0.0)
                acc += v * xv.to(tl.float32)[None, :, :]
            else:
                xp = tl.broadcast_to((xrow + blk[:, None] * BS + e[None, :])[None, :, :],
                                     (BLOCK_R, BLOCK_B, L))
                xm = tl.broadcast_to(bmask[None, :, None], (BLOCK_R, BLOCK_B, L))
                xv = tl.load(xp, mask=xm, other=0.0)
                if LANE_SUM:  # variant: reduce each part over its lanes at once
                    acc2 += tl.sum(v * xv.to(tl.float32), axis=2)
                else:
                    acc += v * xv.to(tl.float32)
    y = tl.sum(tl.sum(acc, axis=2), axis=1) + tl.sum(acc2, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rows, y.to(y_ptr.dtype.element_ty),
             mask=rows < N)


@triton.jit
def _dequant_kernel(w_ptr, wh_ptr, ids_ptr, out_ptr, N, K, row_bytes, stride_om,
                    TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr,
                    L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr,
                    GATHER: tl.constexpr):
    pid_r = tl.program_id(0)
    pid_b = tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < N
    if GATHER:  # embedding: output row i is weight row ids[i]
        src = tl.load(ids_ptr + r, mask=rmask, other=0).to(tl.int64)
    else:
        src = tl.minimum(r, N - 1).to(tl.int64)
    nblk = K // BS
    blk = pid_b * BLOCK_B + tl.arange(0, BLOCK_B)
    bmask = blk < nblk
    blk_c = tl.minimum(blk, nblk - 1)
    lane = tl.arange(0, L)
    base = src[:, None, None] * row_bytes + blk_c[None, :, None] * TS
    out_row = out_ptr + r.to(tl.int64)[:, None, None] * stride_om
    mask = rmask[:, None, None] & bmask[None, :, None]
    for p in tl.static_range(NPART):
        v, e = dequant_part(w_ptr, wh_ptr, base, lane, TYPE, p)
        col = blk[None, :, None] * BS + e[None, None, :]
        tl.store(out_row + col, v.to(out_ptr.dtype.element_ty), mask=mask)


def _views(w: torch.Tensor, ggml_type: int) -> tuple[torch.Tensor, torch.Tensor]:
    if w.dtype != torch.uint8 or w.dim() != 2 or not w.is_contiguous():
        raise ValueError(f"weight must be contiguous uint8 [rows, row_bytes], got {w.dtype} "
                         f"{tuple(w.shape)}")
    half = torch.bfloat16 if ggml_type == qt.BF16 else torch.float16
    return w, w.view(half)


def row_cols(w: torch.Tensor, ggml_type: int) -> int:
    """Values per row of a weight stored as [rows, row_bytes]."""
    p = plan(ggml_type)
    if w.shape[1] % p.nbytes:
        raise ValueError(f"{qt.type_name(ggml_type)} row of {w.shape[1]} bytes is not whole blocks")
    return w.shape[1] // p.nbytes * p.block


def gemv(w: torch.Tensor, ggml_type: int, x: torch.Tensor, out: torch.Tensor | None = None,
         config: tuple[int, ...] | None = None, bias: torch.Tensor | None = None,
         lane_sum: bool | None = None) -> torch.Tensor:
    """y[M, rows] = x[M, cols] @ W^T (+ bias), dequantizing W on the fly; M small (decode,
    M <= 8). x is float32/bf16/f16; y has x's dtype unless ``out`` is given. No allocation
    with ``out``."""
    w, wh = _views(w, ggml_type)
    p = plan(ggml_type)
    n, k = w.shape[0], row_cols(w, ggml_type)
    x2 = x.reshape(-1, k)
    if x2.stride(1) != 1:
        raise ValueError("x rows must be contiguous")
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out.view(m, n)
    br, bb, warps, *rest = config or GEMV_CONFIG[ggml_type]
    stages = rest[0] if rest else None  # software-pipelining depth of the block loop
    if lane_sum is None:
        lane_sum = ggml_type in LANE_SUM_TYPES
    bb = min(bb, triton.next_power_of_2(k // p.block))  # short rows: no all-masked blocks
    grid = (triton.cdiv(n, br), m)
    _gemv_kernel[grid](w, wh, x2, y, bias if bias is not None else y, n, k, w.shape[1],
                       x2.stride(0), y.stride(0), TYPE=ggml_type, BS=p.block, TS=p.nbytes,
                       NPART=p.parts, L=p.lanes, BLOCK_R=br, BLOCK_B=bb,
                       HAS_BIAS=bias is not None, LANE_SUM=lane_sum, num_warps=warps,
                       **({"num_stages": stages} if stages else {}))
    return y.view(*x.shape[:-1], n) if out is None else out


def gemv_ref(w: torch.Tensor, ggml_type: int, x: torch.Tensor, out: torch.Tensor | None = None,
             config: tuple[int, ...] | None = None, bias: torch.Tensor | None = None,
             lane_sum: bool = False) -> torch.Tensor:
    wf = dequantize_ref(w, ggml_type, torch.float32)
    y = x.to(torch.float32).reshape(-1, wf.shape[1]) @ wf.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    y = y.to(x.dtype)
    y = y.view(*x.shape[:-1], wf.shape[0])
    return y if out is None else out.copy_(y.view(out.shape))


def _dequant_launch(w, ggml_type, ids, out, n, k):
    w, wh = _views(w, ggml_type)
    p = plan(ggml_type)
    br = 8
    bb = min(8 if p.block == 256 else 16, triton.next_power_of_2(k // p.block))
    grid = (triton.cdiv(n, br), triton.cdiv(k // p.block, bb))
    _dequant_kernel[grid](w, wh, ids if ids is not None else w, out, n, k, w.shape[1],
                          out.stride(0), TYPE=ggml_type, BS=p.block, TS=p.nbytes,
                          NPART=p.parts, L=p.lanes, BLOCK_R=br, BLOCK_B=bb,
                          GATHER=ids is not None, num_warps=4)
    return out


def dequantize(w: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float16,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """W [rows, row_bytes] -> [rows, cols] in ``dtype`` (a dequant-cache span when ``out``)."""
    n, k = w.shape[0], row_cols(w, ggml_type)
    if out is None:
        out = torch.empty(n, k, dtype=dtype, device=w.device)
    return _dequant_launch(w, ggml_type, None, out, n, k)


def dequantize_ref(w: torch.Tensor, ggml_type: int, dtype: torch.dtype = torch.float16,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    n, k = w.shape[0], row_cols(w, ggml_type)
    # engine.dequant allocates its scratch on the CPU, so the reference runs there
    y = _dq.dequantize_to(w.reshape(-1).cpu(), ggml_type, (k, n), torch.float32)
    y = y.to(device=w.device, dtype=dtype)
    return y if out is None else out.copy_(y)


def embed(w: torch.Tensor, ggml_type: int, ids: torch.Tensor, dtype: torch.dtype = torch.float32,
          out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` [T] of the embedding W, dequantized: [T, cols]."""
    k = row_cols(w, ggml_type)
    t = ids.numel()
    if out is None:
        out = torch.empty(t, k, dtype=dtype, device=w.device)
    return _dequant_launch(w, ggml_type, ids.reshape(-1), out.view(t, k), t, k)


def embed_ref(w: torch.Tensor, ggml_type: int, ids: torch.Tensor,
              dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    rows = w[ids.reshape(-1).long()].contiguous()
    y = dequantize_ref(rows, ggml_type, dtype)
    return y if out is None else out.copy_(y.view(out.shape))


def matmul(w: torch.Tensor, ggml_type: int, x: torch.Tensor, scratch: torch.Tensor | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Prefill y = x @ W^T: dequantize W into ``scratch`` (or take an already dequantized
    dequant-cache tensor when ``ggml_type`` is None) and run one GEMM in x's dtype."""
    if ggml_type is None:
        wd = w
    else:
        wd = dequantize(w, ggml_type, x.dtype, out=scratch)
    if out is None:
        return x @ wd.T
    return torch.matmul(x, wd.T, out=out)


SUPPORTED = tuple(qt.type_name(t) for t in (qt.F16, qt.BF16, qt.Q4_0, qt.Q5_0, qt.Q8_0,
                                              qt.Q4_K, qt.Q5_K, qt.Q6_K))

"""Decode GEMVs of GGUF-order matrices fused into one launch: ``gemv_glu`` (gate and up of the
same outputs with the GLU, x read once for both) and ``gemv3`` (q, k and v side by side, each
matrix with its own type and tile). The single-matrix ``gemv``, the tiles, the bodies and the
reference ``gemv_ref`` are carve_kernels/quant_matmul.py's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl, q8x, trace
from carve_kernels.glu import glu_act
from carve_kernels.quant_matmul import _dot, _launch_args, _opts, _q8_in, _table, _x2, row_cols
from spec import quant_types as qt


@triton.jit
def _gemv_glu_kernel(g_ptr, gh_ptr, gi_ptr, u_ptr, uh_ptr, ui_ptr, x_ptr, xq_ptr, xd_ptr, y_ptr,
                     N, K, row_bytes, stride_xm, stride_ym, trace_ptr, TYPE: tl.constexpr,
                     BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr, L: tl.constexpr,
                     BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, LANE_SUM: tl.constexpr,
                     SPECIAL: tl.constexpr, MAGIC: tl.constexpr, GELU: tl.constexpr,
                     Q8X: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                     TRACE: tl.constexpr = False, LUT0: tl.constexpr = 0,
                     LUT1: tl.constexpr = 0, LUT2: tl.constexpr = 0, LUT3: tl.constexpr = 0):
    trace.wait(trace_ptr, PDL, TRACE)
    # gate and up rows of the same outputs in one program: x is read once for both, and the
    # GLU needs no launch and no [T, 2F] buffer of its own
    pid = tl.program_id(0)
    m = tl.program_id(1)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    rows_c = tl.minimum(rows, N - 1)
    xrow = xq_ptr if Q8X else x_ptr + m.to(tl.int64) * stride_xm
    g = _dot(g_ptr, gh_ptr, gi_ptr, xrow, rows_c, K, row_bytes, TYPE, BS, TS, NPART, L,
             BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC, xd_ptr, Q8X, ASM, LUT0, LUT1, LUT2,
             LUT3)
    u = _dot(u_ptr, uh_ptr, ui_ptr, xrow, rows_c, K, row_bytes, TYPE, BS, TS, NPART, L,
             BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC, xd_ptr, Q8X, ASM, LUT0, LUT1, LUT2,
             LUT3)
    trace.stamp(trace_ptr, 2, TRACE)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + rows,
             glu_act(g, u, GELU).to(y_ptr.dtype.element_ty), mask=rows < N)
    trace.stamp(trace_ptr, 3, TRACE)


@triton.jit
def _seg(pid, P0, w_ptr, wh_ptr, wi_ptr, b_ptr, xrow, xq_ptr, xd_ptr, yrow, N, K, row_bytes,
         TYPE: tl.constexpr, BS: tl.constexpr, TS: tl.constexpr, NPART: tl.constexpr,
         L: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_B: tl.constexpr, LANE_SUM: tl.constexpr,
         SPECIAL: tl.constexpr, MAGIC: tl.constexpr, HAS_BIAS: tl.constexpr, Q8X: tl.constexpr,
         ASM: tl.constexpr):
    rows = (pid - P0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if Q8X:
        xrow = xq_ptr
    y = _dot(w_ptr, wh_ptr, wi_ptr, xrow, tl.minimum(rows, N - 1), K, row_bytes, TYPE, BS,
             TS, NPART, L, BLOCK_R, BLOCK_B, LANE_SUM, SPECIAL, MAGIC, xd_ptr, Q8X, ASM)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(yrow + rows, y.to(yrow.dtype.element_ty), mask=rows < N)


@triton.jit
def _gemv3_kernel(w1, w1h, w1i, b1, N1, rb1, w2, w2h, w2i, b2, N2, rb2, w3, w3h, w3i, b3, N3, rb3,
                  x_ptr, xq_ptr, xd_ptr, y_ptr, P1, P2, K, stride_xm, stride_ym, trace_ptr,
                  T1: tl.constexpr, BS1: tl.constexpr, TS1: tl.constexpr, NP1: tl.constexpr,
                  L1: tl.constexpr, R1: tl.constexpr, B1: tl.constexpr, LS1: tl.constexpr,
                  SP1: tl.constexpr, MG1: tl.constexpr, Q8X1: tl.constexpr,
                  T2: tl.constexpr, BS2: tl.constexpr, TS2: tl.constexpr, NP2: tl.constexpr,
                  L2: tl.constexpr, R2: tl.constexpr, B2: tl.constexpr, LS2: tl.constexpr,
                  SP2: tl.constexpr, MG2: tl.constexpr, Q8X2: tl.constexpr,
                  T3: tl.constexpr, BS3: tl.constexpr, TS3: tl.constexpr, NP3: tl.constexpr,
                  L3: tl.constexpr, R3: tl.constexpr, B3: tl.constexpr, LS3: tl.constexpr,
                  SP3: tl.constexpr, MG3: tl.constexpr, Q8X3: tl.constexpr,
                  HAS_BIAS: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr,
                  TRACE: tl.constexpr):
    trace.wait(trace_ptr, PDL, TRACE)
    # q, k and v of one layer (each with its own type and tile) in one launch: the outputs sit
    # side by side in y's row; programs [0, P1) do the first matrix, [P1, P2) the second
    pid = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    xrow = x_ptr + m * stride_xm
    yrow = y_ptr + m * stride_ym
    if pid < P1:
        _seg(pid, 0, w1, w1h, w1i, b1, xrow, xq_ptr, xd_ptr, yrow, N1, K, rb1, T1, BS1, TS1,
             NP1, L1, R1, B1, LS1, SP1, MG1, HAS_BIAS, Q8X1, ASM)
    elif pid < P2:
        _seg(pid, P1, w2, w2h, w2i, b2, xrow, xq_ptr, xd_ptr, yrow + N1, N2, K, rb2, T2, BS2,
             TS2, NP2, L2, R2, B2, LS2, SP2, MG2, HAS_BIAS, Q8X2, ASM)
    else:
        _seg(pid, P2, w3, w3h, w3i, b3, xrow, xq_ptr, xd_ptr, yrow + N1 + N2, N3, K, rb3, T3,
             BS3, TS3, NP3, L3, R3, B3, LS3, SP3, MG3, HAS_BIAS, Q8X3, ASM)
    trace.stamp(trace_ptr, 2, TRACE)  # (the segment's stores are in it)
    trace.stamp(trace_ptr, 3, TRACE)


def can_pair(gate: torch.Tensor, gate_type: int, up: torch.Tensor, up_type: int) -> bool:
    """Whether gemv_glu takes these two matrices (same type and shape)."""
    return gate_type == up_type and gate.shape == up.shape


def gemv_glu(gate: torch.Tensor, up: torch.Tensor, ggml_type: int, x: torch.Tensor,
             act: str = "silu", out: torch.Tensor | None = None,
             config: tuple[int, ...] | None = None, use_pdl: bool = True,
             xq=None) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) in one launch (decode FFN): [M, rows]. ``use_pdl``, ``xq``
    as in ``gemv``."""
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    n, k = gate.shape[0], row_cols(gate, ggml_type)
    x2 = _x2(x, k)
    m = x2.shape[0]
    int8_x = q8x.usable(xq, x2)
    gp, meta, warps, stages = _launch_args(gate, ggml_type, config, x.dtype, int8_x)
    up_ptrs, meta_u, _, _ = _launch_args(up, ggml_type, config, x.dtype, int8_x)
    meta["SPECIAL"] = meta["SPECIAL"] and meta_u["SPECIAL"]
    if not meta["SPECIAL"]:
        gp = (gate, gp[1], _table(gate, ggml_type))
        up_ptrs = (up, up_ptrs[1], _table(up, ggml_type))
    q, d, use = _q8_in(xq, ggml_type, x2, meta["SPECIAL"], int8_x)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device) if out is None else out.view(m, n)
    grid = (triton.cdiv(n, meta["BLOCK_R"]), m)
    _gemv_glu_kernel[grid](*gp, *up_ptrs, x2, q, d, y, n, k, gate.shape[1], x2.stride(0),
                           y.stride(0), **trace.args("gemv_glu", grid, y), GELU=act == "gelu",
                           Q8X=use, ASM=gate.is_cuda, **meta, **_opts(warps, stages),
                           **pdl.opts(y, use_pdl))
    return y.view(*x.shape[:-1], n) if out is None else out


_SUFFIX = {"TYPE": "T", "BS": "BS", "TS": "TS", "NPART": "NP", "L": "L", "BLOCK_R": "R",
           "BLOCK_B": "B", "LANE_SUM": "LS", "SPECIAL": "SP", "MAGIC": "MG"}


def gemv3(mats: list[tuple[torch.Tensor, int]], x: torch.Tensor, out: torch.Tensor,
          biases: list[torch.Tensor] | None = None,
          configs: list[tuple[int, ...] | None] | None = None,
          use_pdl: bool = True, xq=None) -> torch.Tensor:
    """Three GEMVs of the same x in one launch (q, k, v), outputs side by side in ``out``
    [M, n1 + n2 + n3] (rows may be strided); each matrix keeps its own type and tile.
    ``use_pdl``, ``xq`` as in ``gemv`` (each matrix that runs a row body reads the int8 copy)."""
    if len(mats) != 3:
        raise ValueError("gemv3 takes three matrices")
    k = row_cols(*mats[0])
    x2 = _x2(x, k)
    m = x2.shape[0]
    y = out if out.dim() == 2 else out.view(m, -1)
    if y.shape != (m, sum(w.shape[0] for w, _ in mats)) or y.stride(1) != 1:
        raise ValueError("out must hold the three outputs side by side")
    args, consts, progs, warps = [], {}, [0], 4
    q, d = x2, x2
    int8_x = q8x.usable(xq, x2)
    for i, (w, t) in enumerate(mats, 1):
        if row_cols(w, t) != k:
            raise ValueError("gemv3's matrices must have the same number of columns")
        # (IQ4_NL's body takes its table as constants gemv3 has no room for: generic walk)
        ptrs, meta, wp, _ = _launch_args(w, t, configs[i - 1] if configs else None,
                                         x_dtype=x.dtype, int8_x=int8_x and t != qt.IQ4_NL)
        warps = wp if i == 1 else warps
        b = biases[i - 1] if biases is not None else y
        args += [*ptrs, b, w.shape[0], w.shape[1]]
        consts.update({f"{_SUFFIX[key]}{i}": v for key, v in meta.items()})
        qi, di, consts[f"Q8X{i}"] = _q8_in(xq, t, x2, meta["SPECIAL"], int8_x)
        if consts[f"Q8X{i}"]:
            q, d = qi, di
        progs.append(progs[-1] + triton.cdiv(w.shape[0], meta["BLOCK_R"]))
    grid = (progs[3], m)
    _gemv3_kernel[grid](*args, x2, q, d, y, progs[1], progs[2], k, x2.stride(0), y.stride(0),
                        **trace.args("gemv3", grid, y), HAS_BIAS=biases is not None, ASM=mats[0][0].is_cuda, **consts,
                        num_warps=warps, **pdl.opts(y, use_pdl))
    return out

"""Mixture-of-experts prefill: the routed rows sorted by expert on the device, then one grouped
GEMM per expert tile over its rows, dequantizing each block into registers and multiplying with
``tl.dot`` (no dequantized copy of any expert exists); carve_kernels/moe.py's ``combine`` sums each
token's k rows after.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels.moe import _ACTS, _act, _expert_ref, expert_rows
from carve_kernels.moe_decode import expert_glu_ref
from carve_kernels.quant_blocks import dequant_part, plan
from carve_kernels.quant_matmul import _launch_args, row_cols
from spec import quant_types as qt
from spec.launch import MOE_TILE_ROWS, moe_tiles

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


# prefill's grouped GEMM tiles on a GPU, per launch and matrix type: (columns per program, warps,
# pipeline stages); a program's rows are one tile of MOE_TILE_ROWS sorted rows. The H200's best
# at 64-row tiles (2026-12-04, `python -m benchmarks.device_check --moe` sweeps them): gate/up
# Q4_K 418.5 us and MXFP4 1,372 at (128, 4, 2); down Q6_K 339.5 at (64, 4, 2), Q4_K 196.6 and
# MXFP4 595.5 at (128, 4, 2)
GROUPED_CONFIG: dict[tuple[str, int], tuple[int, ...]] = {("down", qt.Q6_K): (64, 4, 2)}
GROUPED_DEFAULT: tuple[int, ...] = (128, 4, 2)


def _grouped_tile(kind: str, ggml_type: int, n: int, on_gpu: bool,
                  config: tuple[int, ...] | None) -> tuple[int, int, dict]:
    # (columns per program, warps, launch options: num_stages where the config gives one)
    if config is None:
        config = (GROUPED_CONFIG.get((kind, ggml_type), GROUPED_DEFAULT) if on_gpu
                  else (max(16, min(256, triton.next_power_of_2(n))), 4))
    bn, warps, *stages = config
    return bn, warps, ({"num_stages": stages[0]} if stages else {})


def grouped_glu(gate: torch.Tensor, gate_type: int, up: torch.Tensor, up_type: int,
                n_expert: int, x: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor,
                tiles: torch.Tensor, out: torch.Tensor, act: str = "silu",
                gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
                limit: float = 0.0, config: tuple[int, ...] | None = None) -> torch.Tensor:
    """Prefill's routed gate/up over the rows ``sort_routes`` grouped: ``out[s] = act(x[m] @
    gate_e^T) * (x[m] @ up_e^T)`` for the routed row a = rows[s] = m * k + j of expert e; one
    launch, a program per (tile, column block). ``config``: (columns per program, warps[,
    pipeline stages]); default GROUPED_CONFIG's for the gate's type."""
    n, k = expert_rows(gate, n_expert), row_cols(gate, gate_type)
    m, ku = ids.shape
    x2 = x.reshape(m, k)
    gp, gmeta = _gemm_meta(gate, gate_type, "G")
    upp, umeta = _gemm_meta(up, up_type, "U")
    bn, warps, opts = _grouped_tile("glu", gate_type, n, x.is_cuda, config)
    t = tiles.shape[1]
    _grouped_glu_kernel[(t, triton.cdiv(n, bn))](
        *gp, *upp, gate_bias if gate_bias is not None else x2,
        up_bias if up_bias is not None else x2, x2, rows, tiles, out, n, k, gate.shape[1],
        up.shape[1], x2.stride(0), t, float(limit), KU=ku, HAS_BIAS=gate_bias is not None,
        ACT=_ACTS[act], **gmeta, **umeta, BLOCK_M=MOE_TILE_ROWS, BLOCK_N=bn,
        DOT_F32=x.dtype == torch.float32, num_warps=warps, **opts)
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
                 config: tuple[int, ...] | None = None) -> torch.Tensor:
    """Prefill's routed down projection, row by sorted row: ``out[s] = h[s] @ down_e^T (+
    bias_e)`` for the expert e of the tile holding s (weights applied by ``combine``);
    ``config`` as in ``grouped_glu``."""
    n, k = expert_rows(down, n_expert), row_cols(down, ggml_type)
    ptrs, meta = _gemm_meta(down, ggml_type, "D")
    bn, warps, opts = _grouped_tile("down", ggml_type, n, h.is_cuda, config)
    t = tiles.shape[1]
    _grouped_down_kernel[(t, triton.cdiv(n, bn))](
        *ptrs, bias if bias is not None else h, h, tiles, out, n, k, down.shape[1], t,
        HAS_BIAS=bias is not None, **meta, BLOCK_M=MOE_TILE_ROWS, BLOCK_N=bn,
        DOT_F32=h.dtype == torch.float32, num_warps=warps, **opts)
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


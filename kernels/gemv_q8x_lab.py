"""Experiment (not wired into the runner): the T-layout Q4_K GEMV with x quantized to int8 per
32 values (llama.cpp's q8_1 idea) and the nibbles multiplied by ``dp4a``, timed against
``gemv_t.gemv_t`` on the same weights in one run.

Why: the float T body spends ~5.9 instructions per weight and row (kernels/NOTES.md, session
4), so 7B's FFN matrices are as much instruction-bound as memory-bound. With int8 x, a word of
8 nibbles is two masks and two ``dp4a`` per row. The price is x's int8 rounding (relative error
~1e-2 per value, as llama.cpp's decode has), so the check here is against the reference on the
dequantized int8 x, where only float rounding remains.

    python -m kernels.gemv_q8x_lab          # H200: times and errors, one line per shape
    TRITON_INTERPRET=1 python -m kernels.gemv_q8x_lab --check   # CPU: correctness, tiny shape
"""

# ruff: noqa: B023

from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from engine import quant_types as qt
from kernels import gemv_t, pdl, quant_matmul
from kernels.gemv_t import _k4_sm, _q4k_half_loads, _t_split_done, _t_tile
from kernels.random_blocks import random_weight


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    # c + sum over the 4 bytes of a (unsigned) times those of b (signed)
    if ASM:
        return tl.inline_asm_elementwise("dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r",
                                         [a, b, c], dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = c
        for k in tl.static_range(4):
            s += ((a >> (8 * k)) & 0xFF) * ((b << (24 - 8 * k)) >> 24)
        return s


@triton.jit
def _q8_chunk(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, xq_ptr, xd_ptr, xs_ptr, b, c,
              ASM: tl.constexpr):
    # chunk c of block b: low nibbles are sub-block 2c, high nibbles 2c + 1; word j holds
    # values 4j..4j+3 of both, against the int8 x words j of those sub-blocks
    s0 = b * 8 + 2 * c
    xl = xq_ptr + s0 * 8
    xh = xl + 8
    z = a0 * 0
    il = z
    ih = z
    il = _dp4a(a0 & 0x0F0F0F0F, tl.load(xl) + z, il, ASM)
    ih = _dp4a((a0 >> 4) & 0x0F0F0F0F, tl.load(xh) + z, ih, ASM)
    il = _dp4a(a1 & 0x0F0F0F0F, tl.load(xl + 1) + z, il, ASM)
    ih = _dp4a((a1 >> 4) & 0x0F0F0F0F, tl.load(xh + 1) + z, ih, ASM)
    il = _dp4a(a2 & 0x0F0F0F0F, tl.load(xl + 2) + z, il, ASM)
    ih = _dp4a((a2 >> 4) & 0x0F0F0F0F, tl.load(xh + 2) + z, ih, ASM)
    il = _dp4a(a3 & 0x0F0F0F0F, tl.load(xl + 3) + z, il, ASM)
    ih = _dp4a((a3 >> 4) & 0x0F0F0F0F, tl.load(xh + 3) + z, ih, ASM)
    il = _dp4a(a4 & 0x0F0F0F0F, tl.load(xl + 4) + z, il, ASM)
    ih = _dp4a((a4 >> 4) & 0x0F0F0F0F, tl.load(xh + 4) + z, ih, ASM)
    il = _dp4a(a5 & 0x0F0F0F0F, tl.load(xl + 5) + z, il, ASM)
    ih = _dp4a((a5 >> 4) & 0x0F0F0F0F, tl.load(xh + 5) + z, ih, ASM)
    il = _dp4a(a6 & 0x0F0F0F0F, tl.load(xl + 6) + z, il, ASM)
    ih = _dp4a((a6 >> 4) & 0x0F0F0F0F, tl.load(xh + 6) + z, ih, ASM)
    il = _dp4a(a7 & 0x0F0F0F0F, tl.load(xl + 7) + z, il, ASM)
    ih = _dp4a((a7 >> 4) & 0x0F0F0F0F, tl.load(xh + 7) + z, ih, ASM)
    d = (h0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = ((h0 >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    scl, mnl = _k4_sm(h1, h2, h3, 2 * c)
    sch, mnh = _k4_sm(h1, h2, h3, 2 * c + 1)
    dl, dh = tl.load(xd_ptr + s0), tl.load(xd_ptr + s0 + 1)
    sl, sh = tl.load(xs_ptr + s0), tl.load(xs_ptr + s0 + 1)
    return d * (scl * dl * il.to(tl.float32) + sch * dh * ih.to(tl.float32)) \
        - dmin * (mnl * sl + mnh * sh)


@triton.jit
def _q8x_kernel(wt_ptr, xq_ptr, xd_ptr, xs_ptr, y_ptr, part_ptr, cnt_ptr, N, NB, BPS,
                BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, ASM: tl.constexpr,
                PDL: tl.constexpr):
    pid, _, rows, rmask, b_lo, b_hi = _t_tile(N, NB, BPS, BLOCK_N)  # M = 1 here
    pdl.start(PDL)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for hb in range(2 * b_lo, 2 * b_hi):
        b = hb // 2
        c0 = (hb % 2) * 2
        h0, h1, h2, h3, a0, a1, a2, a3, a4, a5, a6, a7, e0, e1, e2, e3, e4, e5, e6, e7 = \
            _q4k_half_loads(wt_ptr, b, c0, rows, rmask, N)
        t = (a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7 ^ e0 ^ e1 ^ e2 ^ e3 ^ e4 ^ e5 ^ e6 ^ e7 ^ h0 ^ h1
             ^ h2 ^ h3)
        a0 = a0 + (t & (N >> 31))  # the step's loads issued together (as gemv_t)
        acc += _q8_chunk(a0, a1, a2, a3, a4, a5, a6, a7, h0, h1, h2, h3, xq_ptr, xd_ptr,
                         xs_ptr, b, c0, ASM)
        acc += _q8_chunk(e0, e1, e2, e3, e4, e5, e6, e7, h0, h1, h2, h3, xq_ptr, xd_ptr,
                         xs_ptr, b, c0 + 1, ASM)
    last = True
    if SPLIT > 1:
        last, acc = _t_split_done(part_ptr, acc, rows, rmask, cnt_ptr + pid, SPLIT, BLOCK_N)
    if last:
        tl.store(y_ptr + rows, acc.to(y_ptr.dtype.element_ty), mask=rmask)


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [cols] -> (int8 values as int32 words, scale per 32, sum of dequantized x per 32)."""
    v = x.float().view(-1, 32)
    d = v.abs().amax(-1) / 127.0
    q = torch.round(v / torch.where(d > 0, d, 1.0)[:, None]).to(torch.int8)
    xs = (q.float() * d[:, None]).sum(-1)
    return q.reshape(-1).view(torch.int32), d, xs


def gemv_q8x(wt: torch.Tensor, rows: int, xq, out: torch.Tensor, part: torch.Tensor,
             counter: torch.Tensor, config=None, asm: bool = True) -> torch.Tensor:
    q, d, s = xq
    block_n, warps, target = config or gemv_t.T_CONFIG
    nb = wt.numel() // (rows * 144)
    split = gemv_t.split_for(rows, nb, block_n, target)
    bps = triton.cdiv(nb, split)
    split = triton.cdiv(nb, bps)
    grid = (triton.cdiv(rows, block_n), split, 1)
    _q8x_kernel[grid](wt.view(torch.int32), q, d, s, out, part, counter, rows, nb, bps,
                      BLOCK_N=block_n, SPLIT=split, ASM=asm, **pdl.opts(out),
                      num_warps=warps)
    return out


def _check() -> None:
    g = torch.Generator().manual_seed(3)
    rows, cols = 40, 512
    w = random_weight(qt.Q4_K, rows, cols, "cpu", g)
    x = torch.randn(cols, generator=g)
    xq = quantize_x(x)
    xd = (xq[0].view(torch.int8).float().view(-1, 32) * xq[1][:, None]).reshape(1, -1)
    ref = quant_matmul.gemv_ref(w, qt.Q4_K, xd)[0]
    y = torch.full((rows,), float("nan"))
    part, cnt = torch.zeros(rows), torch.zeros(64, dtype=torch.int32)
    gemv_q8x(gemv_t.repack(w, qt.Q4_K), rows, xq, y, part, cnt, config=(32, 1, 4), asm=False)
    err = float((y - ref).norm() / ref.norm())
    print(f"q8x Q4_K {rows}x{cols} against the reference on int8 x: err {err:.1e}, "
          f"part/counter left {float(part.abs().max())}/{int(cnt.abs().max())}")


def main() -> None:
    if "--check" in sys.argv:
        _check()
        return
    from kernels.device_check import ROTATE, graph_time, nerr

    g = torch.Generator(device="cuda").manual_seed(5)
    for s in ((18944, 3584), (3584, 18944), (27648, 5120), (5120, 27648)):
        ws = [gemv_t.repack(random_weight(qt.Q4_K, s[0], s[1], "cuda", g), qt.Q4_K)
              for _ in range(ROTATE)]
        x = torch.randn(1, s[1], device="cuda", generator=g).to(torch.bfloat16)
        xq = quantize_x(x[0])
        xd = (xq[0].view(torch.int8).float().view(-1, 32) * xq[1][:, None]).reshape(1, -1)
        ref = quant_matmul.gemv_ref(gemv_t.unpack(ws[0], qt.Q4_K, s[0]), qt.Q4_K, xd)
        y = torch.empty(1, s[0], device="cuda", dtype=torch.bfloat16)
        part = torch.zeros(s[0], device="cuda")
        cnt = torch.zeros(4096, device="cuda", dtype=torch.int32)
        nb = ws[0].numel()
        base = graph_time(lambda i=0: gemv_t.gemv_t(ws[i % ROTATE], qt.Q4_K, s[0], x, y, part,
                                                    cnt))
        for cfg in (gemv_t.T_CONFIG, (128, 4, 2112), (512, 8, 2112)):
            gemv_q8x(ws[0], s[0], xq, y[0], part, cnt, config=cfg)
            err = nerr(y.float(), ref)
            sec = graph_time(lambda i=0, c=cfg: gemv_q8x(ws[i % ROTATE], s[0], xq, y[0], part,
                                                         cnt, config=c))
            print(f"Q4_K {s}: float T {base * 1e6:.1f} us, int8-x dp4a {cfg} {sec * 1e6:.1f} us "
                  f"({nb / sec / 1e9:.0f} GB/s, {base / sec:.2f}x) err {err:.1e}", flush=True)


if __name__ == "__main__":
    main()

"""Bytes pulled into the GPU's L2 ahead of the kernel that reads them.

Decode's launches between two FFNs (the norm, q/k/v, attention, attn_output) are bound by
their latency, not by DRAM: while they run, DRAM is mostly idle. ``prefetch`` issues sm_90's
bulk L2 prefetches (``cp.async.bulk.prefetch.L2``: the copy engine fetches a range into L2,
nothing is written, no register waits) over ``ranges`` equal byte ranges ``stride`` apart,
from a few one-warp programs that take almost no room on the SMs. The stage launches it on a
stream of its own, so that it overlaps the launches before the FFN instead of delaying them.
A prefetch changes no value; on the CPU (the interpreter) it does nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 65536  # bytes one prefetch instruction asks for (a multiple of 16)


@triton.jit
def _prefetch_kernel(ptr, stride, length, total, CHUNK: tl.constexpr, LAST: tl.constexpr):
    # piece i: bytes [c * CHUNK, min(length, (c + 1) * CHUNK)) of range r (i = r * per + c),
    # a lane each
    per = tl.cdiv(length, CHUNK)
    lane = tl.arange(0, 32)
    for i0 in range(tl.program_id(0) * 32, total, tl.num_programs(0) * 32):
        i = i0 + lane
        go = i < total
        i = tl.where(go, i, 0)
        r = i // per
        c = i - r * per
        p = ptr + (r.to(tl.int64) * stride + c.to(tl.int64) * CHUNK)
        size = tl.minimum(length - c * CHUNK, CHUNK)
        # LAST: the lines marked evict-last, kept over the streaming reads around them
        tl.inline_asm_elementwise(
            "{ .reg .pred q; .reg .b64 pol; setp.ne.s32 q, $3, 0; "
            "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
            "@q cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; "
            "mov.u32 $0, 0; }" if LAST else
            "{ .reg .pred q; setp.ne.s32 q, $3, 0; "
            "@q cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r,r", [p, size, go.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


def prefetch(t: torch.Tensor, ranges: int, stride: int, length: int, programs: int = 16,
             evict_last: bool = False) -> None:
    """Pull bytes [r * stride, r * stride + length) of ``t``'s storage into L2, for r in
    range(ranges); every offset and length a multiple of 16 bytes, t 16-byte aligned.
    ``evict_last``: with L2's evict-last cache policy. Nothing on the CPU."""
    if ranges <= 0 or length <= 0:
        return
    if t.data_ptr() % 16 or stride % 16 or length % 16:
        raise ValueError(f"L2 prefetch of {length} bytes every {stride} from "
                         f"{t.data_ptr():#x}: offsets and lengths must be multiples of 16")
    if (ranges - 1) * stride + length > t.numel() * t.element_size():
        raise ValueError(f"L2 prefetch of {ranges} ranges of {length} bytes every {stride} "
                         f"passes the end of a tensor of {t.numel() * t.element_size()} bytes")
    if not t.is_cuda:
        return
    total = ranges * triton.cdiv(length, CHUNK)
    grid = (max(1, min(programs, triton.cdiv(total, 32))),)
    _prefetch_kernel[grid](t, stride, length, total, CHUNK=CHUNK, LAST=evict_last,
                           num_warps=1)

"""A decode step's routed experts split between the GPU and the CPU, inside one CUDA graph.

For a layer whose experts live in pinned host memory, the CPU computes some of a row's routed
experts where they lie while the GPU copies the rest over PCIe and computes them. The two meet
through a few words of pinned, mapped host memory (``flags``, int32):

- ``flags[0]`` the GPU's ticket: ``publish`` copies the normed row, the CPU's share of the ids
  and weights into host memory, makes them visible to the host (a system-scope fence), then
  writes ``flags[1] + 1`` there;
- ``flags[1]`` the host's answer: the host waits for ``flags[0] != flags[1]``, computes its
  experts' weighted sum into host memory, then copies ``flags[0]`` into ``flags[1]``;
- ``flags[2]`` set to 1 by ``await_sum`` if the host did not answer within its spin budget
  (the step then goes on with whatever the sum's buffer held: the engine reports an error).

``await_sum`` (after the GPU's own experts, in the same stream) spins until the answer
matches the ticket, then adds the host's sum onto the layer's output. No host sync and no
launch from the host: the step stays one graph, which the host answers while it runs. The
protocol needs no counter on either side, so a replay, an eager step and a zeroed buffer all
keep it in step, as long as every publish is answered once (engine/runtime/gpu/host.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from carve_kernels import pdl

PUBLISH_BLOCK = 1024
AWAIT_BLOCK = 512
# volatile reads of host memory the wait makes before it gives up (each crosses PCIe, ~1 us:
# tens of seconds, far beyond any layer's CPU time, yet never a hang)
SPIN_LIMIT = 1 << 25


@triton.jit
def _fence_sys(v, ASM: tl.constexpr):
    # every write before it visible to the host (and the host's to us) before what depends on v
    if ASM:
        v = tl.inline_asm_elementwise("fence.sc.sys; mov.b32 $0, $1;", "=r,r", [v],
                                      dtype=tl.int32, is_pure=False, pack=1)
    return v


@triton.jit
def _publish_kernel(x_ptr, ids_ptr, w_ptr, hx_ptr, hids_ptr, hw_ptr, flags_ptr, E, C,
                    BLOCK: tl.constexpr, KB: tl.constexpr, ASM: tl.constexpr,
                    PDL: tl.constexpr):
    # one program: the row, the CPU's ids and weights, then the ticket
    pdl.start(PDL)  # the row and the routing are the kernels' before
    for off in range(0, E, BLOCK):
        o = off + tl.arange(0, BLOCK)
        m = o < E
        tl.store(hx_ptr + o, tl.load(x_ptr + o, mask=m), mask=m)
    kk = tl.arange(0, KB)
    mk = kk < C
    tl.store(hids_ptr + kk, tl.load(ids_ptr + kk, mask=mk), mask=mk)
    tl.store(hw_ptr + kk, tl.load(w_ptr + kk, mask=mk), mask=mk)
    tl.debug_barrier()
    ticket = _fence_sys(tl.load(flags_ptr + 1, volatile=True) + 1, ASM)
    tl.store(flags_ptr, ticket, cache_modifier=".wt")
    _fence_sys(ticket, ASM)


@triton.jit
def _await_kernel(flags_ptr, y_ptr, out_ptr, E, LIMIT, ACC: tl.constexpr, BLOCK: tl.constexpr,
                  ASM: tl.constexpr, PDL: tl.constexpr):
    pdl.start(PDL)  # out is the GPU's own experts' sum
    ticket = tl.load(flags_ptr, volatile=True)
    answer = tl.load(flags_ptr + 1, volatile=True)
    spins = 0
    while (answer != ticket) & (spins < LIMIT):
        answer = tl.load(flags_ptr + 1, volatile=True)
        spins += 1
    answer = _fence_sys(answer, ASM)
    if answer != ticket:
        tl.store(flags_ptr + 2, 1)
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < E
    y = tl.load(y_ptr + o, mask=m, volatile=True)
    if ACC:
        y += tl.load(out_ptr + o, mask=m).to(tl.float32)
    tl.store(out_ptr + o, y.to(out_ptr.dtype.element_ty), mask=m)


def publish(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, hx: torch.Tensor,
            hids: torch.Tensor, hw: torch.Tensor, flags: torch.Tensor,
            use_pdl: bool = True) -> None:
    """Hand the host one normed row ``x`` [E] and its share of the routing, ``ids`` (int32)
    and ``w`` (float32) [C] (on the device), into ``hx``, ``hids``, ``hw`` (pinned host
    memory the device can write, at least as large), then raise the ticket in ``flags``."""
    e, c = x.numel(), ids.numel()
    if hx.numel() < e or hx.dtype != x.dtype or hids.numel() < c or hw.numel() < c:
        raise ValueError("publish: the host buffers are smaller than the row, or differ in type")
    if ids.dtype != torch.int32 or w.dtype != torch.float32 or flags.dtype != torch.int32:
        raise ValueError("publish: ids int32, weights float32, flags int32")
    _publish_kernel[(1,)](x, ids, w, hx, hids, hw, flags, e, c, BLOCK=PUBLISH_BLOCK,
                          KB=triton.next_power_of_2(max(c, 2)), ASM=x.is_cuda,
                          **pdl.opts(x, use_pdl))


def await_sum(flags: torch.Tensor, y: torch.Tensor, out: torch.Tensor, accumulate: bool,
              limit: int = SPIN_LIMIT, use_pdl: bool = True) -> None:
    """Wait for the host's answer to the last ticket in ``flags``, then ``out`` (+)= ``y``
    (float32 [E], in pinned host memory the device can read)."""
    e = out.numel()
    if y.numel() < e or y.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("await_sum: the host's sum is smaller than the output, or not float32")
    _await_kernel[(triton.cdiv(e, AWAIT_BLOCK),)](flags, y, out, e, limit, ACC=accumulate,
                                                  BLOCK=AWAIT_BLOCK, ASM=out.is_cuda,
                                                  **pdl.opts(out, use_pdl))

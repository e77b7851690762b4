"""The hand-over of a decode step split between the GPU and the CPU (carve_kernels/host_split.py):
``publish`` copies a row and the CPU's share of the routing into host memory and raises the
ticket; ``await_sum`` waits for the host's answer, then adds its sum. Host memory is pinned
on a GPU, plain under the interpreter (whose launches run in order on this thread, so the
host answers between the two there)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from reference_check import DEVICE

from carve_kernels import host_split

ON_GPU = DEVICE == "cuda"


def _host(shape, dtype) -> torch.Tensor:
    t = torch.full(shape, -7, dtype=dtype)  # poisoned: what the kernels leave unwritten shows
    return t.pin_memory() if ON_GPU else t


@pytest.mark.parametrize("e,c", [(96, 3), (2048, 1), (1100, 8)])
def test_publish_hands_over_the_row_then_the_sum_is_added(seed, e, c):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(e, generator=g).to(DEVICE, torch.bfloat16)
    ids = torch.randperm(128, generator=g)[:c].to(DEVICE, torch.int32)
    w = torch.rand(c, generator=g).to(DEVICE)
    hx, hids, hw = _host((e + 5,), torch.bfloat16), _host((8,), torch.int32), _host((8,),
                                                                                     torch.float32)
    flags = _host((4,), torch.int32)
    flags[:] = torch.tensor([41, 41, 0, 0], dtype=torch.int32)  # the last ticket answered
    host_split.publish(x, ids, w, hx, hids, hw, flags)
    if ON_GPU:
        torch.cuda.synchronize()
    assert torch.equal(hx[:e], x.cpu()) and (hx[e:] == -7).all()
    assert torch.equal(hids[:c], ids.cpu()) and (hids[c:] == -7).all()
    assert torch.equal(hw[:c], w.cpu()) and (hw[c:] == -7).all()
    assert flags.tolist() == [42, 41, 0, 0]  # a new ticket, not yet answered
    y = _host((e,), torch.float32)
    y.copy_(torch.randn(e, generator=g))
    flags[1] = flags[0]  # the host's answer
    out = torch.randn(e, generator=g).to(DEVICE)
    before = out.clone()
    host_split.await_sum(flags, y, out, accumulate=True)
    assert torch.equal(out.cpu(), before.cpu() + y)
    host_split.await_sum(flags, y, out, accumulate=False)
    assert torch.equal(out.cpu(), y) and flags[2] == 0


def test_a_wait_the_host_never_answers_gives_up_and_says_so():
    flags = _host((4,), torch.int32)
    flags[:] = torch.tensor([5, 4, 0, 0], dtype=torch.int32)  # ticket 5 outstanding
    y = _host((64,), torch.float32)
    y.fill_(1.0)
    out = torch.zeros(64, device=DEVICE)
    host_split.await_sum(flags, y, out, accumulate=True, limit=50)
    if ON_GPU:
        torch.cuda.synchronize()
    assert flags[2] == 1  # the mark the engine turns into an error
    assert flags[1] == 4


def test_the_host_is_refused_buffers_too_small_for_the_row():
    x = torch.zeros(64, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.zeros(2, device=DEVICE, dtype=torch.int32)
    w = torch.zeros(2, device=DEVICE)
    flags = _host((4,), torch.int32)
    with pytest.raises(ValueError, match="smaller than the row"):
        host_split.publish(x, ids, w, _host((32,), torch.bfloat16), _host((2,), torch.int32),
                           _host((2,), torch.float32), flags)
    with pytest.raises(ValueError, match="not float32"):
        host_split.await_sum(flags, _host((64,), torch.bfloat16), x, accumulate=True)


@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU: the wait spins while the host answers")
def test_the_gpu_waits_while_the_host_answers_later():
    e = 2048
    x = torch.randn(e, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.arange(2, device=DEVICE, dtype=torch.int32)
    w = torch.ones(2, device=DEVICE)
    hx, hids, hw = _host((e,), torch.bfloat16), _host((8,), torch.int32), _host((8,),
                                                                               torch.float32)
    flags, y = _host((4,), torch.int32), _host((e,), torch.float32)
    flags.zero_()
    out = torch.zeros(e, device=DEVICE)

    def answer():
        f = flags.numpy()
        while f[0] == f[1]:
            pass
        time.sleep(0.05)  # the GPU spins meanwhile
        y.copy_(hx.float() * 2)
        f[1] = f[0]

    t = threading.Thread(target=answer)
    t.start()
    host_split.publish(x, ids, w, hx, hids, hw, flags)
    host_split.await_sum(flags, y, out, accumulate=True)
    torch.cuda.synchronize()
    t.join()
    assert torch.equal(out.cpu(), x.float().cpu() * 2) and flags[2] == 0

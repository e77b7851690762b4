"""The native kernel's answer to a decode step's split layers (native_experts.c's
carve_serve, through `cpu_native.StepServer`): a thread here plays the GPU's side of
carve_kernels/host_split.py (the row, the ids and weights, then the ticket; it waits for the
answer, then reads the sum), the server answers every layer in turn. Against each layer's
`NativeExperts.run` on the same row: the same sums, bit for bit."""

import threading

import numpy as np
import pytest
import torch

from carve_kernels.random_blocks import random_weight
from engine.runtime.models import cpu_native
from spec import quant_types as qt
from spec.errors import CarveError

LIB = cpu_native.library()
pytestmark = pytest.mark.skipif(LIB is None, reason="no C compiler to build the native kernel")

N_EXPERT, N_EMBD, N_FF, K = 6, 256, 256, 4


def _layer(types, seed, biases=False):
    g = torch.Generator().manual_seed(seed)
    mats = [random_weight(types[0], N_EXPERT * N_FF, N_EMBD, generator=g, scale=0.02),
            random_weight(types[1], N_EXPERT * N_FF, N_EMBD, generator=g, scale=0.02),
            random_weight(types[2], N_EXPERT * N_EMBD, N_FF, generator=g, scale=0.02)]
    b = ([torch.randn(N_EXPERT, N_FF, generator=g) * 0.1 for _ in range(2)]
         + [torch.randn(N_EXPERT, N_EMBD, generator=g) * 0.1]) if biases else None
    return cpu_native.NativeExperts(LIB, [m.view(-1) for m in mats], types, N_EMBD, N_FF,
                                    N_EXPERT, K, "silu", 7.0 if biases else 0.0, b)


class Words:
    """The stage's transfer buffers and ticket words, as the plan's hbuf spans hold them."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.x = torch.zeros(N_EMBD, dtype=dtype)
        self.ids = torch.zeros(K, dtype=torch.int32)
        self.w = torch.zeros(K)
        self.y = torch.zeros(N_EMBD)
        self.xf = torch.zeros(N_EMBD)
        self.flags = torch.zeros(4, dtype=torch.int32)


def _gpu(words: Words, rows, steps: int, got: list, stop: threading.Event) -> None:
    """The GPU's side: per step, per layer, publish (row, ids, weights, then the ticket), wait
    for the answer, take the sum."""
    f = words.flags.numpy()
    for _ in range(steps):
        for x, ids, w in rows:
            words.x.copy_(x)
            words.ids[:len(ids)] = torch.tensor(ids, dtype=torch.int32)
            words.w[:len(w)] = torch.tensor(w)
            f[0] = f[1] + 1
            while f[1] != f[0]:
                # told to stop: give up only if the answer has not come (it may have come
                # between the loop's check and this one, as the server raised after answering)
                if stop.is_set() and f[1] != f[0]:
                    return
            got.append(words.y.clone())


@pytest.mark.parametrize(("dtype", "types", "biases"), [
    (torch.bfloat16, (qt.Q4_K, qt.Q4_K, qt.Q6_K), False),
    (torch.float16, (qt.IQ2_XXS, qt.IQ2_XXS, qt.IQ3_S), False),
    (torch.float32, (qt.MXFP4, qt.MXFP4, qt.MXFP4), True)])
def test_a_step_of_split_layers_answered_in_one_call(dtype, types, biases):
    layers = [_layer(types, s, biases) for s in range(3)]
    shares = [2, 1, 3]  # each layer's CPU share of the row's experts
    words = Words(dtype)
    g = torch.Generator().manual_seed(9)
    rows = [(torch.randn(N_EMBD, generator=g).to(dtype),
             torch.randperm(N_EXPERT, generator=g)[:c].tolist(), torch.rand(c, generator=g).tolist())
            for c in shares]
    waits, cpus = [0.0] * 3, [0.0] * 3

    def report(i, wait_s, cpu_s):
        waits[i] += wait_s
        cpus[i] += cpu_s

    server = cpu_native.StepServer(
        LIB, [ne.serve_layer(words.flags, words.x, words.ids, words.w, words.y, words.xf, c)
              for ne, c in zip(layers, shares, strict=True)], [words.xf], report)
    got, stop = [], threading.Event()
    steps = 3
    gpu = threading.Thread(target=_gpu, args=(words, rows, steps, got, stop))
    gpu.start()
    try:
        for _ in range(steps):
            server.serve(timeout_s=30.0, threads=2)
    finally:
        stop.set()
        gpu.join()
    assert len(got) == steps * len(layers)
    f = words.flags.numpy()
    assert f[0] == f[1] == steps * len(layers) and f[2] == 0
    for i, (ne, (x, ids, w)) in enumerate(zip(layers * steps, rows * steps, strict=True)):
        want = torch.full((N_EMBD,), float("nan"))
        ne.run(x.float(), torch.tensor(ids, dtype=torch.int32), torch.tensor(w), want,
               threads=1)
        assert torch.isfinite(want).all()
        assert torch.equal(got[i], want), f"layer {i % len(layers)}, step {i // len(layers)}"
    assert all(c > 0 for c in cpus) and all(t >= 0 for t in waits)


def test_no_ticket_times_out_and_says_so():
    words = Words(torch.bfloat16)
    server = cpu_native.StepServer(
        LIB, [_layer((qt.Q4_K,) * 3, 0).serve_layer(words.flags, words.x, words.ids, words.w,
                                                    words.y, words.xf, 2)],
        [words.xf], lambda *a: None)
    with pytest.raises(CarveError, match="did not publish its row within 0 s"):
        server.serve(timeout_s=0.2, threads=2)
    assert words.flags.tolist() == [0, 0, 0, 0]  # nothing answered


def test_an_id_out_of_range_is_answered_with_nan_and_named():
    words = Words(torch.float32)
    layers = [_layer((qt.Q4_K,) * 3, s) for s in range(2)]
    server = cpu_native.StepServer(
        LIB, [ne.serve_layer(words.flags, words.x, words.ids, words.w, words.y, words.xf, 2)
              for ne in layers], [words.xf], lambda *a: None)
    rows = [(torch.randn(N_EMBD), [1, N_EXPERT], [0.5, 0.5])]  # the first layer's row
    got, stop = [], threading.Event()
    gpu = threading.Thread(target=_gpu, args=(words, rows, 1, got, stop))
    gpu.start()
    try:
        with pytest.raises(CarveError, match="split layer 0 .*id beyond"):
            server.serve(timeout_s=30.0, threads=2)
    finally:
        stop.set()
        gpu.join()
    assert len(got) == 1 and torch.isnan(got[0]).all()  # answered, so the GPU goes on
    assert np.array_equal(words.flags.numpy()[:2], [1, 1])


def test_refuses_buffers_that_do_not_fit():
    words = Words(torch.int32)
    with pytest.raises(ValueError, match="buffers or share"):
        _layer((qt.Q4_K,) * 3, 0).serve_layer(words.flags, words.x, words.ids, words.w,
                                              words.y, words.xf, 2)
    words = Words(torch.bfloat16)
    with pytest.raises(ValueError, match="buffers or share"):
        _layer((qt.Q4_K,) * 3, 0).serve_layer(words.flags, words.x, words.ids, words.w,
                                              words.y, words.xf, K + 1)

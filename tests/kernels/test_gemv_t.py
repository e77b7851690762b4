"""The T-layout GEMV (kernels/gemv_t.py) against the torch reference on the GGUF bytes it was
repacked from: fresh random shapes and inputs each run, outputs poisoned with NaN, split and
unsplit rows, both bodies; the split's part buffer and counters must be left at zero."""

from __future__ import annotations

import pytest
import torch

from engine import quant_types as qt
from kernels import gemv_t, glu, quant_matmul
from kernels.random_blocks import random_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gen() -> torch.Generator:
    g = torch.Generator(device=DEVICE)
    g.seed()
    return g


def _nerr(y: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(y).all(), "kernel left non-finite values (unwritten or NaN)"
    ref = ref.double()
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _rand(g, lo, hi):
    return int(torch.randint(lo, hi, (1,), generator=g, device=DEVICE))


TYPES = [qt.Q4_K, qt.Q6_K]


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_repack_is_a_permutation_of_the_bytes(ggml_type):
    g = _gen()
    rows, nb = _rand(g, 1, 40), _rand(g, 1, 5)
    bb, wd = gemv_t.BLOCK_BYTES[ggml_type], gemv_t.WORDS[ggml_type]
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    t = gemv_t.repack(w, ggml_type)
    assert t.numel() == w.numel()  # same bytes: the price does not change
    assert torch.equal(gemv_t.unpack(t, ggml_type, rows), w)
    # word u of block b of row n sits at T[b, u, n]; the tail in its own plane after them
    b, n = _rand(g, 0, nb), _rand(g, 0, rows)
    words = t[: nb * wd * rows * 4].view(nb, wd, rows, 4)
    blk = w[n, b * bb:(b + 1) * bb]
    assert torch.equal(words[b, :, n].reshape(-1), blk[: wd * 4])
    if gemv_t.TAIL[ggml_type]:
        tail = t[nb * wd * rows * 4:].view(nb, rows, -1)
        assert torch.equal(tail[b, n], blk[wd * 4:])
    # slab by slab, as the loader fills it
    out = torch.zeros_like(t)
    cut = _rand(g, 0, rows + 1)
    gemv_t.repack(w[:cut], ggml_type, out=out, rows=slice(0, cut))
    gemv_t.repack(w[cut:], ggml_type, out=out, rows=slice(cut, rows))
    assert torch.equal(out, t)


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemv_t_matches_reference(ggml_type, split, xdtype):
    g = _gen()
    m = _rand(g, 1, 3)
    rows = _rand(g, 1, 70)
    nb = _rand(g, 1, 4)
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    wt = gemv_t.repack(w, ggml_type)
    x = torch.randn(m, 256 * nb, generator=g, device=DEVICE).to(xdtype)
    bias = torch.randn(rows, generator=g, device=DEVICE) if _rand(g, 0, 2) else None
    block_n = 32
    tiles = -(-rows // block_n)
    # target programs: one per row tile (no split) or enough to split every row's blocks
    config = (block_n, 1, tiles * (nb if split else 1))
    part = torch.zeros(m, rows, device=DEVICE)
    counter = torch.zeros(m, tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, rows), float("nan"), device=DEVICE)
    gemv_t.gemv_t(wt, ggml_type, rows, x, out, part, counter, bias=bias, config=config)
    ref = quant_matmul.gemv_ref(w, ggml_type, x.float(), bias=bias)
    assert _nerr(out, ref) < 1e-5
    assert not part.any() and not counter.any()  # left ready for the next call
    # and the twin computes the same from the repacked bytes
    twin = torch.empty_like(out)
    gemv_t.gemv_t_ref(wt, ggml_type, rows, x.float(), twin, part, counter, bias=bias)
    assert _nerr(twin, ref) < 1e-6


def test_split_count_covers_the_blocks():
    for rows, nb, block_n, target in ((18944, 14, 256, 1056), (3584, 74, 256, 1056),
                                      (7, 3, 32, 1), (100, 1, 32, 1000)):
        s = gemv_t.split_for(rows, nb, block_n, target)
        assert 1 <= s <= nb


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("paired", [True, False])
def test_gemv_t_glu_matches_reference(ggml_type, act, split, paired):
    # paired: Q4_K's gate and up in the same steps (bf16 x); else one after the other (f32 x)
    g = _gen()
    m, rows, nb = _rand(g, 1, 3), _rand(g, 1, 50), _rand(g, 1, 4)
    gate = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    up = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    x = torch.randn(m, 256 * nb, generator=g, device=DEVICE)
    if paired:
        x = x.to(torch.bfloat16)
    tiles = -(-rows // 32)
    part = torch.zeros(m, 2, rows, device=DEVICE)
    counter = torch.zeros(m, tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, rows), float("nan"), device=DEVICE)
    gemv_t.gemv_t_glu(gemv_t.repack(gate, ggml_type), gemv_t.repack(up, ggml_type), ggml_type,
                      rows, x, out, part, counter, act,
                      config=(32, 1, tiles * (nb if split else 1)), paired=paired)
    ref = glu.glu_ref(quant_matmul.gemv_ref(gate, ggml_type, x.float()),
                      quant_matmul.gemv_ref(up, ggml_type, x.float()), act)
    assert _nerr(out, ref) < 1e-5
    assert not part.any() and not counter.any()


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_unpack_rows_gives_the_gguf_rows_back(ggml_type):
    g = _gen()
    rows, nb = _rand(g, 2, 40), _rand(g, 1, 4)
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    t = gemv_t.repack(w, ggml_type)
    r0 = _rand(g, 0, rows - 1)
    r1 = _rand(g, r0 + 1, rows + 1)
    out = torch.zeros(w.numel() + 7, dtype=torch.uint8, device=DEVICE)
    assert torch.equal(gemv_t.unpack_rows(t, ggml_type, rows, r0, r1, out), w[r0:r1])


def test_bad_buffers_and_types_are_refused():
    g = _gen()
    w = random_weight(qt.Q4_K, 64, 512, DEVICE, g)
    t = gemv_t.repack(w, qt.Q4_K)
    x = torch.randn(1, 512, device=DEVICE)
    out = torch.empty(1, 64, device=DEVICE)
    small = torch.zeros(3, device=DEVICE)
    cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="too small"):
        gemv_t.gemv_t(t, qt.Q4_K, 64, x, out, small, cnt, config=(32, 1, 4))
    with pytest.raises(ValueError, match="no T layout"):
        gemv_t.gemv_t(t, qt.Q8_0, 64, x, out, small, cnt)
    with pytest.raises(ValueError, match="whole blocks"):
        gemv_t.gemv_t(t[:-4], qt.Q4_K, 64, x, out, small, cnt)

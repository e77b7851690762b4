"""The int8-x decode path (carve_kernels/q8x.py): RMSNorm and the GLU epilogue write x's int8 copy
as the reference quantizes it, and the T-layout GEMVs (every type of carve_kernels/gemv_t.py WORDS)
multiply it (dp4a, emulated under the interpreter) to the reference GEMV on the dequantized
int8 x. Fresh random inputs each run (the seed is printed on failure), errors against the
products' magnitudes (reference_check.py), outputs and split buffers poisoned with NaN,
counters left at zero."""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, gemv_scale, generator, glu_scale, nerr, q8_bufs

from carve_kernels import (
    gemv_q8,
    gemv_t,
    glu,
    moe_decode,
    moe_decode_q8,
    norm,
    q8x,
    quant_matmul,
    t_layout,
)
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt


def _rand(g, lo, hi):
    return int(torch.randint(lo, hi, (1,), generator=g, device=DEVICE))


def _same_q8(got, x: torch.Tensor) -> None:
    # the kernel's copy of x as the reference quantizes it (one step of q apart at most where
    # a value sits on a rounding edge and the GPU fused its multiply-add)
    q, d, s = got
    rq, rd, rs = q8x.quantize_ref(x)
    torch.testing.assert_close(d, rd, rtol=1e-6, atol=0)
    assert (q.view(torch.int8).int() - rq.int()).abs().max() <= 1
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4 * float(rd.max()) * 32)


@pytest.mark.parametrize("residual", [True, False])
def test_rmsnorm_writes_the_int8_copy(residual, seed):
    g = generator(seed)
    h = 32 * _rand(g, 1, 40)
    x = torch.randn(1, h, generator=g, device=DEVICE)
    r = torch.randn(1, h, generator=g, device=DEVICE) if residual else None
    w = torch.randn(h, generator=g, device=DEVICE)
    want = norm.rmsnorm_ref(x, w, 1e-6, residual=None if r is None else r.clone())
    out = torch.full_like(x, float("nan"))
    bufs = q8_bufs(h)
    norm.rmsnorm(x, w, 1e-6, residual=r, out=out, q8=bufs)
    assert nerr(out, want) < 1e-6
    _same_q8(bufs, out[0])


TYPES = [qt.Q4_K, qt.Q5_K, qt.Q6_K, qt.Q2_K, qt.Q3_K, qt.IQ4_XS, qt.IQ1_S, qt.IQ1_M,
         qt.IQ2_XXS, qt.IQ2_XS, qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S, qt.Q8_0]


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
@pytest.mark.parametrize("split", [True, False])
def test_gemv_t_on_int8_x_matches_reference(ggml_type, split, seed):
    g = generator(seed)
    rows, nb = _rand(g, 1, 70), _rand(g, 1, 4)
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    x = torch.randn(1, 256 * nb, generator=g, device=DEVICE)
    xq, xd = q8x.copy_ref(x[0])
    tiles = -(-rows // 32)
    part = torch.full((nb * rows,), float("nan"), device=DEVICE)
    counter = torch.zeros(tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, rows), float("nan"), device=DEVICE)
    gemv_t.gemv_t(t_layout.repack(w, ggml_type), ggml_type, rows, x, out, part, counter,
                  config=(32, 1, tiles * (nb if split else 1)), xq=xq)
    ref = quant_matmul.gemv_ref(w, ggml_type, xd)
    assert nerr(out, ref, gemv_scale(w, ggml_type, xd)) < 1e-5
    assert not counter.any()


@pytest.mark.parametrize("ggml_type,paired", [(qt.Q4_K, True), (qt.Q4_K, False),
                                              (qt.Q5_K, True), (qt.Q6_K, False), (qt.Q2_K, False), (qt.Q3_K, False),
                                              (qt.IQ4_XS, False), (qt.IQ2_XXS, False),
                                              (qt.IQ3_S, False)])
@pytest.mark.parametrize("split", [True, False])
def test_glu_on_int8_x_writes_the_int8_copy_of_its_output(ggml_type, paired, split, seed):
    g = generator(seed)
    rows, nb = 32 * _rand(g, 1, 4), _rand(g, 1, 4)
    gate = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    up = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    x = torch.randn(1, 256 * nb, generator=g, device=DEVICE)
    xq, xd = q8x.copy_ref(x[0])
    tiles = -(-rows // 32)
    part = torch.full((2 * nb * rows,), float("nan"), device=DEVICE)
    counter = torch.zeros(tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, rows), float("nan"), device=DEVICE)
    oq = q8_bufs(rows)
    gemv_t.gemv_t_glu(t_layout.repack(gate, ggml_type), t_layout.repack(up, ggml_type), ggml_type,
                      rows, x, out, part, counter, "silu",
                      config=(32, 1, tiles * (nb if split else 1)), paired=paired, xq=xq,
                      out_q=oq)
    g_ref = quant_matmul.gemv_ref(gate, ggml_type, xd)
    u_ref = quant_matmul.gemv_ref(up, ggml_type, xd)
    scale = glu_scale(g_ref, u_ref, "silu", gemv_scale(gate, ggml_type, xd),
                      gemv_scale(up, ggml_type, xd))
    assert nerr(out, glu.glu_ref(g_ref, u_ref, "silu"), scale) < 1e-5
    _same_q8(oq, out[0])
    assert not counter.any()


def test_an_int8_copy_too_small_for_the_row_is_refused_before_any_launch():
    # the GEMVs check the copy they are handed against x's row (q8x.usable): too few words or
    # scales is a ValueError naming the row, never a read past the buffers; two rows of x (or
    # no copy) read x itself
    x = torch.randn(1, 512, device=DEVICE)
    (q, d, s), _ = q8x.copy_ref(x[0])
    assert q8x.usable((q, d, s), x)
    assert not q8x.usable((q, d, s), torch.randn(2, 512, device=DEVICE))
    assert not q8x.usable(None, x)
    for short in ((q[:64], d, s), (q, d[:8], s), (q, d, s[:15])):
        with pytest.raises(ValueError, match="too small for a row of 512"):
            q8x.usable(short, x)
    w = random_weight(qt.Q2_K, 32, 512, DEVICE, generator(0))
    part = torch.zeros(2 * 32, device=DEVICE)
    counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, 32), float("nan"), device=DEVICE)
    with pytest.raises(ValueError, match="too small"):
        gemv_t.gemv_t(t_layout.repack(w, qt.Q2_K), qt.Q2_K, 32, x, out, part, counter,
                      config=(32, 1, 1), xq=(q[:64], d, s))
    assert torch.isnan(out).all()  # nothing ran


def test_int8_x_is_refused_where_it_cannot_go():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="int8 copy"):
        norm.rmsnorm(x, torch.ones(64, device=DEVICE), 1e-6, q8=q8_bufs(64))  # two rows
    with pytest.raises(ValueError, match="whole groups"):
        q8x.buffers(torch.zeros(8, dtype=torch.int32), torch.zeros(2, 4), 40)
    # MXFP4's body reads the aligned words around its 17-byte blocks: a tensor starting off a
    # 4-byte boundary is refused before anything is read
    g = generator(0)
    raw = random_weight(qt.MXFP4, 2 * 32 + 1, 64, DEVICE, g).reshape(-1)
    gate = raw[34:34 + 2 * 32 * 34].view(2 * 32, 34)  # 34 bytes in: 2-byte aligned
    xq, _ = q8x.copy_ref(torch.randn(64, device=DEVICE))
    ids = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="4-byte aligned"):
        moe_decode_q8.expert_glu_q8(gate, qt.MXFP4, gate, qt.MXFP4, 2, xq, ids,
                                    torch.empty(1, 32, device=DEVICE))


@pytest.mark.parametrize("gate_type,down_type", [(qt.Q4_K, qt.Q6_K), (qt.Q4_K, qt.Q4_K),
                                                 (qt.Q6_K, qt.Q6_K), (qt.MXFP4, qt.MXFP4),
                                                 (qt.Q3_K, qt.Q3_K), (qt.Q5_0, qt.Q5_0),
                                                 (qt.Q3_K, qt.Q5_0), (qt.IQ4_NL, qt.IQ4_NL),
                                                 (qt.Q3_K, qt.IQ4_NL), (qt.Q8_0, qt.Q8_0),
                                                 (qt.Q4_K, qt.Q8_0)],
                         ids=lambda t: qt.type_name(t))
def test_expert_gemvs_on_int8_x_match_reference(gate_type, down_type, seed, monkeypatch):
    # decode's routed experts in GGUF order on the int8 copies (carve_kernels/gemv_q8.py): gate/up
    # of the chosen experts on x's copy writing the int8 copy of their GLU outputs, then down
    # on that copy, each against the reference GEMV on the dequantized int8 input; MXFP4 as
    # gpt-oss runs it (biases, the clamped SwiGLU, an odd number of 32-value blocks a row);
    # IQ4_NL's is on trial (CARVE_TRIAL=iq4nl_experts)
    monkeypatch.setattr(moe_decode_q8, "Q8_ON_TRIAL",
                        frozenset(t for ts in gemv_q8.Q8_TRIAL_TYPES.values() for t in ts))
    g = generator(seed)
    n_expert, k, n_ff = 5, 3, 32 * _rand(g, 1, 3)
    qk = gemv_q8.Q8_BLOCK[gate_type]
    nb = _rand(g, 1, 4) if qk == 256 else 2 * _rand(g, 1, 6) + 1
    cols = qk * nb
    gate = random_weight(gate_type, n_expert * n_ff, cols, DEVICE, g)
    up = random_weight(gate_type, n_expert * n_ff, cols, DEVICE, g)
    # down's input: the GLU output's width where its type has blocks of 32 (gpt-oss: 1..3 a
    # row here), else n_ff * 8, rows of whole 256-value blocks
    k2 = n_ff * 8 if gemv_q8.Q8_BLOCK[down_type] == 256 else n_ff
    down = random_weight(down_type, n_expert * cols, k2, DEVICE, g)
    oai = gate_type == qt.MXFP4
    act, limit = ("swiglu_oai", 7.0) if oai else ("silu", 0.0)
    gb, ub, db = (torch.randn(n_expert * r, generator=g, device=DEVICE) * 0.1 if oai else None
                  for r in (n_ff, n_ff, cols))
    x = torch.randn(1, cols, generator=g, device=DEVICE)
    xq, xd = q8x.copy_ref(x[0])
    ids = torch.randperm(n_expert, generator=g, device=DEVICE)[:k].view(1, k).to(torch.int32)
    h = torch.full((k, n_ff), float("nan"), device=DEVICE)
    hq = q8_bufs(k * n_ff)
    # 32 rows a program over 1..2 tiles per expert (the last one partly past the rows)
    moe_decode_q8.expert_glu_q8(gate, gate_type, up, gate_type, n_expert, xq, ids, h, act, gb,
                                ub, limit, out_q=hq, config=(32, 2, 1))
    ref = moe_decode.expert_glu_ref(gate, gate_type, up, gate_type, n_expert, xd, ids,
                                    torch.empty(k, n_ff, device=DEVICE), act, gb, ub, limit)
    assert nerr(h, ref) < 1e-5
    for j in range(k):
        grp = slice(j * n_ff // 32, (j + 1) * n_ff // 32)
        _same_q8((hq[0][j * n_ff // 4:(j + 1) * n_ff // 4], hq[1][grp], hq[2][grp]), h[j])
    hx = torch.randn(k, k2, generator=g, device=DEVICE)
    hq2, hd = q8_bufs(k * k2), []
    for j in range(k):
        (q, d, s), f = q8x.copy_ref(hx[j])
        hq2[0][j * k2 // 4:(j + 1) * k2 // 4] = q
        hq2[1][j * k2 // 32:(j + 1) * k2 // 32] = d
        hq2[2][j * k2 // 32:(j + 1) * k2 // 32] = s
        hd.append(f[0])
    hd = torch.stack(hd)
    wts = torch.rand(1, k, generator=g, device=DEVICE)
    prior = torch.randn(1, cols, generator=g, device=DEVICE)
    counter = torch.zeros(cols // 16, dtype=torch.int32, device=DEVICE)
    # the k rows summed by combine, or by each row tile's last program (counter; tiles of 32
    # rows, and of 16 as Q6_K's down runs them)
    for accumulate, fused, tile in ((False, False, 32), (True, False, 32), (False, True, 16),
                                    (True, True, 32)):
        out = prior.clone() if accumulate else torch.full((1, cols), float("nan"), device=DEVICE)
        moe_decode_q8.expert_down_q8(down, down_type, n_expert, hq2, ids, wts, out,
                                     torch.full((k, cols), float("nan"), device=DEVICE), db,
                                     accumulate=accumulate, config=(tile, 2, 1),
                                     counter=counter if fused else None)
        assert not counter.any()
        want = moe_decode.expert_down_ref(down, down_type, n_expert, hd, ids, wts, prior.clone(),
                                          db, accumulate=accumulate)
        mag = sum(wts[0, j] * gemv_scale(down[int(ids[0, j]) * cols:(int(ids[0, j]) + 1) * cols],
                                         down_type, hd[j:j + 1])[0] for j in range(k))
        assert nerr(out, want, mag + (prior.abs() if accumulate else 0)) < 1e-5


@pytest.mark.parametrize("bias", [False, True], ids=["plain", "bias"])
def test_expert_gate_up_split_along_the_blocks_matches_reference(bias, seed):
    # decode's Q4_K expert gate/up with each row's blocks in 2-3 programs (decode's GLU_SPLIT):
    # the partial sums in the T GEMVs' scratch, added in split order by each tile's last
    # split, which runs the activation and the int8 copy; every counter left zero. Splits of
    # uneven length (bps not dividing the blocks) and more splits than blocks (clamped); a
    # scratch too small for the split runs the tile unsplit (the scratch untouched)
    g = generator(seed)
    n_expert, k, n_ff = 5, 3, 32 * _rand(g, 1, 3)
    nb = _rand(g, 2, 5)
    cols = 256 * nb
    gate = random_weight(qt.Q4_K, n_expert * n_ff, cols, DEVICE, g)
    up = random_weight(qt.Q4_K, n_expert * n_ff, cols, DEVICE, g)
    gb, ub = (torch.randn(n_expert * n_ff, generator=g, device=DEVICE) * 0.1 if bias else None
              for _ in range(2))
    x = torch.randn(1, cols, generator=g, device=DEVICE)
    xq, xd = q8x.copy_ref(x[0])
    ids = torch.randperm(n_expert, generator=g, device=DEVICE)[:k].view(1, k).to(torch.int32)
    ref = moe_decode.expert_glu_ref(gate, qt.Q4_K, up, qt.Q4_K, n_expert, xd, ids,
                                    torch.empty(k, n_ff, device=DEVICE), "silu", gb, ub)
    tiles = -(-n_ff // 32)
    for split, room in ((2, True), (3, True), (nb + 2, True), (2, False)):
        used = -(-nb // -(-nb // min(split, nb)))  # whole ranges of ceil(nb / split) blocks
        part = torch.full((k * 2 * used * n_ff - (0 if room else 1),), float("nan"),
                          device=DEVICE)
        count = torch.zeros(k * tiles, dtype=torch.int32, device=DEVICE)
        h = torch.full((k, n_ff), float("nan"), device=DEVICE)
        hq = q8_bufs(k * n_ff)
        moe_decode_q8.expert_glu_q8(gate, qt.Q4_K, up, qt.Q4_K, n_expert, xq, ids, h, "silu",
                                    gb, ub, out_q=hq, config=(32, 1, 1), scratch=(part, count),
                                    split=split)
        assert nerr(h, ref) < 1e-5, (split, room)
        assert part.isnan().all() != room  # split: the partial sums were written
        assert not count.any()
        for j in range(k):
            grp = slice(j * n_ff // 32, (j + 1) * n_ff // 32)
            _same_q8((hq[0][j * n_ff // 4:(j + 1) * n_ff // 4], hq[1][grp], hq[2][grp]), h[j])

"""The mixture-of-experts kernels (carve_kernels/moe.py, moe_decode.py, moe_prefill.py) against
their plain-torch twins: router, routing under each gating rule, decode's expert GEMVs (every GPU
type, MXFP4 included, gpt-oss's biases and clamped SwiGLU), prefill's sort by expert, grouped
GEMMs and combine. Fresh random inputs each run, outputs poisoned first; tiny shapes under the
interpreter without a GPU."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from reference_check import DEVICE, gemv_scale, generator, nerr, poison

from carve_kernels import moe, moe_decode, moe_prefill, quant_matmul
from carve_kernels.quant_blocks import PLANS
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt
from spec.launch import MOE_TILE_ROWS, moe_tiles


def _experts(t: int, n_expert: int, rows: int, cols: int, g) -> torch.Tensor:
    # a 3-D expert tensor as the runner holds it: [experts * rows, row_bytes]
    return random_weight(t, n_expert * rows, cols, DEVICE, g)


def _ids(m: int, k: int, n_expert: int, g) -> torch.Tensor:
    return torch.stack([torch.randperm(n_expert, generator=g, device=DEVICE)[:k]
                        for _ in range(m)]).to(torch.int32)


def _block(t: int) -> int:
    return PLANS[t].block if PLANS[t].block > 32 else 64


def test_mxfp4_dequantize_is_bit_exact(seed):
    g = generator(seed)
    w = random_weight(qt.MXFP4, 6, 96, DEVICE, g)  # 3 blocks: odd 51-byte rows
    ref = gguf.quants.dequantize(w.cpu().numpy(), gguf.GGMLQuantizationType.MXFP4)
    out = poison((6, 96))
    quant_matmul.dequantize(w, qt.MXFP4, torch.float32, out=out)
    assert torch.equal(out.cpu(), torch.from_numpy(np.ascontiguousarray(ref)))


def test_router_matches_reference(seed):
    g = generator(seed)
    w = torch.randn(12, 96, generator=g, device=DEVICE)
    b = torch.randn(12, generator=g, device=DEVICE)
    for m in (3, 37):  # the decode GEMV and the prefill GEMM
        x = torch.randn(m, 96, generator=g, device=DEVICE)
        for bias in (None, b):
            out = poison((m, 12))
            moe.router(w, x, bias, out=out)
            mag = x.abs() @ w.abs().T + (0 if bias is None else bias.abs())
            assert nerr(out, moe.router_ref(w, x, bias), mag) < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_norm_router_is_the_norm_then_the_router(dtype, seed):
    # decode's FFN norm and router in one launch (a program per expert, each on its own copy of
    # the row): the stream written back as the norm writes it, the normed row and its int8 copy
    # as the norm writes them, the logits of the stored normed row; the counter left zero
    from carve_kernels import norm, q8x

    g = generator(seed)
    h, e = 32 * (2 + seed % 5), 11
    x = torch.randn(1, h, generator=g, device=DEVICE).to(dtype)
    res = torch.randn(1, h, generator=g, device=DEVICE).to(dtype)
    nw = torch.randn(h, generator=g, device=DEVICE).to(dtype)
    w = torch.randn(e, h, generator=g, device=DEVICE)
    b = torch.randn(e, generator=g, device=DEVICE)
    want_res, want_y = res.clone(), torch.empty_like(x)
    qw = (torch.zeros(h // 4, dtype=torch.int32, device=DEVICE),
          *torch.zeros(2, h // 32, device=DEVICE))
    norm.rmsnorm(x, nw, 1e-6, residual=want_res, out=want_y, q8=qw)
    counter = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    for bias in (None, b):
        r, y, lg = res.clone(), poison((1, h)).to(dtype), poison((1, e))
        q = (torch.zeros(h // 4, dtype=torch.int32, device=DEVICE),
             *torch.zeros(2, h // 32, device=DEVICE))
        moe.norm_router(x, r, nw, 1e-6, w, bias, y, lg, counter, q8=q)
        assert torch.equal(r, want_res)  # the stream moved on once, rounded as stored
        assert nerr(y, want_y) < 1e-6
        assert nerr(q8x.dequantize_ref(q[0].view(torch.int8), q[1]),
                    q8x.dequantize_ref(qw[0].view(torch.int8), qw[1])) < 1e-2
        ref = moe.router_ref(w, want_y, bias)
        mag = want_y.float().abs() @ w.abs().T + (0 if bias is None else bias.abs())
        assert nerr(lg, ref, mag) < 1e-6
        assert int(counter.abs().sum()) == 0
    with pytest.raises(ValueError, match="one row"):
        moe.norm_router(torch.zeros(2, h, device=DEVICE), r, nw, 1e-6, w, None, y, lg, counter)


@pytest.mark.parametrize("gating", ["softmax", "softmax_topk", "sigmoid"])
@pytest.mark.parametrize("e,k", [(12, 3), (72, 8)])
def test_route_matches_reference(gating, e, k, seed):
    g = generator(seed)
    m = 5
    logits = torch.randn(m, e, generator=g, device=DEVICE) * 3
    sb = torch.randn(e, generator=g, device=DEVICE) if gating == "sigmoid" else None
    for norm, scale in ((False, 1.0), (True, 2.5)):
        ids = torch.full((m, k), -7, dtype=torch.int32, device=DEVICE)
        wts = poison((m, k))
        moe.route(logits, k, gating, norm, scale, sb, ids, wts)
        rid, rw = moe.route_ref(logits, k, gating, norm, scale, sb)
        assert torch.equal(ids, rid)
        assert nerr(wts, rw) < 1e-6
    if gating == "sigmoid":  # the bias changes the choice, never the weights' values
        moe.route(logits, k, gating, ids=ids, weights=wts)
        plain = torch.sigmoid(logits).gather(1, ids.long())
        assert nerr(wts, plain) < 1e-6


def test_softmax_route_selects_by_its_bias(seed):
    # ERNIE-4.5: the top k of softmax + selection bias, weighed by the plain softmax values
    # (normalised); the bias moves the choice on some rows and never a weight's value
    g = generator(seed)
    m, e, k = 16, 12, 3
    logits = torch.randn(m, e, generator=g, device=DEVICE)
    sb = torch.randn(e, generator=g, device=DEVICE) * 0.1
    ids = torch.full((m, k), -7, dtype=torch.int32, device=DEVICE)
    wts = poison((m, k))
    moe.route(logits, k, "softmax", True, 1.0, sb, ids, wts)
    rid, rw = moe.route_ref(logits, k, "softmax", True, 1.0, sb)
    assert torch.equal(ids, rid) and nerr(wts, rw) < 1e-6
    probs = torch.softmax(logits.float(), -1)
    want = torch.topk(probs + sb, k, dim=-1).indices
    assert torch.equal(ids.long().sort(-1).values, want.sort(-1).values)
    picked = probs.gather(1, ids.long())
    assert nerr(wts, picked / picked.sum(-1, keepdim=True)) < 1e-6
    plain, _ = moe.route(logits, k, "softmax", True)
    assert not torch.equal(plain, ids)


def test_route_ties_pick_the_lower_id():
    logits = torch.zeros(1, 8, device=DEVICE)
    logits[0, [2, 5, 6]] = 1.0
    ids, w = moe.route(logits, 2, "softmax", norm=True)
    assert ids.tolist() == [[2, 5]]
    assert torch.allclose(w.cpu(), torch.tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="8 experts cannot give 9"):
        moe.route(logits, 9, "softmax")
    # NaN logits: every place still gets a valid expert
    logits[0, [1, 2, 3, 4, 5, 6]] = float("nan")
    for gating in moe.GATINGS:
        ids, _ = moe.route(logits, 3, gating)
        assert all(0 <= i < 8 for i in ids[0].tolist())


# Q2_K and Q3_K: the experts of the 2- and 3-bit K mixes (GLM-4.5-Air's Q2_K / Q3_K_M files)
@pytest.mark.parametrize("ggml_type", [qt.Q4_K, qt.Q8_0, qt.MXFP4, qt.BF16, qt.Q2_K, qt.Q3_K],
                         ids=qt.type_name)
def test_expert_glu_and_down_match_reference(ggml_type, seed):
    g = generator(seed)
    n_expert, k, m, n_ff = 5, 2, 2, 16
    cols = _block(ggml_type)
    gate = _experts(ggml_type, n_expert, n_ff, cols, g)
    up = _experts(qt.Q8_0 if ggml_type == qt.Q4_K else ggml_type, n_expert, n_ff, cols, g)
    up_type = qt.Q8_0 if ggml_type == qt.Q4_K else ggml_type  # a mixed pair too
    x = torch.randn(m, cols, generator=g, device=DEVICE)
    ids = _ids(m, k, n_expert, g)
    h = poison((m * k, n_ff))
    cfg = (16, 16, 1)
    moe_decode.expert_glu(gate, ggml_type, up, up_type, n_expert, x, ids, h, config=cfg)
    ref = moe_decode.expert_glu_ref(gate, ggml_type, up, up_type, n_expert, x, ids,
                                    torch.empty(m * k, n_ff, device=DEVICE))
    assert nerr(h, ref) < 1e-5
    # down: n_ff -> cols rows, weighted sum into out (and added onto what out holds)
    # Q4_K_M's pair: Q4_K gate, Q6_K down (the prefill test runs Q6_K's grouped walk too)
    down_type = qt.Q6_K if ggml_type == qt.Q4_K else ggml_type
    down = _experts(down_type, n_expert, cols, _block(down_type), g)
    hd = torch.randn(m * k, quant_matmul.row_cols(down, down_type), generator=g, device=DEVICE)
    wts = torch.rand(m, k, generator=g, device=DEVICE)
    prior = torch.randn(m, cols, generator=g, device=DEVICE)
    # one launch summing the k experts, and the k experts in parallel programs (a poisoned
    # float32 row each) summed by combine
    for accumulate, split in ((False, False), (True, False), (False, True), (True, True)):
        out = prior.clone() if accumulate else poison((m, cols))
        moe_decode.expert_down(down, down_type, n_expert, hd, ids, wts, out, accumulate=accumulate,
                               config=(256, 16, 1), rows_out=poison((m * k, cols)) if split else None)
        want = moe_decode.expert_down_ref(down, down_type, n_expert, hd, ids, wts, prior.clone(),
                                          accumulate=accumulate)
        mag = sum(wts[:, j:j + 1] * torch.stack([
            gemv_scale(down[int(ids[i, j]) * cols:(int(ids[i, j]) + 1) * cols], down_type,
                       hd[i * k + j:i * k + j + 1])[0] for i in range(m)]) for j in range(k))
        assert nerr(out, want, mag + (prior.abs() if accumulate else 0)) < 1e-5


def test_expert_glu_gpt_oss_biases_and_clamped_swiglu(seed):
    g = generator(seed)
    n_expert, k, n_ff, cols = 4, 2, 16, 64
    gate = _experts(qt.MXFP4, n_expert, n_ff, cols, g)
    up = _experts(qt.MXFP4, n_expert, n_ff, cols, g)
    gb = torch.randn(n_expert * n_ff, generator=g, device=DEVICE) * 8  # some past the limit
    ub = torch.randn(n_expert * n_ff, generator=g, device=DEVICE) * 8
    x = torch.randn(1, cols, generator=g, device=DEVICE)
    ids = _ids(1, k, n_expert, g)
    h = poison((k, n_ff))
    moe_decode.expert_glu(gate, qt.MXFP4, up, qt.MXFP4, n_expert, x, ids, h, "swiglu_oai", gb, ub,
                          limit=7.0, config=(16, 16, 1))
    ref = moe_decode.expert_glu_ref(gate, qt.MXFP4, up, qt.MXFP4, n_expert, x, ids,
                                    torch.empty(k, n_ff, device=DEVICE), "swiglu_oai", gb, ub, 7.0)
    assert nerr(h, ref) < 1e-5
    # the clamp bites: without it the outputs differ
    loose = moe_decode.expert_glu_ref(gate, qt.MXFP4, up, qt.MXFP4, n_expert, x, ids,
                                      torch.empty(k, n_ff, device=DEVICE), "swiglu_oai", gb, ub, 1e9)
    assert nerr(loose, ref) > 1e-3


def test_gather_experts_copies_only_the_routed_experts_to_their_places(seed):
    """Decode's gather of host experts: each routed expert's bytes of every tensor (words,
    and a tensor whose experts are not whole words) land at that expert's place in the
    twin; no other byte of the twin is written. From pinned host memory on a GPU."""
    g = torch.Generator().manual_seed(seed)  # the sources are host tensors
    n_expert = 6
    pin = str(DEVICE).startswith("cuda")
    srcs = [torch.randint(0, 256, (n_expert * 40, 36), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (n_expert * 3,), dtype=torch.uint8, generator=g),
            torch.randn(n_expert * 8, generator=g)]  # float32 biases
    srcs = [t.pin_memory() if pin else t for t in srcs]
    dsts = [torch.full_like(t, 7, device=DEVICE) for t in srcs]
    ids = torch.tensor([[4, 1], [1, 3]], dtype=torch.int32, device=DEVICE)
    moe_decode.gather_experts(srcs, dsts, n_expert, ids)
    chosen = {4, 1, 3}
    for src, dst in zip(srcs, dsts, strict=True):
        s, d = src.reshape(n_expert, -1), dst.reshape(n_expert, -1).cpu()
        for e in range(n_expert):
            if e in chosen:
                assert torch.equal(d[e], s[e])
            else:
                assert bool((d[e] == 7).all())
    with pytest.raises(ValueError):
        moe_decode.gather_experts([srcs[1]], [dsts[1][:-1]], n_expert, ids)


def test_sort_routes_groups_rows_by_expert(seed):
    g = generator(seed)
    n_expert, k = 6, 2
    m = MOE_TILE_ROWS + 7  # one expert gets more than a tile of rows
    ids = torch.stack([torch.randperm(n_expert, generator=g, device=DEVICE)[:k]
                       for _ in range(m)]).to(torch.int32)
    ids[: MOE_TILE_ROWS + 3, 0] = 1
    ids[: MOE_TILE_ROWS + 3, 1] = torch.where(ids[: MOE_TILE_ROWS + 3, 1] == 1, 0,
                                              ids[: MOE_TILE_ROWS + 3, 1])
    t = moe_tiles(m * k, n_expert)
    rows = torch.full((m * k,), -5, dtype=torch.int32, device=DEVICE)
    pos = rows.clone()
    tiles = torch.full((3, t), -5, dtype=torch.int32, device=DEVICE)
    # counts in a poisoned scratch of M x experts (the runner lends the router's logits); the
    # 78 routed rows span two programs under the interpreter (64 rows each)
    scratch = torch.full((m * n_expert,), -9, dtype=torch.int32, device=DEVICE)
    moe_prefill.sort_routes(ids, n_expert, rows, pos, tiles, scratch)
    r_rows, r_pos, r_tiles = (torch.empty_like(rows), torch.empty_like(pos),
                              torch.empty_like(tiles))
    moe_prefill.sort_routes_ref(ids, n_expert, r_rows, r_pos, r_tiles)
    assert torch.equal(rows, r_rows) and torch.equal(pos, r_pos)
    assert torch.equal(tiles[0], r_tiles[0])
    used = r_tiles[0] >= 0
    assert torch.equal(tiles[1:, used], r_tiles[1:, used])
    assert int(used.sum()) == sum(-(-int(c) // MOE_TILE_ROWS)
                                  for c in torch.bincount(ids.reshape(-1).long()))


@pytest.mark.parametrize("types", [(qt.Q4_K, qt.Q6_K), (qt.MXFP4, qt.MXFP4), (qt.Q8_0, qt.Q4_0),
                                   (qt.IQ4_XS, qt.IQ2_XXS), (qt.Q2_K, qt.Q3_K)],
                         ids=lambda t: "-".join(qt.type_name(x) for x in t))
def test_prefill_grouped_path_matches_decode_reference(types, seed, shape=(4, 2, 21)):
    # sort -> grouped gate/up -> grouped down -> combine gives, for every token, what the
    # decode composition of the references gives
    gu_type, d_type = types
    g = generator(seed)
    n_expert, k, m = shape
    cols = max(_block(gu_type), _block(d_type))
    ff_cols = _block(d_type)
    gate = _experts(gu_type, n_expert, ff_cols, cols, g)
    up = _experts(gu_type, n_expert, ff_cols, cols, g)
    down = _experts(d_type, n_expert, cols, ff_cols, g)
    bias = (torch.randn(n_expert * ff_cols, generator=g, device=DEVICE)
            if gu_type == qt.MXFP4 else None)
    act, limit = ("swiglu_oai", 7.0) if bias is not None else ("silu", 0.0)
    x = torch.randn(m, cols, generator=g, device=DEVICE)
    ids, wts = moe.route(torch.randn(m, n_expert, generator=g, device=DEVICE), k, "softmax",
                         norm=True)
    t = moe_tiles(m * k, n_expert)
    rows = torch.empty(m * k, dtype=torch.int32, device=DEVICE)
    pos, tiles = torch.empty_like(rows), torch.empty(3, t, dtype=torch.int32, device=DEVICE)
    moe_prefill.sort_routes(ids, n_expert, rows, pos, tiles)
    h = poison((m * k, ff_cols))
    moe_prefill.grouped_glu(gate, gu_type, up, gu_type, n_expert, x, ids, rows, tiles, h, act, bias,
                            bias, limit)
    h_ref = moe_prefill.grouped_glu_ref(gate, gu_type, up, gu_type, n_expert, x, ids, rows, tiles,
                                        torch.empty_like(h), act, bias, bias, limit)
    assert nerr(h, h_ref) < 1e-5
    y = poison((m * k, cols))
    moe_prefill.grouped_down(down, d_type, n_expert, h_ref, tiles, y)
    y_ref = moe_prefill.grouped_down_ref(down, d_type, n_expert, h_ref, tiles, torch.empty_like(y))
    assert nerr(y, y_ref) < 1e-5
    prior = torch.randn(m, cols, generator=g, device=DEVICE)
    out = prior.clone()
    moe.combine(y_ref, pos, wts, out, accumulate=True)
    # against decode's kernels' references, token by token, in the original order
    h_tok = moe_decode.expert_glu_ref(gate, gu_type, up, gu_type, n_expert, x, ids,
                                      torch.empty(m * k, ff_cols, device=DEVICE), act, bias, bias, limit)
    want = moe_decode.expert_down_ref(down, d_type, n_expert, h_tok, ids, wts, prior.clone(),
                                      accumulate=True)
    assert nerr(out, want) < 1e-5


def test_prefill_grouped_path_runs_experts_of_several_tiles(seed):
    # 2 experts x 2 used of 97 tokens: each expert holds more rows than one tile
    # (spec.launch.MOE_TILE_ROWS), its last tile partial
    assert 97 > MOE_TILE_ROWS
    test_prefill_grouped_path_matches_decode_reference((qt.Q4_K, qt.Q6_K), seed, (2, 2, 97))


@pytest.mark.parametrize("gating,e,ng,ngu,k", [("sigmoid", 64, 8, 3, 6), ("softmax", 48, 6, 2, 4),
                                               ("sigmoid", 32, 4, 1, 8)])
def test_route_limited_to_groups_matches_reference(gating, e, ng, ngu, k, seed):
    """DeepSeek-V3's group-limited routing: each row chooses only among the experts of its ngu
    groups whose two best selection scores (after the bias) sum highest; the torch engine's
    rule (engine/runtime/models/ops.py) gives the same ids."""
    from engine.runtime.models import ops

    g = generator(seed)
    m = 7
    logits = torch.randn(m, e, generator=g, device=DEVICE) * 3
    sb = torch.randn(e, generator=g, device=DEVICE) * 0.5
    ids = torch.full((m, k), -7, dtype=torch.int32, device=DEVICE)
    wts = poison((m, k))
    moe.route(logits, k, gating, True, 2.5, sb, ids, wts, groups=(ng, ngu))
    rid, rw = moe.route_ref(logits, k, gating, True, 2.5, sb, groups=(ng, ngu))
    assert torch.equal(ids, rid)
    assert nerr(wts, rw) < 1e-6
    # every chosen expert lies in one of ngu groups
    assert all(len({int(x) // (e // ng) for x in row}) <= ngu for row in ids.cpu())
    # the torch engine's routing, sorted (it may order the chosen ids differently)
    tid, _ = ops.route(logits.cpu(), k, gating, True, 2.5, sb.cpu(), groups=(ng, ngu))
    assert torch.equal(ids.cpu().long().sort(-1).values, tid.long().sort(-1).values)
    with pytest.raises(ValueError, match="groups"):
        moe.route(logits, k, gating, groups=(ng, 0))

"""Decode's routed experts on the int8 copies (carve_kernels/moe_decode.py ``expert_glu_q8`` then
``expert_down_q8`` with its in-kernel sum): the gate/up on x's int8 copy matches the reference
GLU of the dequantized copy, and Q4_K's block headers as [R, B, 4] tiles (on trial as
``layout_tiles``) give the bits of the [R, B] ones: the GLU outputs, their int8 copy, the k
unweighted rows and the weighted sum; counters are left zero."""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, generator, nerr, q8_bufs

from carve_kernels import moe_decode, q8x
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt


@pytest.mark.parametrize("down_type", [qt.Q4_K, qt.Q6_K], ids=qt.type_name)
def test_layout_tiles_give_the_bits_of_the_plain_headers(down_type, seed, monkeypatch):
    g = generator(seed)
    n_expert, k, e, f = 5, 3, 512, 256  # hidden 2 blocks a row, each expert's GLU 256 wide
    gate = random_weight(qt.Q4_K, n_expert * f, e, DEVICE, g)
    up = random_weight(qt.Q4_K, n_expert * f, e, DEVICE, g)
    down = random_weight(down_type, n_expert * e, f, DEVICE, g)
    x = torch.randn(e, generator=g, device=DEVICE)
    xq, xd = q8x.copy_ref(x)
    ids = torch.randperm(n_expert, generator=g, device=DEVICE)[:k].view(1, k).to(torch.int32)
    w = torch.rand(1, k, generator=g, device=DEVICE)

    def run(tiles: bool):
        monkeypatch.setattr(moe_decode, "LAYOUT_TILES", tiles)
        h = torch.full((k, f), float("nan"), device=DEVICE)
        hq = q8_bufs(k * f)
        rows = torch.full((k, e), float("nan"), device=DEVICE)
        out = torch.full((1, e), float("nan"), device=DEVICE)
        counter = torch.zeros(e // 16, dtype=torch.int32, device=DEVICE)
        moe_decode.expert_glu_q8(gate, qt.Q4_K, up, qt.Q4_K, n_expert, xq, ids, h, out_q=hq)
        moe_decode.expert_down_q8(down, down_type, n_expert, hq, ids, w, out, rows,
                                  counter=counter)
        assert not counter.any()  # left zero for the next call
        return h, *hq, rows, out

    plain, tiles = run(False), run(True)
    for name, a, b in zip(("h", "h's q", "h's d", "h's s", "rows", "out"), plain, tiles,
                          strict=True):
        assert torch.equal(a, b), name
    want = moe_decode.expert_glu_ref(gate, qt.Q4_K, up, qt.Q4_K, n_expert, xd, ids,
                                     torch.empty(k, f, device=DEVICE))
    assert nerr(tiles[0], want) < 1e-4
    assert torch.isfinite(tiles[-1]).all()

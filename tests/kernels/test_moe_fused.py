"""Decode's routed experts in one launch (carve_kernels/moe_fused.py, on trial as
``expert_ffn_fused``) give the bits of the two launches it replaces (``expert_glu_q8`` then
``expert_down_q8`` with its in-kernel sum) at the same tiles: the GLU outputs, their int8 copy,
the k unweighted rows and the weighted sum onto the output, added to it or written; its
counters are left zero, so the next call starts clean."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from reference_check import DEVICE, generator, q8_bufs

from carve_kernels import moe_decode, moe_fused, q8x
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt


@pytest.mark.parametrize("gate_type, down_type, accumulate", [
    (qt.Q4_K, qt.Q6_K, False), (qt.Q4_K, qt.Q4_K, True), (qt.MXFP4, qt.MXFP4, False),
    (qt.Q3_K, qt.Q5_0, True)], ids=lambda v: qt.type_name(v) if isinstance(v, int) and v > 1
    else str(v))
def test_one_launch_gives_the_bits_of_the_two(gate_type, down_type, accumulate):
    g = generator(7)
    n_expert, k = 6, 3
    qk = moe_decode.Q8_BLOCK[gate_type]
    e = qk * (2 if qk == 256 else 5)  # hidden: the gate/up rows' length and down's rows
    f = 64 if moe_decode.Q8_BLOCK[down_type] == 32 else 256  # each expert's GLU width
    gate = random_weight(gate_type, n_expert * f, e, DEVICE, g)
    up = random_weight(gate_type, n_expert * f, e, DEVICE, g)
    down = random_weight(down_type, n_expert * e, f, DEVICE, g)
    oai = gate_type == qt.MXFP4
    act, limit = ("swiglu_oai", 7.0) if oai else ("silu", 0.0)
    gb, ub, db = (torch.randn(n_expert * r, generator=g, device=DEVICE) * 0.1 if oai else None
                  for r in (f, f, e))
    xq, _ = q8x.copy_ref(torch.randn(e, generator=g, device=DEVICE))
    ids = torch.randperm(n_expert, generator=g, device=DEVICE)[:k].view(1, k).to(torch.int32)
    w = torch.rand(1, k, generator=g, device=DEVICE)
    base = torch.randn(1, e, generator=g, device=DEVICE)
    _, _, warps = moe_decode.EXPERT_Q8_CONFIG[(gate_type, "glu")]
    dr, db_, _ = moe_decode.EXPERT_Q8_CONFIG[(down_type, "down")]

    def run(fused: bool):
        h = torch.full((k, f), float("nan"), device=DEVICE)
        hq = q8_bufs(k * f)
        rows = torch.full((k, e), float("nan"), device=DEVICE)
        out = base.clone()
        counter = torch.zeros(e // 16 + 1, dtype=torch.int32, device=DEVICE)
        ready = torch.zeros(k, dtype=torch.int32, device=DEVICE)
        if fused:
            moe_fused.expert_ffn_q8(gate, gate_type, up, gate_type, down, down_type, n_expert,
                                    xq, ids, w, h, hq, out, rows, counter, ready, act, gb, ub,
                                    db, limit, accumulate)
        else:
            moe_decode.expert_glu_q8(gate, gate_type, up, gate_type, n_expert, xq, ids, h, act,
                                     gb, ub, limit, out_q=hq)
            moe_decode.expert_down_q8(down, down_type, n_expert, hq, ids, w, out, rows, db,
                                      accumulate, config=(dr, db_, warps), counter=counter)
        assert not counter.any() and not ready.any()  # left zero for the next call
        return h, *hq, rows, out

    two, one = run(False), run(True)
    for name, a, b in zip(("h", "h's q", "h's d", "h's s", "rows", "out"), two, one,
                          strict=True):
        assert torch.equal(a, b), name
    assert torch.isfinite(one[-1]).all()
    if not accumulate:  # the sum was written, not added to what was there
        assert not torch.equal(one[-1], base)


def test_the_one_launch_refuses_buffers_that_cannot_hold_it():
    g = generator(1)
    gate = random_weight(qt.Q4_K, 4 * 256, 256, DEVICE, g)
    down = random_weight(qt.Q6_K, 4 * 256, 256, DEVICE, g)
    xq, _ = q8x.copy_ref(torch.randn(256, generator=g, device=DEVICE))
    ids = torch.tensor([[0, 2]], dtype=torch.int32, device=DEVICE)
    h, hq = torch.empty(2, 256, device=DEVICE), q8_bufs(2 * 256)
    w, out = torch.rand(1, 2, device=DEVICE), torch.zeros(1, 256, device=DEVICE)
    rows = torch.empty(2, 256, device=DEVICE)
    counter = torch.zeros(16, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="ready 2"):
        moe_fused.expert_ffn_q8(gate, qt.Q4_K, gate, qt.Q4_K, down, qt.Q6_K, 4, xq, ids, w, h,
                                hq, out, rows, counter,
                                torch.zeros(1, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="differ in shape"):
        moe_fused.expert_ffn_q8(gate, qt.Q4_K, gate, qt.Q4_K, down[:512], qt.Q6_K, 4, xq, ids,
                                w, h,
                                hq, out, rows, counter,
                                torch.zeros(2, dtype=torch.int32, device=DEVICE))


_COMPILE = """
import json
from benchmarks import ptx_count
from spec import quant_types as qt
out = {}
for gt, dt in ((qt.Q4_K, qt.Q6_K), (qt.MXFP4, qt.MXFP4)):
    ptx = ptx_count.compile_expert_ffn(gt, dt).asm["ptx"]
    out[qt.type_name(gt)] = [ptx.count("ld.volatile"), ptx.count("dp4a")]
print(json.dumps(out))
"""


def test_the_one_launch_compiles_for_sm90():
    """Triton's compiler and the wheel's ptxas take the kernel with its wait loop (volatile
    reads of the counter), for the 30B-A3B and gpt-oss experts (the interpreter compiles
    nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name, (volatile, dp4a) in got.items():
        assert volatile >= 1 and dp4a > 0, name

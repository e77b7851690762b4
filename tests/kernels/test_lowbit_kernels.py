"""The GPU kernels of the low-bit types (Q4_1, Q5_1, Q2_K, Q3_K and the IQ family,
carve_kernels/lowbit_blocks.py) against the CPU dequantizer, itself bit-equal to
gguf.quants.dequantize: fresh random well-formed blocks each run, outputs poisoned with NaN.

Under TRITON_INTERPRET=1 without a GPU (tests/conftest.py), at tiny shapes.
"""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, gemv_scale, generator, glu_scale, nerr, poison

from carve_kernels import gemv_fused, glu, q8x, quant_matmul
from carve_kernels.lowbit_blocks import LOWBIT_PLANS, TABLE_TYPES, lookup_table
from carve_kernels.quant_blocks import PLANS
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt

TYPES = list(LOWBIT_PLANS)


def _shape(ggml_type: int, g: torch.Generator, most_blocks: int = 3) -> tuple[int, int]:
    rows = int(torch.randint(1, 10, (1,), generator=g, device=DEVICE))
    blocks = int(torch.randint(1, most_blocks + 1, (1,), generator=g, device=DEVICE))
    return rows, qt.quant(ggml_type).block_size * blocks


def _glu_err(out, gate, up, ggml_type, xf) -> float:
    # silu(x @ gate^T) * (x @ up^T) of the float32 rows xf against ``out``, scaled error
    g_ref = quant_matmul.gemv_ref(gate, ggml_type, xf)
    u_ref = quant_matmul.gemv_ref(up, ggml_type, xf)
    scale = glu_scale(g_ref, u_ref, "silu", gemv_scale(gate, ggml_type, xf),
                      gemv_scale(up, ggml_type, xf))
    return nerr(out, glu.glu_ref(g_ref, u_ref, "silu"), scale)


def _gemv3_err(out, mats, xs) -> float:
    # q, k, v side by side in ``out`` against each matrix times its own float32 x row
    ref = torch.cat([quant_matmul.gemv_ref(w, t, xi) for (w, t), xi in zip(mats, xs)], dim=1)
    scale = torch.cat([gemv_scale(w, t, xi) for (w, t), xi in zip(mats, xs)], dim=1)
    return nerr(out, ref, scale)


def test_every_type_of_the_issue_has_a_gpu_plan() -> None:
    issue = {qt.Q2_K, qt.Q3_K, qt.Q4_1, qt.Q5_1, qt.IQ1_S, qt.IQ1_M, qt.IQ2_XXS, qt.IQ2_XS,
             qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S, qt.IQ4_NL, qt.IQ4_XS}
    assert issue <= set(PLANS)
    for t in issue:  # the plan agrees with the format's block
        assert (PLANS[t].block, PLANS[t].nbytes) == qt.QUANT[t][1:]
        assert PLANS[t].parts * PLANS[t].lanes == PLANS[t].block
        assert (lookup_table(t, DEVICE) is not None) == (t in TABLE_TYPES)


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_dequantize_and_embed_are_the_cpu_dequantizer(ggml_type, seed):
    # float32 out: the same float32 operations in the same order as the reference, bit-equal
    g = generator(seed)
    rows, cols = _shape(ggml_type, g)
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    ref = quant_matmul.dequantize_ref(w, ggml_type, torch.float32)
    assert torch.isfinite(ref).all() and ref.abs().max() > 0
    out = poison((rows, cols))
    quant_matmul.dequantize(w, ggml_type, torch.float32, out=out)
    assert torch.equal(out, ref)
    half = poison((rows, cols), torch.float16)
    quant_matmul.dequantize(w, ggml_type, torch.float16, out=half)
    assert nerr(half, ref) < 1e-3  # one f16 rounding (the interpreter's may differ by a unit)
    ids = torch.randint(0, rows, (5,), generator=g, device=DEVICE)
    emb = poison((5, cols))
    quant_matmul.embed(w, ggml_type, ids, out=emb)
    assert torch.equal(emb, ref[ids.long()])


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_gemv_matches_reference(ggml_type, seed):
    g = generator(seed)
    rows, cols = _shape(ggml_type, g)
    m = int(torch.randint(1, 5, (1,), generator=g, device=DEVICE))
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    x = torch.randn(m, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    out = poison((m, rows))
    quant_matmul.gemv(w, ggml_type, x, out=out)
    ref = quant_matmul.gemv_ref(w, ggml_type, x.float())
    assert nerr(out, ref, gemv_scale(w, ggml_type, x)) < 1e-5


@pytest.mark.parametrize("ggml_type", [qt.IQ2_XXS, qt.IQ3_S, qt.Q2_K], ids=qt.type_name)
def test_gemv_glu_matches_reference(ggml_type, seed):
    # gate and up of a table type: each program reads the table through both matrices
    g = generator(seed)
    rows, cols = _shape(ggml_type, g, 2)
    gate = random_weight(ggml_type, rows, cols, DEVICE, g)
    up = random_weight(ggml_type, rows, cols, DEVICE, g)
    x = torch.randn(1, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    out = poison((1, rows))
    gemv_fused.gemv_glu(gate, up, ggml_type, x, "silu", out=out)
    assert _glu_err(out, gate, up, ggml_type, x.float()) < 1e-5


def test_gemv3_of_three_table_types(seed):
    # q, k, v of the IQ2_XXS mix's kinds in one launch: each matrix reads its own table
    g = generator(seed)
    cols = 256
    mats = [(random_weight(t, int(torch.randint(1, 8, (1,), generator=g, device=DEVICE)), cols,
                           DEVICE, g), t) for t in (qt.IQ2_XXS, qt.IQ4_XS, qt.IQ3_S)]
    x = torch.randn(1, cols, generator=g, device=DEVICE)
    out = poison((1, sum(w.shape[0] for w, _ in mats)))
    gemv_fused.gemv3(mats, x, out)
    assert _gemv3_err(out, mats, [x] * 3) < 1e-5


ROW_BODIES = sorted(quant_matmul.ROW_BODY_TYPES | quant_matmul.ROW_BODY_TRIAL)
# the bodies that multiply float x too (Q5_0's reads decode's int8 copy alone)
FLOAT_BODIES = [t for t in ROW_BODIES if t not in quant_matmul.INT8_BODY_TYPES]


def _row_cols(ggml_type: int, g: torch.Generator, lo: int, hi: int) -> int:
    # values per row of the row-body tests: lo..hi-1 blocks of 256 values; for Q8_0 and Q5_0
    # (32-value blocks of 34 and 22 bytes) an odd number of blocks, 9..15, so that their blocks
    # start at both halves of an int32 word (c = 0 and 2) and rows are not whole words
    if qt.quant(ggml_type).block_size == 32:
        return 32 * (2 * int(torch.randint(4, 8, (1,), generator=g, device=DEVICE)) + 1)
    return 256 * int(torch.randint(lo, hi, (1,), generator=g, device=DEVICE))


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("ggml_type", FLOAT_BODIES, ids=qt.type_name)
def test_row_body_matches_reference(ggml_type, xdtype, seed, monkeypatch):
    # carve_kernels/gemv_iq.py (a group of 32 values per lane; carve_kernels/gemv_lowbit.py's bodies
    # and Q8_0's, a thread per block, alike) on float32 or 16-bit x (read in 64-bit words), rows
    # that are not a multiple of the tile, several steps of blocks and a partial last one; the
    # bodies still on trial too
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES",
                        quant_matmul.ROW_BODY_TYPES | {ggml_type})
    g = generator(seed)
    rows = int(torch.randint(1, 11, (1,), generator=g, device=DEVICE))
    cols = _row_cols(ggml_type, g, 3, 6)
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    assert quant_matmul._launch_args(w, ggml_type, x_dtype=xdtype)[1]["SPECIAL"]
    x = torch.randn(2, cols, generator=g, device=DEVICE).to(xdtype)
    ref = quant_matmul.gemv_ref(w, ggml_type, x.float())
    for config in (None, (2, 2, 4)):
        out = poison((2, rows))
        quant_matmul.gemv(w, ggml_type, x, out=out, config=config)
        assert nerr(out, ref, gemv_scale(w, ggml_type, x)) < 1e-5


@pytest.mark.parametrize("ggml_type", ROW_BODIES, ids=qt.type_name)
def test_row_body_on_int8_x(ggml_type, seed, monkeypatch):
    # decode's int8 copy of x (carve_kernels/q8x.py): the row bodies (and the bodies on trial)
    # multiply it by dp4a (integer ops under the interpreter); the reference multiplies the
    # values the copy stands for
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES",
                        quant_matmul.ROW_BODY_TYPES | {ggml_type})
    g = generator(seed)
    rows = int(torch.randint(1, 11, (1,), generator=g, device=DEVICE))
    cols = _row_cols(ggml_type, g, 2, 5)
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    up = random_weight(ggml_type, rows, cols, DEVICE, g)
    x = torch.randn(1, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    xq, xr = q8x.copy_ref(x[0])
    ref = quant_matmul.gemv_ref(w, ggml_type, xr)
    for config in (None, (2, 2, 4)):
        out = poison((1, rows))
        quant_matmul.gemv(w, ggml_type, x, out=out, config=config, xq=xq)
        assert nerr(out, ref, gemv_scale(w, ggml_type, xr)) < 1e-5
    # the int8 copy is what it reads: a copy of other values gives other outputs
    other, _ = q8x.copy_ref(-x[0])
    out = poison((1, rows))
    quant_matmul.gemv(w, ggml_type, x, out=out, xq=other)
    assert nerr(out, -ref, gemv_scale(w, ggml_type, xr)) < 1e-5
    # gate/up in one launch
    out = poison((1, rows))
    gemv_fused.gemv_glu(w, up, ggml_type, x, "silu", out=out, xq=xq)
    assert _glu_err(out, w, up, ggml_type, xr) < 1e-5


def test_gemv3_mixes_int8_and_float_x(seed):
    # q, k, v where only the grid IQ matrices read the int8 copy and the Q4_K one reads x
    g = generator(seed)
    cols = 512
    types = (qt.IQ2_XXS, qt.Q4_K, qt.IQ3_S)
    mats = [(random_weight(t, int(torch.randint(1, 8, (1,), generator=g, device=DEVICE)), cols,
                           DEVICE, g), t) for t in types]
    x = torch.randn(1, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    xq, xr = q8x.copy_ref(x[0])
    out = poison((1, sum(w.shape[0] for w, _ in mats)))
    gemv_fused.gemv3(mats, x, out, xq=xq)
    xs = [xr if t in quant_matmul.ROW_BODY_TYPES else x.float() for t in types]
    assert _gemv3_err(out, mats, xs) < 1e-5

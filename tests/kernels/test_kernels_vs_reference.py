"""Every Triton kernel against its plain-torch twin: fresh random inputs each run (the seed is
printed on failure), outputs poisoned with NaN before the kernel runs (an unwritten element
fails), normalized error bounds (reference_check.py: sums of products against their magnitudes).

Without a GPU the kernels run under TRITON_INTERPRET=1 (set before any kernel module is
imported, see conftest.py) at tiny shapes; with one, the same tests run on it.
"""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, gemv_scale, generator, glu_scale, nerr, poison

from carve_kernels import attention, gemv_fused, glu, kv_cache, norm, q8x, quant_matmul, rope
from carve_kernels.random_blocks import random_weight
from spec import quant_types as qt

TYPES = [qt.F16, qt.BF16, qt.Q4_0, qt.Q5_0, qt.Q8_0, qt.Q4_K, qt.Q5_K, qt.Q6_K]


def test_kernels_are_interpreted_without_gpu():
    # a JIT (compiled) kernel on a CPU-only machine would mean these tests ran nothing
    if DEVICE == "cpu":
        assert type(quant_matmul._gemv_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
@pytest.mark.parametrize("m", [1, 3])
def test_gemv_matches_reference(ggml_type, m, seed):
    g = generator(seed)
    block = 256 if ggml_type in (qt.Q4_K, qt.Q5_K, qt.Q6_K) else 32
    rows = int(torch.randint(1, 12, (1,), generator=g, device=DEVICE))
    cols = block * int(torch.randint(1, 4, (1,), generator=g, device=DEVICE))
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    x = torch.randn(m, cols, generator=g, device=DEVICE)
    out = poison((m, rows))
    quant_matmul.gemv(w, ggml_type, x, out=out)
    ref = quant_matmul.gemv_ref(w, ggml_type, x)
    assert nerr(out, ref, gemv_scale(w, ggml_type, x)) < 1e-5


@pytest.mark.parametrize("ggml_type", [qt.Q6_K, qt.Q5_0, qt.Q8_0], ids=qt.type_name)
def test_gemv_bias_and_both_accumulations(ggml_type, seed):
    # Q6_K's generic walk accumulates per element, Q5_0's sums each part over its lanes at once
    # (LANE_SUM_TYPES); Q8_0 runs its row body (carve_kernels/gemv_dot.py q80_rows_dot)
    assert (ggml_type in quant_matmul.LANE_SUM_TYPES) == (ggml_type != qt.Q6_K)
    g = generator(seed)
    w = random_weight(ggml_type, 9, 512, DEVICE, g)
    x = torch.randn(2, 512, generator=g, device=DEVICE)
    bias = torch.randn(9, generator=g, device=DEVICE)
    out = poison((2, 9))
    quant_matmul.gemv(w, ggml_type, x, out=out, bias=bias)
    ref = quant_matmul.gemv_ref(w, ggml_type, x, bias=bias)
    assert nerr(out, ref, gemv_scale(w, ggml_type, x, bias)) < 1e-5


@pytest.mark.parametrize("ggml_type", [qt.Q4_K, qt.Q6_K], ids=qt.type_name)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16], ids=str)
def test_gemv_storage_order_bodies(ggml_type, xdtype, seed):
    # the Q4_K body that walks a block in storage order (16-bit x) and the generic walk
    # (float32 x; Q6_K's with the 2^23 integer-to-float) against the reference; row counts
    # that are not a multiple of the tile, a partial last step
    g = generator(seed)
    rows = int(torch.randint(1, 11, (1,), generator=g, device=DEVICE))
    cols = 256 * int(torch.randint(1, 6, (1,), generator=g, device=DEVICE))
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    x = torch.randn(2, cols, generator=g, device=DEVICE).to(xdtype)
    out = poison((2, rows))
    special = ggml_type == qt.Q4_K and xdtype == torch.bfloat16
    assert quant_matmul._launch_args(w, ggml_type, x_dtype=xdtype)[1]["SPECIAL"] == special
    quant_matmul.gemv(w, ggml_type, x, out=out)
    ref = quant_matmul.gemv_ref(w, ggml_type, x.float())
    assert nerr(out, ref, gemv_scale(w, ggml_type, x)) < 1e-5


@pytest.mark.parametrize("table", ["wide", "long"])
def test_gemv_shape_tiles_match_reference(table, seed):
    # the tiles picked for many-row and long-row matrices, run at small shapes
    g = generator(seed)
    configs = quant_matmul.GEMV_CONFIG_WIDE if table == "wide" else quant_matmul.GEMV_CONFIG_LONG
    for ggml_type, cfg in configs.items():
        rows = int(torch.randint(1, 20, (1,), generator=g, device=DEVICE))
        w = random_weight(ggml_type, rows, 768, DEVICE, g)
        x = torch.randn(1, 768, generator=g, device=DEVICE).to(torch.bfloat16)
        out = poison((1, rows))
        quant_matmul.gemv(w, ggml_type, x, out=out, config=cfg)
        ref = quant_matmul.gemv_ref(w, ggml_type, x.float())
        assert nerr(out, ref, gemv_scale(w, ggml_type, x)) < 1e-5
    assert quant_matmul.gemv_config(qt.Q4_K, 18944, 3584) == quant_matmul.GEMV_CONFIG_WIDE[qt.Q4_K]
    assert quant_matmul.gemv_config(qt.Q6_K, 3584, 18944) == quant_matmul.GEMV_CONFIG_LONG[qt.Q6_K]


def test_gemv_unaligned_weight_falls_back_to_the_generic_walk(seed):
    # a weight view that starts off the 16-byte boundary the Q4_K body's wide loads assume
    g = generator(seed)
    raw = random_weight(qt.Q4_K, 5, 512, DEVICE, g)
    buf = torch.empty(raw.numel() + 2, dtype=torch.uint8, device=DEVICE)
    w = buf[2:].view(5, -1)
    w.copy_(raw)
    assert not quant_matmul._launch_args(w, qt.Q4_K)[1]["SPECIAL"]
    # aligned: the storage-order body for 16-bit activations, the generic walk for float32
    assert quant_matmul._launch_args(raw, qt.Q4_K, x_dtype=torch.bfloat16)[1]["SPECIAL"]
    assert not quant_matmul._launch_args(raw, qt.Q4_K, x_dtype=torch.float32)[1]["SPECIAL"]
    x = torch.randn(1, 512, generator=g, device=DEVICE)
    out = poison((1, 5))
    quant_matmul.gemv(w, qt.Q4_K, x, out=out)
    assert nerr(out, quant_matmul.gemv_ref(raw, qt.Q4_K, x), gemv_scale(raw, qt.Q4_K, x)) < 1e-5


@pytest.fixture
def q8_0_body(monkeypatch):
    # Q8_0's row body is on trial (quant_matmul.ROW_BODY_TRIAL, CARVE_TRIAL=q8_0_rows)
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES", quant_matmul.ROW_BODY_TYPES | {qt.Q8_0})


@pytest.mark.parametrize("x", ["f32", "bf16", "int8"])
def test_q8_0_row_body_matches_reference(x, seed, q8_0_body):
    # Q8_0's row body (a thread per 34-byte block, read as the 9 aligned int32 words around it)
    # on float32, bf16 and decode's int8 x: 11 blocks a row (row_bytes 374, 2 mod 4: blocks
    # start at both halves of a word), 7 rows in tiles of 2 and steps of 4 blocks (both last
    # ones partial), and the default tile
    g = generator(seed)
    rows, cols = 7, 32 * 11
    w = random_weight(qt.Q8_0, rows, cols, DEVICE, g)
    xb = torch.randn(1, cols, generator=g, device=DEVICE)
    xq = None
    if x == "int8":
        xq, xr = q8x.copy_ref(xb[0].to(torch.bfloat16))
        xb = xb.to(torch.bfloat16)
    else:
        xb = xb.to(torch.float32 if x == "f32" else torch.bfloat16)
        xr = xb.float()
    assert quant_matmul._launch_args(w, qt.Q8_0, x_dtype=xb.dtype)[1]["SPECIAL"]
    ref = quant_matmul.gemv_ref(w, qt.Q8_0, xr)
    for config in ((2, 4, 4), None):
        out = poison((1, rows))
        quant_matmul.gemv(w, qt.Q8_0, xb, out=out, config=config, xq=xq)
        assert nerr(out, ref, gemv_scale(w, qt.Q8_0, xr)) < 1e-5


@pytest.mark.parametrize("t", sorted(quant_matmul.INT8_BODY_TYPES), ids=qt.type_name)
def test_int8_row_bodies_match_reference(t, seed, monkeypatch) -> None:
    # the bodies on decode's int8 x alone (Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL) in gemv, gemv_glu and gemv3
    # (beside a Q8_0 matrix on the generic walk): 7 blocks a row (Q4_0's and Q5_0's rows of
    # 126 and 154 bytes, 2 mod 4: blocks start at both halves of a word), 9 rows in tiles of 4
    # and steps of 4 blocks (both last ones partial), and the default tile; on bf16 x (no
    # copy, or more than one row) the generic walk at its own tile
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES", quant_matmul.ROW_BODY_TYPES | {t})
    g = generator(seed)
    rows, cols = 9, 32 * 7
    w, up = (random_weight(t, rows, cols, DEVICE, g) for _ in range(2))
    x = torch.randn(1, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    xq, xr = q8x.copy_ref(x[0])
    assert quant_matmul._launch_args(w, t, int8_x=True)[1]["SPECIAL"]
    assert not quant_matmul._launch_args(w, t)[1]["SPECIAL"]
    ref = quant_matmul.gemv_ref(w, t, xr)
    for config in ((4, 4, 4), None):
        out = poison((1, rows))
        quant_matmul.gemv(w, t, x, out=out, config=config, xq=xq)
        assert nerr(out, ref, gemv_scale(w, t, xr)) < 1e-5
    u_ref = quant_matmul.gemv_ref(up, t, xr)
    out = poison((1, rows))
    gemv_fused.gemv_glu(w, up, t, x, "silu", out=out, xq=xq)
    scale = glu_scale(ref, u_ref, "silu", gemv_scale(w, t, xr),
                      gemv_scale(up, t, xr))
    assert nerr(out, glu.glu_ref(ref.double(), u_ref.double(), "silu"), scale) < 1e-5
    v = random_weight(qt.Q8_0, 3, cols, DEVICE, g)
    out = poison((1, 2 * rows + 3))
    gemv_fused.gemv3([(w, t), (v, qt.Q8_0), (up, t)], x, out, xq=xq)
    if t == qt.IQ4_NL:  # its body's table constants do not reach gemv3: the walk on x
        ref, u_ref = (quant_matmul.gemv_ref(m, t, x.float()) for m in (w, up))
    want = torch.cat([ref, quant_matmul.gemv_ref(v, qt.Q8_0, x.float()), u_ref], dim=1)
    assert nerr(out, want, want.abs().max()) < 1e-5
    # two rows of x: the generic walk on x, never the copy
    x2 = torch.randn(2, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    out = poison((2, rows))
    quant_matmul.gemv(w, t, x2, out=out, xq=xq)
    ref2 = quant_matmul.gemv_ref(w, t, x2.float())
    assert nerr(out, ref2, gemv_scale(w, t, x2.float())) < 1e-5


def test_q8_0_unaligned_weight_takes_the_generic_walk_on_x(seed, q8_0_body):
    # a Q8_0 view 2 bytes off a 4-byte boundary: the generic walk (the body's word loads need
    # the alignment), which multiplies x itself, never the int8 copy it is handed (here one of
    # -x: reading it would flip the signs), in gemv, gemv_glu and gemv3
    g = generator(seed)
    rows, cols = 5, 32 * 7
    raw = [random_weight(qt.Q8_0, rows, cols, DEVICE, g) for _ in range(2)]
    buf = torch.empty(2, raw[0].numel() + 2, dtype=torch.uint8, device=DEVICE)
    w, up = (buf[i, 2:].view(rows, -1) for i in range(2))
    w.copy_(raw[0])
    up.copy_(raw[1])
    assert w.data_ptr() % 4 == 2 and not quant_matmul._launch_args(w, qt.Q8_0)[1]["SPECIAL"]
    assert quant_matmul._launch_args(raw[0], qt.Q8_0)[1]["SPECIAL"]
    x = torch.randn(1, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    other, _ = q8x.copy_ref(-x[0])
    xf = x.float()
    out = poison((1, rows))
    quant_matmul.gemv(w, qt.Q8_0, x, out=out, xq=other)
    ref = quant_matmul.gemv_ref(raw[0], qt.Q8_0, xf)
    assert nerr(out, ref, gemv_scale(raw[0], qt.Q8_0, xf)) < 1e-5
    out = poison((1, rows))
    gemv_fused.gemv_glu(raw[0], up, qt.Q8_0, x, "silu", out=out, xq=other)
    g_ref = ref
    u_ref = quant_matmul.gemv_ref(raw[1], qt.Q8_0, xf)
    scale = glu_scale(g_ref, u_ref, "silu", gemv_scale(raw[0], qt.Q8_0, xf),
                      gemv_scale(raw[1], qt.Q8_0, xf))
    assert nerr(out, glu.glu_ref(g_ref.double(), u_ref.double(), "silu"), scale) < 1e-5
    # q, k, v: the aligned matrix reads the int8 copy (of x here), the unaligned one x
    xq, xr = q8x.copy_ref(x[0])
    mats = [(raw[1], qt.Q8_0), (w, qt.Q8_0), (up, qt.Q8_0)]
    out = poison((1, 3 * rows))
    gemv_fused.gemv3(mats, x, out, xq=xq)
    ref = torch.cat([quant_matmul.gemv_ref(raw[1], qt.Q8_0, xr),
                     quant_matmul.gemv_ref(raw[0], qt.Q8_0, xf),
                     quant_matmul.gemv_ref(raw[1], qt.Q8_0, xf)], dim=1)
    scale = torch.cat([gemv_scale(raw[1], qt.Q8_0, xr), gemv_scale(raw[0], qt.Q8_0, xf),
                       gemv_scale(raw[1], qt.Q8_0, xf)], dim=1)
    assert nerr(out, ref, scale) < 1e-5


@pytest.mark.parametrize("ggml_type", [qt.Q4_K, qt.Q6_K, qt.Q8_0], ids=qt.type_name)
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_gemv_glu_matches_reference(ggml_type, act, seed):
    g = generator(seed)
    rows = int(torch.randint(1, 10, (1,), generator=g, device=DEVICE))
    cols = 512
    gate = random_weight(ggml_type, rows, cols, DEVICE, g)
    up = random_weight(ggml_type, rows, cols, DEVICE, g)
    x = torch.randn(1, cols, generator=g, device=DEVICE).to(torch.bfloat16)
    out = poison((1, rows))
    gemv_fused.gemv_glu(gate, up, ggml_type, x, act, out=out)
    xf = x.float()
    g_ref = quant_matmul.gemv_ref(gate, ggml_type, xf)
    u_ref = quant_matmul.gemv_ref(up, ggml_type, xf)
    scale = glu_scale(g_ref, u_ref, act, gemv_scale(gate, ggml_type, xf),
                      gemv_scale(up, ggml_type, xf))
    # the reference in float64: torch's float32 tanh GELU is off far down the negative tail
    assert nerr(out, glu.glu_ref(g_ref.double(), u_ref.double(), act), scale) < 1e-5


@pytest.mark.parametrize("with_bias", [True, False])
def test_gemv3_matches_three_gemvs(with_bias, seed):
    # q, k, v of mixed types in one launch, outputs side by side
    g = generator(seed)
    cols = 512
    mats = [(random_weight(t, int(torch.randint(1, 12, (1,), generator=g, device=DEVICE)),
                           cols, DEVICE, g), t) for t in (qt.Q4_K, qt.Q6_K, qt.Q8_0)]
    biases = [torch.randn(w.shape[0], generator=g, device=DEVICE) for w, _ in mats] \
        if with_bias else None
    x = torch.randn(1, cols, generator=g, device=DEVICE)
    out = poison((1, sum(w.shape[0] for w, _ in mats)))
    gemv_fused.gemv3(mats, x, out, biases)
    bs = biases or [None] * len(mats)
    ref = torch.cat([quant_matmul.gemv_ref(w, t, x, bias=b) for (w, t), b in zip(mats, bs)], dim=1)
    scale = torch.cat([gemv_scale(w, t, x, b) for (w, t), b in zip(mats, bs)], dim=1)
    assert nerr(out, ref, scale) < 1e-5


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_dequantize_and_embed_match_reference(ggml_type, seed):
    g = generator(seed)
    block = 256 if ggml_type in (qt.Q4_K, qt.Q5_K, qt.Q6_K) else 32
    rows, cols = 5, block * 2
    w = random_weight(ggml_type, rows, cols, DEVICE, g)
    out = poison((rows, cols), torch.float16)
    quant_matmul.dequantize(w, ggml_type, torch.float16, out=out)
    ref = quant_matmul.dequantize_ref(w, ggml_type, torch.float32)
    assert nerr(out, ref) < 1e-3  # one f16 rounding of equal float32 values
    ids = torch.randint(0, rows, (7,), generator=g, device=DEVICE)
    emb = poison((7, cols))
    quant_matmul.embed(w, ggml_type, ids, out=emb)
    assert torch.equal(emb, quant_matmul.embed_ref(w, ggml_type, ids))


def test_prefill_matmul_uses_dequantized_weight(seed):
    g = generator(seed)
    w = random_weight(qt.Q4_K, 6, 256, DEVICE, g)
    x = torch.randn(4, 256, generator=g, device=DEVICE)
    y = quant_matmul.matmul(w, qt.Q4_K, x)
    assert nerr(y, quant_matmul.gemv_ref(w, qt.Q4_K, x), gemv_scale(w, qt.Q4_K, x)) < 1e-5


@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_matches_reference(with_residual, seed):
    g = generator(seed)
    x = torch.randn(3, 96, generator=g, device=DEVICE)
    w = torch.randn(96, generator=g, device=DEVICE)
    res = torch.randn(3, 96, generator=g, device=DEVICE) if with_residual else None
    res_ref = res.clone() if with_residual else None
    out = poison((3, 96))
    norm.rmsnorm(x, w, 1e-6, residual=res, out=out)
    ref = norm.rmsnorm_ref(x, w, 1e-6, residual=res_ref)
    assert nerr(out, ref) < 1e-5
    if with_residual:
        assert nerr(res, res_ref) < 1e-6


@pytest.mark.parametrize("post", [False, True])
def test_bf16_fused_add_norm_normalizes_the_stream_as_stored(post, seed):
    # a stage boundary stores the stream (bf16) and the next stage's first norm reads it; the
    # fused add-and-norm of a layer boundary must give those bits (a split changes nothing)
    g = generator(seed)
    x, res = (torch.randn(3, 96, generator=g, device=DEVICE).to(torch.bfloat16) for _ in "xr")
    w, wp = (torch.rand(96, generator=g, device=DEVICE) + 0.5 for _ in "wp")
    stored, fused = res.clone(), poison((3, 96)).to(torch.bfloat16)
    if post:
        norm.rmsnorm_post(x, wp, w, 1e-6, stored, fused)
        x = norm.rmsnorm_ref(x, wp, 1e-6).float()
    else:
        norm.rmsnorm(x, w, 1e-6, residual=stored, out=fused)
    assert nerr(stored, res.float() + x.float()) < 1e-2  # bf16
    assert torch.equal(fused, norm.rmsnorm(stored, w, 1e-6))


@pytest.mark.parametrize("neox", [False, True])
def test_rope_matches_reference(neox, seed):
    g = generator(seed)
    x = torch.randn(3, 5, 32, generator=g, device=DEVICE)
    pos = torch.randint(0, 4000, (3,), generator=g, device=DEVICE).to(torch.int32)
    ref = rope.rope_ref(x.clone(), pos, 10000.0, neox)
    out = rope.rope(x, pos, 10000.0, neox)
    # float32 angles of positions up to 4000: the kernel's exp2/cos round at ~1e-6 relative
    assert nerr(out, ref) < 5e-5


@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_glu_matches_reference(act, seed):
    g = generator(seed)
    gate, up = torch.randn(2, 2, 100, generator=g, device=DEVICE).unbind(0)
    out = poison((2, 100))
    glu.glu(gate, up, act, out=out)
    assert nerr(out, glu.glu_ref(gate.double(), up.double(), act)) < 1e-5


def _cache(kv_type: str, cells: int, kvh: int, d: int) -> torch.Tensor:
    if kv_type == "f16":
        return poison((cells, kvh, d), torch.float16)
    return torch.zeros(cells * kvh * d // 32 * 34, dtype=torch.uint8, device=DEVICE)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize(("positions", "kept"), [
    ([3, 4, 9, 10, 13], [2, 3, 4]),  # a ring of 8 keeps the last 8 positions' rows (9-13)
    ([5, 6, 7, 7, 7], [0, 1, 2]),  # padded to a graph's length: the repeats are not stored
    ([1, 2, 3, 4, 5, 5], [1, 2, 3, 4]),  # both: a ring of 4 (below) keeps 2-5
    ([6], [0])])  # a decode row
def test_kv_store_matches_reference(kv_type, positions, kept, seed):
    g = generator(seed)
    cells, kvh, d, t = (4 if positions[0] == 1 else 8), 2, 64, len(positions)
    src = torch.randn(t, kvh, d, generator=g, device=DEVICE)
    pos = torch.tensor(positions, dtype=torch.int32, device=DEVICE)
    src2 = torch.randn(t, kvh, d, generator=g, device=DEVICE)
    a, b = _cache(kv_type, cells, kvh, d), _cache(kv_type, cells, kvh, d)
    a2, b2 = _cache(kv_type, cells, kvh, d), _cache(kv_type, cells, kvh, d)
    empty = kv_cache.kv_load_ref(a, cells, kvh, d)
    kv_cache.kv_store(src, a, pos, cells, src2, a2)  # keys and values in one launch
    kv_cache.kv_store_ref(src, b, pos, cells, src2, b2)
    cell = pos.long() % cells
    written = cell[kept]
    others = torch.ones(cells, dtype=torch.bool, device=DEVICE)
    others[written] = False
    for x, y, s in ((a, b, src), (a2, b2, src2)):
        got, want = kv_cache.kv_load_ref(x, cells, kvh, d), kv_cache.kv_load_ref(y, cells, kvh, d)
        assert torch.equal(got[written], want[written])
        # the kept rows are where they belong, and nothing else was written
        assert nerr(got[written], s[kept]) < (1e-2 if kv_type == "q8_0" else 1e-3)
        assert torch.equal(got[others].isnan(), empty[others].isnan())
        assert torch.equal(got[others].nan_to_num(), empty[others].nan_to_num())


@pytest.mark.parametrize("kv_type,neox,qk_norm", [("f16", True, False), ("f16", False, False),
                                                   ("q8_0", True, False), ("f16", True, True),
                                                   ("q8_0", True, True), ("f16", False, True)])
def test_rope_store_matches_rope_then_kv_store(kv_type, neox, qk_norm, seed):
    # decode's fused rotation + cache store against the reference rope and kv_store; with
    # qk_norm, qwen3's per-head q/k RMSNorm in the same launch against the reference norm
    g = generator(seed)
    cells, nq, kvh, d, t = 8, 4, 2, 64, 3
    qk = (torch.randn(t, nq + kvh, d, generator=g, device=DEVICE) * 3).to(torch.bfloat16)
    v = torch.randn(t, kvh, d, generator=g, device=DEVICE).to(torch.bfloat16)
    pos = torch.tensor([5, 12, 30], dtype=torch.int32, device=DEVICE)
    wq, wk = (torch.rand(d, generator=g, device=DEVICE) + 0.5 for _ in range(2))
    ref_qk = qk.clone()
    if qk_norm:
        norm.rmsnorm_heads_ref(ref_qk, wq, wk, nq, 1e-6)
    rope.rope_ref(ref_qk, pos, 10000.0, neox)
    a, b = _cache(kv_type, cells, kvh, d), _cache(kv_type, cells, kvh, d)
    a2, b2 = _cache(kv_type, cells, kvh, d), _cache(kv_type, cells, kvh, d)
    rope.rope_store(qk, v, pos, 10000.0, neox, 1.0, nq, a, a2, cells,
                    qk_norm=(wq, wk, 1e-6) if qk_norm else None)
    for r in range(t):  # decode rows, one at a time; keys as the kernel rotated them
        kv_cache.kv_store_ref(qk[r:r + 1, nq:], b, pos[r:r + 1], cells, v[r:r + 1], b2)
    assert nerr(qk, ref_qk) < 1e-2  # bf16 rounding of the rotated values
    for x, y in ((a, b), (a2, b2)):
        got = kv_cache.kv_load_ref(x, cells, kvh, d)[pos.long() % cells]
        want = kv_cache.kv_load_ref(y, cells, kvh, d)[pos.long() % cells]
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_q8_roundtrip_matches_store_then_load(dtype, seed):
    g = generator(seed)
    x = (torch.randn(5, 3, 64, generator=g, device=DEVICE) * 3).to(dtype)
    x[1, 2] = 0.0  # an all-zero block: d = 0
    ref = x.clone()
    kv_cache.q8_roundtrip_(x)
    kv_cache.q8_roundtrip_ref(ref)
    if dtype == torch.float32:
        assert torch.equal(x, ref)
    else:  # the store's rounding to bf16 (the interpreter's differs by up to one unit)
        assert torch.allclose(x.float(), ref.float(), rtol=2**-7, atol=0)
    assert not torch.equal(x, x.float().round().to(dtype))  # it did change the values


def _filled_cache(kv_type, cells, kvh, d, g):
    cache = _cache(kv_type, cells, kvh, d)
    src = torch.randn(cells, kvh, d, generator=g, device=DEVICE)
    kv_cache.kv_store_ref(src, cache, torch.arange(cells, device=DEVICE), cells)
    return cache


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("pos,cells,window", [(37, 64, 0), (100, 64, 0), (90, 24, 24),
                                              (50, 64, 20), (300, 512, 0), (700, 256, 100)])
@pytest.mark.parametrize("fused", [False, True], ids=["reduce-launch", "last-merges"])
def test_attn_decode_matches_reference(kv_type, pos, cells, window, fused, seed):
    g = generator(seed)
    nh, kvh, d = 6, 2, 32  # GQA group of 3
    k = _filled_cache(kv_type, cells, kvh, d, g)
    v = _filled_cache(kv_type, cells, kvh, d, g)
    q = torch.randn(nh, d, generator=g, device=DEVICE)
    positions = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    out = poison((nh, d))
    counter = torch.zeros(kvh, 64, dtype=torch.int32, device=DEVICE) if fused else None
    attention.attn_decode(q, k, v, positions, kvh, cells, window, d**-0.5, out=out,
                          counter=counter)
    ref = attention.attn_decode_ref(q, k, v, positions, kvh, cells, window, d**-0.5)
    assert nerr(out, ref) < 5e-3  # f16 operands of the two products
    if fused:  # left at zero for the next layer
        assert not counter.any()


@pytest.mark.parametrize(("nh", "kvh", "dtype"), [(6, 2, torch.float32), (8, 1, torch.bfloat16)])
def test_attn_decode_writes_the_int8_copy_of_its_output(nh, kvh, dtype, seed):
    # the merging program of each kv head quantizes its heads' output rows as stored (the
    # attn_output GEMV's int8 x, matrices.ATTN_Q8_TYPES): the copy q8x.copy_ref makes of the
    # row, to the bit, and nothing past the row's groups
    g = generator(seed)
    d, cells = 64, 64
    k = _filled_cache("f16", cells, kvh, d, g)
    v = _filled_cache("f16", cells, kvh, d, g)
    q = torch.randn(nh, d, generator=g, device=DEVICE)
    positions = torch.tensor([41], dtype=torch.int32, device=DEVICE)
    out = poison((nh, d)).to(dtype)
    counter = torch.zeros(kvh, 64, dtype=torch.int32, device=DEVICE)
    words = torch.full((nh * d // 4 + 8,), 0x7F7F7F7F, dtype=torch.int32, device=DEVICE)
    ds = torch.full((2, nh * d // 32 + 2), float("nan"), device=DEVICE)
    out_q = q8x.buffers(words, ds, nh * d)
    attention.attn_decode(q, k, v, positions, kvh, cells, 0, d**-0.5, out=out, counter=counter,
                          out_q=out_q)
    (rq, rd, rs), _ = q8x.copy_ref(out.flatten().float())
    assert torch.equal(out_q[0], rq) and torch.equal(out_q[1], rd)
    assert torch.allclose(out_q[2], rs, rtol=1e-6, atol=1e-6)
    assert (words[nh * d // 4:] == 0x7F7F7F7F).all() and ds[:, nh * d // 32:].isnan().all()
    with pytest.raises(ValueError, match="merging programs"):
        attention.attn_decode(q, k, v, positions, kvh, cells, 0, d**-0.5, out=out, out_q=out_q)


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("pos,cells,window", [(37, 64, 0), (100, 64, 0), (90, 24, 24),
                                              (700, 256, 100), (63, 64, 0), (64, 64, 0),
                                              (300, 512, 0), (600, 512, 100)])
def test_attn_decode_in_splits_of_several_blocks(kv_type, pos, cells, window, seed):
    # each split's first block of cached keys and values is read before the PDL wait, the
    # newest cell after it, the split's further blocks in its loop: two splits a head make
    # each split several blocks long past 128 cells (ring wraps and windows included)
    g = generator(seed)
    nh, kvh, d = 8, 2, 32
    k = _filled_cache(kv_type, cells, kvh, d, g)
    v = _filled_cache(kv_type, cells, kvh, d, g)
    q = torch.randn(nh, d, generator=g, device=DEVICE)
    positions = torch.tensor([pos], dtype=torch.int32, device=DEVICE)
    out = poison((nh, d))
    counter = torch.zeros(kvh, 64, dtype=torch.int32, device=DEVICE)
    ws = (torch.empty(nh, 2, d, device=DEVICE), torch.empty(nh, 2, device=DEVICE))
    attention.attn_decode(q, k, v, positions, kvh, cells, window, d**-0.5, out=out,
                          counter=counter, workspace=ws)
    assert not counter.any()
    ref = attention.attn_decode_ref(q, k, v, positions, kvh, cells, window, d**-0.5)
    assert nerr(out, ref) < 5e-3


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
@pytest.mark.parametrize("t,pos0,cells,window", [(70, 0, 128, 0), (20, 50, 128, 0),
                                                 (40, 70, 48, 48), (33, 10, 64, 16)])
def test_attn_prefill_matches_reference(kv_type, t, pos0, cells, window, seed):
    g = generator(seed)
    nh, kvh, d = 4, 2, 32
    k = _filled_cache(kv_type, cells, kvh, d, g)
    v = _filled_cache(kv_type, cells, kvh, d, g)
    q = torch.randn(t, nh, d, generator=g, device=DEVICE)
    kn = torch.randn(t, kvh, d, generator=g, device=DEVICE)
    vn = torch.randn(t, kvh, d, generator=g, device=DEVICE)
    ref = attention.attn_prefill_ref(q, kn, vn, k, v, pos0, cells, window, d**-0.5)
    # the first position as a host int, or read on the device from the chunk's positions
    positions = torch.arange(pos0, pos0 + t, device=DEVICE)  # int64, as buf.positions
    for p0 in (pos0, positions, positions.to(torch.int32)):
        out = poison((t, nh, d))
        attention.attn_prefill(q, kn, vn, k, v, p0, cells, window, d**-0.5, out=out)
        assert nerr(out, ref) < 5e-3

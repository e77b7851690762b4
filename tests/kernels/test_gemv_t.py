"""The T-layout GEMV (carve_kernels/gemv_t.py) against the torch reference on the GGUF bytes it was
repacked from: fresh random shapes and inputs each run (the seed is printed on failure), errors
against the products' magnitudes (reference_check.py), outputs poisoned with NaN, split and
unsplit rows, both bodies; the splits' sums buffer poisoned too (read only where written),
counters left at zero, and split sums that repeat bit for bit."""

from __future__ import annotations

import pytest
import torch
from reference_check import DEVICE, gemv_scale, generator, glu_scale, nerr

from carve_kernels import gemv_t, gemv_t3, glu, q8x, quant_matmul, rope, t_layout
from carve_kernels.random_blocks import random_weight
from spec import launch
from spec import quant_types as qt


def _rand(g, lo, hi):
    return int(torch.randint(lo, hi, (1,), generator=g, device=DEVICE))


TYPES = [qt.Q4_K, qt.Q5_K, qt.Q6_K, qt.Q2_K, qt.Q3_K, qt.IQ4_XS, qt.IQ1_S, qt.IQ1_M,
         qt.IQ2_XXS, qt.IQ2_XS, qt.IQ2_S, qt.IQ3_XXS, qt.IQ3_S]


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_repack_is_a_permutation_of_the_bytes(ggml_type, seed):
    g = generator(seed)
    rows, nb = _rand(g, 1, 40), _rand(g, 1, 5)
    bb, wd = t_layout.BLOCK_BYTES[ggml_type], t_layout.WORDS[ggml_type]
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    t = t_layout.repack(w, ggml_type)
    assert t.numel() == w.numel()  # same bytes: the price does not change
    assert torch.equal(t_layout.unpack(t, ggml_type, rows), w)
    # word u of block b of row n sits at T[b, u, n]; the tail in its own plane after them
    b, n = _rand(g, 0, nb), _rand(g, 0, rows)
    words = t[: nb * wd * rows * 4].view(nb, wd, rows, 4)
    blk = w[n, b * bb:(b + 1) * bb]
    body, rest = t_layout._cut(ggml_type)  # the tail at the block's end, or (HEAD) its start
    assert torch.equal(words[b, :, n].reshape(-1), blk[body])
    if t_layout.TAIL[ggml_type]:
        tail = t[nb * wd * rows * 4:].view(nb, rows, -1)
        assert torch.equal(tail[b, n], blk[rest])
    # slab by slab, as the loader fills it
    out = torch.zeros_like(t)
    cut = _rand(g, 0, rows + 1)
    t_layout.repack(w[:cut], ggml_type, out=out, rows=slice(0, cut))
    t_layout.repack(w[cut:], ggml_type, out=out, rows=slice(cut, rows))
    assert torch.equal(out, t)


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("xdtype", [torch.bfloat16, torch.float32], ids=str)
def test_gemv_t_matches_reference(ggml_type, split, xdtype, seed):
    # (on decode's int8 copy of x: tests/kernels/test_q8x.py)
    g = generator(seed)
    m = _rand(g, 1, 3)
    rows = _rand(g, 1, 70)
    nb = _rand(g, 1, 4)
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    wt = t_layout.repack(w, ggml_type)
    x = torch.randn(m, 256 * nb, generator=g, device=DEVICE).to(xdtype)
    bias = torch.randn(rows, generator=g, device=DEVICE) if _rand(g, 0, 2) else None
    block_n = 32
    tiles = -(-rows // block_n)
    # target programs: one per row tile (no split) or enough to split every row's blocks
    config = (block_n, 1, tiles * (nb if split else 1))
    part = torch.full((m * nb * rows,), float("nan"), device=DEVICE)  # split <= nb
    counter = torch.zeros(m, tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, rows), float("nan"), device=DEVICE)
    gemv_t.gemv_t(wt, ggml_type, rows, x, out, part, counter, bias=bias, config=config)
    ref = quant_matmul.gemv_ref(w, ggml_type, x.float(), bias=bias)
    scale = gemv_scale(w, ggml_type, x, bias)
    assert nerr(out, ref, scale) < 1e-5
    assert not counter.any()  # left ready for the next call
    # and the twin computes the same from the repacked bytes
    twin = torch.empty_like(out)
    gemv_t.gemv_t_ref(wt, ggml_type, rows, x.float(), twin, part, counter, bias=bias)
    assert nerr(twin, ref, scale) < 1e-6


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("xkind", ["bf16", "f32", "int8"])
def test_q8_0_in_t_layout_at_any_block_count(split, xkind, seed):
    # Q8_0 (on trial) has blocks of 32: rows of an odd number of blocks leave each split's
    # last step half full; the splits are those pricing reserves for the same columns
    g = generator(seed)
    rows, nb = _rand(g, 1, 70), 2 * _rand(g, 0, 12) + 1
    cols = 32 * nb
    w = random_weight(qt.Q8_0, rows, cols, DEVICE, g)
    wt = t_layout.repack(w, qt.Q8_0)
    assert torch.equal(t_layout.unpack(wt, qt.Q8_0, rows), w)
    x = torch.randn(1, cols, generator=g, device=DEVICE)
    xq, xref = None, x
    if xkind == "int8":
        xq, xref = q8x.copy_ref(x[0])
    elif xkind == "bf16":
        x = x.to(torch.bfloat16)
        xref = x.float()
    tiles = -(-rows // 32)
    config = (32, 1, tiles * (nb if split else 1))
    most, _ = launch.split(tiles, max(1, cols // 256), config[2])
    part = torch.full((most * rows,), float("nan"), device=DEVICE)  # what pricing reserves
    counter = torch.zeros(tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((1, rows), float("nan"), device=DEVICE)
    gemv_t.gemv_t(wt, qt.Q8_0, rows, x, out, part, counter, config=config, xq=xq)
    ref = quant_matmul.gemv_ref(w, qt.Q8_0, xref)
    assert nerr(out, ref, gemv_scale(w, qt.Q8_0, xref)) < 1e-5
    assert not counter.any()


def test_t_tune_splits_fewer_ways_in_the_priced_scratch(monkeypatch, seed):
    # CARVE_T_TILES (engine/runtime/options.py) sets gemv_t.T_TUNE: the default config's rows
    # a program, fewer programs, so each row tile's blocks split fewer ways in the scratch the
    # default's split is priced for; the sums the same
    g = generator(seed)
    rows, nb = _rand(g, 1, 100), _rand(g, 2, 5)
    w = random_weight(qt.Q4_K, rows, 256 * nb, DEVICE, g)
    wt = t_layout.repack(w, qt.Q4_K)
    x = torch.randn(1, 256 * nb, generator=g, device=DEVICE)
    most, _ = launch.split(1, nb, launch.T_CONFIG[2])
    assert most == nb  # the default splits every block of this one row tile
    outs = []
    # (T_TUNE, an attn_output launch, unsplit): the attn part tunes only attn_output's launch
    for tune, attn, unsplit in (({}, False, False), ({"one": (1, 1, 0)}, False, True),
                                ({"attn": (1, 1, 0)}, False, False),
                                ({"attn": (1, 1, 0)}, True, True),
                                ({"attn": (2, 1, 256)}, True, True)):
        monkeypatch.setattr(gemv_t, "T_TUNE", tune)
        part = torch.full((most * rows,), float("nan"), device=DEVICE)
        counter = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        out = torch.full((1, rows), float("nan"), device=DEVICE)
        gemv_t.gemv_t(wt, qt.Q4_K, rows, x, out, part, counter, attn_output=attn)
        assert part.isnan().all() == unsplit  # unsplit: the scratch is not written
        assert not counter.any()
        outs.append(out)
    ref = quant_matmul.gemv_ref(w, qt.Q4_K, x)
    for out in outs:
        assert nerr(out, ref, gemv_scale(w, qt.Q4_K, x)) < 1e-5


def test_split_count_covers_the_blocks():
    for rows, nb, block_n, target in ((18944, 14, 256, 1056), (3584, 74, 256, 1056),
                                      (7, 3, 32, 1), (100, 1, 32, 1000)):
        s, bps = launch.split(launch.tiles([rows], block_n), nb, target)
        assert 1 <= s <= nb and (s - 1) * bps < nb <= s * bps  # every split holds a block


# (type, paired, act): Q4_K's gate and up read in the same steps (bf16 x) or one after the
# other (f32 x), under both activations, Q5_K's both ways too; the other types always run one
# after the other, here on bf16 x (the activation is the epilogue's, the same for every type)
GLU_CASES = ([(qt.Q4_K, p, a) for p in (True, False) for a in ("silu", "gelu")]
             + [(qt.Q5_K, False, "silu")] + [(t, True, "silu") for t in TYPES[1:]]
             + [(qt.Q8_0, True, "silu")])


@pytest.mark.parametrize(("ggml_type", "paired", "act"), GLU_CASES,
                         ids=lambda c: c if isinstance(c, str) else (
                             str(c) if isinstance(c, bool) else qt.type_name(c)))
@pytest.mark.parametrize("split", [True, False])
def test_gemv_t_glu_matches_reference(ggml_type, act, split, paired, seed):
    g = generator(seed)
    m, rows, nb = _rand(g, 1, 3), _rand(g, 1, 50), _rand(g, 1, 4)
    gate = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    up = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    x = torch.randn(m, 256 * nb, generator=g, device=DEVICE)
    if paired:
        x = x.to(torch.bfloat16)
    tiles = -(-rows // 32)
    part = torch.full((m * 2 * nb * rows,), float("nan"), device=DEVICE)
    counter = torch.zeros(m, tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, rows), float("nan"), device=DEVICE)
    gemv_t.gemv_t_glu(t_layout.repack(gate, ggml_type), t_layout.repack(up, ggml_type), ggml_type,
                      rows, x, out, part, counter, act,
                      config=(32, 1, tiles * (nb if split else 1)), paired=paired)
    g_ref = quant_matmul.gemv_ref(gate, ggml_type, x.float())
    u_ref = quant_matmul.gemv_ref(up, ggml_type, x.float())
    scale = glu_scale(g_ref, u_ref, act, gemv_scale(gate, ggml_type, x),
                      gemv_scale(up, ggml_type, x))
    assert nerr(out, glu.glu_ref(g_ref, u_ref, act), scale) < 1e-5
    assert not counter.any()


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("int8_x", [True, False])
@pytest.mark.parametrize("qk_same", [False, True])
def test_gemv_t3_matches_three_reference_gemvs(split, int8_x, qk_same, seed):
    # q, k, v of the same x in one launch: each its own random type and row count (so the row
    # tiles of one matrix end mid-tile and the next starts a fresh one), outputs side by side;
    # ``qk_same``: q and k of one type, which the kernel runs through one body
    g = generator(seed)
    m = 1 if int8_x else _rand(g, 1, 3)
    nb = _rand(g, 1, 4)
    types = [TYPES[_rand(g, 0, len(TYPES))] for _ in range(3)]
    if qk_same:
        types[1] = types[0]
    rows = [_rand(g, 1, 70) for _ in range(3)]
    ws = [random_weight(t, r, 256 * nb, DEVICE, g) for t, r in zip(types, rows)]
    x = torch.randn(m, 256 * nb, generator=g, device=DEVICE).to(torch.bfloat16)
    biases = ([torch.randn(r, generator=g, device=DEVICE) for r in rows] if _rand(g, 0, 2)
              else None)
    xq, xr = None, x.float()
    if int8_x:
        xq, xr = q8x.copy_ref(x[0])
    tiles = sum(-(-r // 32) for r in rows)
    part = torch.full((m * nb * sum(rows),), float("nan"), device=DEVICE)
    counter = torch.zeros(m, tiles, dtype=torch.int32, device=DEVICE)
    out = torch.full((m, sum(rows)), float("nan"), device=DEVICE)
    gemv_t3.gemv_t3([(t_layout.repack(w, t), t, r) for w, t, r in zip(ws, types, rows)], x, out,
                    part, counter, biases, config=(32, 1, tiles * (nb if split else 1)), xq=xq)
    bs = biases or [None] * 3
    ref = torch.cat([quant_matmul.gemv_ref(w, t, xr, bias=b) for w, t, b in zip(ws, types, bs)],
                    dim=1)
    scale = torch.cat([gemv_scale(w, t, xr, b) for w, t, b in zip(ws, types, bs)], dim=1)
    o = 0
    for r in rows:  # each matrix's own error: a small one must not hide behind a big one
        assert nerr(out[:, o:o + r], ref[:, o:o + r], scale[:, o:o + r]) < 1e-5
        o += r
    assert not counter.any()


@pytest.mark.parametrize("kv_type,neox,qk_norm", [("f16", True, False), ("f16", False, True),
                                                   ("q8_0", True, True)])
@pytest.mark.parametrize("split", [True, False])
def test_gemv_t3_rotates_and_stores_as_rope_store(kv_type, neox, qk_norm, split, seed):
    # q/k/v with decode's RoPE and cache store in the epilogue (``rope=``) gives the bits of
    # the plain launch followed by rope.rope_store: rotated q and k in out, v unchanged, the
    # same cache cells. Row tiles of 64 hold two heads of 32 (one of 64 for q8_0), and q's
    # last tile only one; M tokens at their own positions
    g = generator(seed)
    d = 64 if kv_type == "q8_0" else 32
    nq, kvh, cells, nb = 3, _rand(g, 1, 3), 8, _rand(g, 1, 3)
    m = _rand(g, 1, 3)
    rows = [nq * d, kvh * d, kvh * d]
    mats = [(t_layout.repack(random_weight(qt.Q4_K, r, 256 * nb, DEVICE, g), qt.Q4_K), qt.Q4_K, r)
            for r in rows]
    x = torch.randn(m, 256 * nb, generator=g, device=DEVICE).to(torch.bfloat16)
    biases = [torch.randn(r, generator=g, device=DEVICE) for r in rows]
    # distinct cells (two tokens storing into one cell would race), the ring wrapped
    pos = (torch.randperm(cells, generator=g, device=DEVICE)[:m]
           + cells * torch.randint(0, 5, (m,), generator=g, device=DEVICE)).to(torch.int32)
    w_norm = [torch.rand(d, generator=g, device=DEVICE) + 0.5 for _ in range(2)]
    tiles = sum(-(-r // 64) for r in rows)
    config = (64, 1, tiles * (nb if split else 1))

    def cache():
        if kv_type == "f16":
            return torch.zeros(cells, kvh, d, dtype=torch.float16, device=DEVICE)
        return torch.zeros(cells * kvh * d // 32 * 34, dtype=torch.uint8, device=DEVICE)

    outs, caches = [], []
    for fused in (True, False):
        part = torch.full((m * nb * sum(rows),), float("nan"), device=DEVICE)
        counter = torch.zeros(m, tiles, dtype=torch.int32, device=DEVICE)
        out = torch.full((m, sum(rows)), float("nan"), device=DEVICE).to(torch.bfloat16)
        kc, vc = cache(), cache()
        args = dict(positions=pos, base=10000.0, neox=neox, freq_scale=1.0, k_cache=kc,
                    v_cache=vc, cells=cells, qk_norm=(*w_norm, 1e-6) if qk_norm else None)
        assert gemv_t3.rope_fits(rows, d, config)
        gemv_t3.gemv_t3(mats, x, out, part, counter, biases, config=config,
                        rope={**args, "head_dim": d} if fused else None)
        if not fused:
            qk = out[:, :rows[0] + rows[1]].view(m, nq + kvh, d)
            rope.rope_store(qk, out[:, rows[0] + rows[1]:].view(m, kvh, d), pos, 10000.0, neox,
                            1.0, nq, kc, vc, cells, qk_norm=args["qk_norm"])
        assert not counter.any()
        outs.append(out)
        caches.append((kc, vc))
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(*caches):
        assert torch.equal(a, b)
    assert caches[0][0].any() and caches[0][1].any()  # both caches were written


def test_gemv_t3_refuses_heads_across_tiles():
    assert not gemv_t3.rope_fits([96, 32, 32], 64, (32, 1, 1))  # a head over two tiles
    assert not gemv_t3.rope_fits([160, 80, 80], 80, (128, 4, 1))  # head_dim not a power of two
    assert not gemv_t3.rope_fits([128, 64, 32], 32, (64, 1, 1))  # fewer value heads than keys
    assert gemv_t3.rope_fits([3584, 512, 512], 128, None)


def test_split_sums_repeat_bit_for_bit(seed):
    # the splits' sums are added in split order, not in the order the programs finish: the
    # same input gives the same bits every call (greedy decoding repeats, split or not). On a
    # GPU a shape with many programs in flight; under the interpreter a small one
    g = generator(seed)
    rows, nb = (4096, 14) if DEVICE == "cuda" else (96, 3)
    w = t_layout.repack(random_weight(qt.Q4_K, rows, 256 * nb, DEVICE, g), qt.Q4_K)
    x = torch.randn(1, 256 * nb, generator=g, device=DEVICE).to(torch.bfloat16)
    config = None if DEVICE == "cuda" else (32, 1, 3 * nb)
    floats, counters = launch.scratch([rows], 256 * nb, config or launch.T_CONFIG)
    assert floats and counters  # split
    part = torch.full((floats,), float("nan"), device=DEVICE)
    counter = torch.zeros(counters, dtype=torch.int32, device=DEVICE)
    outs = []
    for _ in range(5 if DEVICE == "cuda" else 2):
        y = torch.full((1, rows), float("nan"), device=DEVICE)
        gemv_t.gemv_t(w, qt.Q4_K, rows, x, y, part, counter, config=config)
        outs.append(y)
    assert all(torch.equal(o, outs[0]) for o in outs)
    gguf_w = t_layout.unpack(w, qt.Q4_K, rows)
    ref = quant_matmul.gemv_ref(gguf_w, qt.Q4_K, x.float())
    assert nerr(outs[0], ref, gemv_scale(gguf_w, qt.Q4_K, x)) < 1e-5


@pytest.mark.parametrize("ggml_type", TYPES, ids=qt.type_name)
def test_unpack_rows_gives_the_gguf_rows_back(ggml_type, seed):
    g = generator(seed)
    rows, nb = _rand(g, 2, 40), _rand(g, 1, 4)
    w = random_weight(ggml_type, rows, 256 * nb, DEVICE, g)
    t = t_layout.repack(w, ggml_type)
    r0 = _rand(g, 0, rows - 1)
    r1 = _rand(g, r0 + 1, rows + 1)
    out = torch.zeros(w.numel() + 7, dtype=torch.uint8, device=DEVICE)
    assert torch.equal(t_layout.unpack_rows(t, ggml_type, rows, r0, r1, out), w[r0:r1])


@pytest.mark.parametrize("shape", ["qwen2-7b", "qwen2-32b", "llama3-8b", "llama-70b",
                                   "qwen3-tiny"])
def test_priced_split_buffers_hold_every_decode_launch(shape):
    # pricing sizes buf.t_part / buf.t_count by spec/launch.py; the launches check their
    # buffers by the rule they follow: every T launch decode can make (8 rows, the GPU configs)
    # fits the priced buffers, and the largest would not fit in one float less
    from types import SimpleNamespace

    from engine.planning.buffers import activation_buffers
    from engine.synth.shapes import SHAPES

    sh = SHAPES[shape]
    hp = SimpleNamespace(n_embd=sh.n_embd, n_ff=sh.n_ff, n_head=sh.n_head,
                         n_head_kv=sh.n_head_kv, head_dim=sh.hd, head_dim_v=sh.hd,
                         n_vocab=sh.n_vocab)
    bufs = {b.name: b.shape for b in activation_buffers(hp, 16, "bf16", 1)}
    part = torch.empty(bufs["t_part"][0] * bufs["t_part"][1])
    counter = torch.empty(bufs["t_count"][0] * bufs["t_count"][1], dtype=torch.int32)
    e, f, q, kv = sh.n_embd, sh.n_ff, sh.n_head * sh.hd, sh.n_head_kv * sh.hd
    launches = [([f], e, launch.T_GLU_CONFIG, 2), ([e], f, launch.T_CONFIG, 1),
                ([e], q, launch.T_CONFIG, 1), ([q, kv, kv], e, launch.T_CONFIG, 1),
                ([sh.n_vocab], e, launch.T_CONFIG, 1)]
    need = []
    for rows, cols, config, parts in launches:
        x = torch.empty(8, cols, dtype=torch.bfloat16)
        grid, *_ = gemv_t._t_grid(rows, cols // 256, x, config, parts, part, counter)
        need.append(8 * parts * grid[1] * sum(rows) if grid[1] > 1 else 0)
    rows, cols, config, parts = launches[max(range(len(need)), key=need.__getitem__)]
    with pytest.raises(ValueError, match="too small"):
        gemv_t._t_grid(rows, cols // 256, torch.empty(8, cols, dtype=torch.bfloat16), config,
                       parts, part[: max(need) - 1], counter)


def test_bad_buffers_and_types_are_refused(seed):
    g = generator(seed)
    w = random_weight(qt.Q4_K, 64, 512, DEVICE, g)
    t = t_layout.repack(w, qt.Q4_K)
    x = torch.randn(1, 512, device=DEVICE)
    out = torch.empty(1, 64, device=DEVICE)
    small = torch.zeros(3, device=DEVICE)
    cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="too small"):
        gemv_t.gemv_t(t, qt.Q4_K, 64, x, out, small, cnt, config=(32, 1, 4))
    with pytest.raises(ValueError, match="no T layout"):
        gemv_t.gemv_t(t, qt.Q4_0, 64, x, out, small, cnt)
    with pytest.raises(ValueError, match="whole blocks"):
        gemv_t.gemv_t(t[:-4], qt.Q4_K, 64, x, out, small, cnt)
    t2 = t_layout.repack(random_weight(qt.Q4_K, 64, 256, DEVICE, g), qt.Q4_K)
    with pytest.raises(ValueError, match="same number of columns"):
        gemv_t3.gemv_t3([(t, qt.Q4_K, 64), (t2, qt.Q4_K, 64), (t, qt.Q4_K, 64)], x,
                        torch.empty(1, 192, device=DEVICE), small, cnt)


def test_every_grid_type_reads_a_shared_grid_on_a_gpu():
    # the bodies' ASM a launch compiles with: 2 (inline asm, the grid in shared memory) for
    # the seven grid types on a GPU, True for the others, False under the interpreter
    assert gemv_t.SMEM_TYPES == gemv_t.GRID_SMEM and len(gemv_t.GRID_SMEM) == 7
    assert all(gemv_t._asm(True, t) == 2 for t in gemv_t.GRID_SMEM)
    assert gemv_t._asm(True, qt.Q4_K) is True and gemv_t._asm(False, qt.IQ2_XXS) is False
    assert gemv_t._asm(True, qt.Q4_K, qt.IQ3_S) == 2  # one constexpr a q/k/v launch


def test_the_shared_copy_holds_each_grid_type_s_whole_table():
    # t_tab copies BYTES bytes of a type's table into shared memory (the size is a literal
    # there: an inline-asm declaration cannot take it from a constexpr); each must be the
    # whole table lowbit_blocks serves, or the grid rows past the copy would read nothing
    import inspect
    import re

    from carve_kernels.lowbit_blocks import lookup_table

    src = inspect.getsource(gemv_t.t_tab.fn)
    sizes = {}
    for types, size in re.findall(r"ASM == 2 and \(?([^:]*?)\)?:.*?\n\s*tab = grid_fill\("
                                  r"tab_ptr, (\d+)", src):
        for t in re.findall(r"TYPE == (\d+)", types):
            sizes[int(t)] = int(size)
    assert set(sizes) == set(gemv_t.GRID_SMEM)
    for t, size in sizes.items():
        assert lookup_table(t, "cpu").numel() == size, qt.type_name(t)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU: the shared grid is inline PTX")
@pytest.mark.parametrize("ggml_type", sorted(gemv_t.GRID_SMEM), ids=qt.type_name)
@pytest.mark.parametrize("int8_x", [True, False])
def test_the_grid_from_shared_memory_gives_the_same_sums(ggml_type, int8_x, monkeypatch, seed):
    # gemv_t.SMEM_TYPES (all seven grid types): the same grid rows read by ld.shared from the
    # copy each program makes, so the same sums to the bit as gathered from L1, in all three T
    # launches (gate and up read one copy; q/k/v's bodies each their own)
    g = generator(seed)
    rows, nb = 256 + _rand(g, 1, 300), _rand(g, 1, 5)
    ws = [random_weight(ggml_type, rows, 256 * nb, DEVICE, g) for _ in range(3)]
    wts = [t_layout.repack(w, ggml_type) for w in ws]
    x = torch.randn(1, 256 * nb, generator=g, device=DEVICE).to(torch.bfloat16)
    xq = q8x.copy_ref(x[0])[0] if int8_x else None
    part = torch.full((2 * nb * 3 * rows,), float("nan"), device=DEVICE)
    counter = torch.zeros(3 * rows, dtype=torch.int32, device=DEVICE)

    def run() -> list[torch.Tensor]:
        one, glu_out = (torch.full((1, rows), float("nan"), device=DEVICE) for _ in range(2))
        three = torch.full((1, 3 * rows), float("nan"), device=DEVICE)
        gemv_t.gemv_t(wts[0], ggml_type, rows, x, one, part, counter, xq=xq)
        gemv_t.gemv_t_glu(wts[0], wts[1], ggml_type, rows, x, glu_out, part, counter, xq=xq)
        gemv_t3.gemv_t3([(w, ggml_type, rows) for w in wts], x, three, part, counter, xq=xq)
        return [one, glu_out, three]

    monkeypatch.setattr(gemv_t, "SMEM_TYPES", frozenset())
    plain = run()
    monkeypatch.setattr(gemv_t, "SMEM_TYPES", gemv_t.GRID_SMEM)
    shared = run()
    for a, b in zip(plain, shared):
        assert torch.isfinite(a).all() and torch.equal(a, b)
    assert not counter.any()

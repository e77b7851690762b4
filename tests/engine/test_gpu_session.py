"""The Triton GPU runner end to end (GpuSession over GpuPipeline/GpuStage): logits and greedy ids
against the CPU engine on the same file, a split that changes nothing, every tensor a span of the
Layout, loads that fail or are cancelled leave nothing allocated, NaN named by layer.

Without a GPU the runner runs on the CPU under TRITON_INTERPRET=1 (tiny shapes: the interpreter
costs ~20 ms per Triton program). The `gpu` tests run the same on CUDA plus priced ==
torch.cuda.memory_reserved per arena mode; `python -m pytest -q tests/engine/test_gpu_session.py -m gpu`.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import io
import weakref

import pytest
import torch
from gpu_compare import chunk_and_decode_rows, decode_errors, rel

from carve_kernels import (
    attention,
    gemv_fused,
    gemv_t,
    gemv_t3,
    glu,
    kv_cache,
    norm,
    pdl,
    quant_matmul,
    rope,
)
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.process import protocol as p
from engine.runtime import server
from engine.runtime.gpu import matrices
from engine.runtime.gpu import memory as gpu_memory
from engine.runtime.gpu import stage as gpu_stage
from engine.runtime.gpu.session import GpuSession, why_not
from engine.runtime.options import RunnerOptions
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from engine.synth.gen import write_model
from engine.synth.shapes import Shape
from spec import quant_types as qt
from spec.errors import CarveError

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
# two simulated GPUs: a split the CPU Plan does not allow; the stages then run on the CPU
SIM = tuple(DeviceSpec(index=i, name="sim", total=8 * GIB, free=8 * GIB, simulated=True)
            for i in range(2))
# hidden 128, 2 layers, vocab 320: q4_k_m falls back to Q5_0 / Q8_0 on the 128-wide rows, and
# ffn_down (256-wide rows) keeps Q4_K / Q6_K
TINY = Shape("qwen2", 2, 128, 2, 1, 256, 320, n_ctx=512)
NO_CACHE = 1 << 50  # a cache reserve beyond the device: nothing cached, prefill rows in f32
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=4)
ON_GPU = torch.cuda.is_available()
# where the "interpreter" tests run their stages: the CPU in CI, the GPU where there is one
DEV = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(write_model(tmp_path_factory.mktemp("gpu") / "tiny.gguf", TINY, "q4_k_m")[0])


def plan(path: str, devices=(CPU,), split=(0, 2), **kw) -> Plan:
    base = {"ctx": 64, "prefill_chunk": 16, "cache_reserve": 0, "logits_rows": 4}
    base.update(kw)
    return Plan(model=path, devices=tuple(devices), split=split, **base)


def load(pl: Plan, **kw) -> GpuSession:
    return GpuSession.load(pl, devices=[DEV] * len(pl.devices), remember=False, **kw)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@contextlib.contextmanager
def beside_cpu(gpu_plan: Plan, cpu_plan: Plan, **kw):
    """The GPU runner on ``gpu_plan`` (``kw``: load's, as options=) and the CPU engine on
    ``cpu_plan``, both closed after."""
    g = load(gpu_plan, **kw)
    try:
        c = Session.load(cpu_plan)
        try:
            yield g, c
        finally:
            c.close()
    finally:
        g.close()


def assert_agree(g, c, prompt: list[int], bound: float) -> None:
    """The prompt's logits and three decode steps after it within ``bound`` of the CPU's."""
    assert rel(g.logits(prompt), c.logits(prompt)) < bound
    assert max(decode_errors(g, c, ids(3, 1))[0]) < bound


@pytest.fixture
def watched(monkeypatch):
    """Every arena the GPU runner allocates, as weak references; fail_at=N makes the N-th fail."""
    made: list[weakref.ref] = []
    state = {"fail_at": 0}

    def new_arena(nbytes, device):
        if state["fail_at"] and len(made) + 1 == state["fail_at"]:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        made.append(weakref.ref(t))
        return t

    monkeypatch.setattr(gpu_stage, "new_arena", new_arena)

    def alive() -> int:
        gc.collect()
        return sum(r() is not None for r in made)

    return made, state, alive


# ------------------------------------------------------------------ CPU interpreter (and GPU)


@pytest.fixture(scope="module")
def cached(tiny):
    """The GPU default: bf16 activations, every matrix in the dequant cache (bf16 GEMMs in
    prefill); the CPU engine in f32 as the reference. 12 logits rows: the all-rows head runs
    12 + 4 rows per chunk of 16, each 12 as GEMVs of 8 + 4 (no [rows, vocab] bf16 temporary)."""
    g = load(plan(tiny, act_dtype="bf16", logits_rows=12))
    c = Session.load(plan(tiny, logits_rows=12))
    yield g, c
    g.close()
    c.close()


def test_prefill_all_rows_and_decode_match_the_cpu_engine(cached) -> None:
    g, c = cached
    prompt = ids(20)  # two chunks of 16
    lg, lc = g.logits(prompt), c.logits(prompt)
    assert lg.shape == lc.shape == (20, 320) and lg.dtype == torch.float32
    assert rel(lg, lc) < 3e-2  # bf16 activations and cache (measured 1.1e-2)
    errs, last = decode_errors(g, c, ids(3, 1))
    assert max(errs) < 3e-2
    # decode agrees with prefill of the same tokens inside the runner
    full = g.logits(prompt + ids(3, 1))
    assert rel(last, full[-1]) < 3e-2


def test_q8_0_kv_prefill_and_decode_match_the_cpu_engine(tiny) -> None:
    # f32 activations, nothing cached, float x (no int8 copy for TINY's Q5_0 rows): the only
    # difference left is the q8_0 cache, which a prefill chunk must see for its own keys as the
    # cache gives them back (as the CPU engine does); 20 tokens in chunks of 8 read earlier
    # chunks back from the cache too
    kw = {"prefill_chunk": 8, "cache_reserve": NO_CACHE, "kv_type": "q8_0"}
    with beside_cpu(plan(tiny, **kw), plan(tiny, **kw), options=RunnerOptions(q8x=False)) as (g, c):
        assert_agree(g, c, ids(20), 2e-3)


def test_q8_0_matrices_decode_on_int8_x_as_the_cpu_engine(tiny, monkeypatch) -> None:
    # with Q8_0's row body (on trial: CARVE_TRIAL=q8_0_rows) TINY's Q8_0 head runs it
    # (carve_kernels/gemv_dot.py q80_rows_dot) on decode's int8 copy of the normed row (dp4a's
    # integer twin under the interpreter), prefill rows on x itself; f32 activations, nothing
    # cached. The int8 rounding of x is the error (decode measured 6.6e-3 here, 9e-5 on x)
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES", quant_matmul.ROW_BODY_TYPES | {qt.Q8_0})
    calls: list[tuple[int, bool]] = []
    gemv = quant_matmul.gemv

    def spy(w, ggml_type, x, *a, **k):
        calls.append((ggml_type, k.get("xq") is not None))
        return gemv(w, ggml_type, x, *a, **k)

    monkeypatch.setattr(quant_matmul, "gemv", spy)
    kw = {"prefill_chunk": 8, "cache_reserve": NO_CACHE}
    with beside_cpu(plan(tiny, **kw), plan(tiny, **kw)) as (g, c):
        assert g.pipe.stages[0].xq is not None
        assert_agree(g, c, ids(8), 3e-2)
    assert (qt.Q8_0, True) in calls and (qt.Q8_0, False) in calls


# 256-wide rows: every matrix keeps its K type, so q/k/v, the FFN pair, ffn_down, attn_output and
# the head (Q6_K) all go into the T layout
WIDE = Shape("qwen2", 2, 256, 4, 2, 512, 320, n_ctx=512)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    return str(write_model(tmp_path_factory.mktemp("gpu") / "wide.gguf", WIDE, "q4_k_m")[0])


@pytest.fixture
def all_t(monkeypatch) -> None:
    # on a GPU the stage keeps matrices under T_MIN_BYTES in GGUF order: none of WIDE's is
    # that big, so lift the floor to run the T kernels (the interpreter has none)
    monkeypatch.setattr(matrices, "T_MIN_BYTES", 0)


def test_t_layout_matrices_match_the_cpu_engine(wide, all_t) -> None:
    with beside_cpu(plan(wide, act_dtype="bf16", logits_rows=12),
                    plan(wide, logits_rows=12)) as (g, c):
        (st,) = g.pipe.stages
        want = {f"blk.{i}.{m}" for i in range(2) for m in matrices.T_MATRICES + matrices.QKV}
        assert set(st.tmats) == want | {"output.weight"}
        # decided at load: q/k/v and the FFN pair in one T launch each, every matrix's GEMV
        assert {(ly.attn.fused, ly.ffn.fused) for ly in st.layers} == {("t3", "t_glu")}
        assert all(m.t_bytes is not None for ly in st.layers
                   for m in (*ly.attn.qkv, ly.attn.output, ly.ffn.gate, ly.ffn.up, ly.ffn.down))
        assert_agree(g, c, ids(20), 3e-2)


@pytest.fixture(scope="module")
def wide_q4k(tmp_path_factory) -> str:
    # every matrix Q4_K: ffn_down too, so decode's second int8 copy (the GLU output) is used
    return str(write_model(tmp_path_factory.mktemp("gpu") / "wide_q4k.gguf", WIDE, "q4_k")[0])


@pytest.mark.parametrize("mix", ["q4_k", "q4_k_m"])
def test_int8_x_decode_matches_the_cpu_engine(wide, wide_q4k, all_t, monkeypatch, mix) -> None:
    # the default: the T GEMVs (Q4_K everywhere, or Q4_K_M's Q6_K attn_v, ffn_down and head)
    # multiply int8 copies of their inputs written by the norms and the GLU (dp4a on a GPU,
    # its integer twin under the interpreter)
    path = wide_q4k if mix == "q4_k" else wide
    used: list[tuple] = []

    def spy(tag, fn, *keys):  # records which int8 buffers each T launch was given
        def call(*a, **k):
            used.append((tag, *(k.get(key) is not None for key in keys)))
            return fn(*a, **k)
        return call

    monkeypatch.setattr(gemv_t, "gemv_t_glu", spy("glu", gemv_t.gemv_t_glu, "xq", "out_q"))
    monkeypatch.setattr(gemv_t, "gemv_t", spy("one", gemv_t.gemv_t, "xq"))
    monkeypatch.setattr(gemv_t3, "gemv_t3", spy("qkv", gemv_t3.gemv_t3, "xq"))
    with beside_cpu(plan(path, act_dtype="bf16", logits_rows=12),
                    plan(path, logits_rows=12)) as (g, c):
        assert g.pipe.stages[0].xq is not None
        errs, _ = decode_errors(g, c, ids(3, 1))
        assert max(errs) < 3e-2
        assert ("glu", True, True) in used and ("one", True) in used and ("qkv", True) in used


def test_attention_output_on_its_int8_copy_decodes_as_the_cpu_engine(tmp_path, wide_q4k,
                                                                      monkeypatch) -> None:
    # decode's attention kernel writes the int8 copy of its output (the GLU output's slot,
    # free until the GLU), and an IQ3_S attn_output (matrices.ATTN_Q8_TYPES), in the T layout
    # whatever its size, multiplies that copy; prefill's rows read x as before. So does an
    # IQ2_XXS one; a Q4_K attn_output keeps reading x, and
    # CARVE_ATTN_Q8=0 turns the copy off
    iq = str(write_model(tmp_path / "iq3_s.gguf", WIDE, "iq3_s")[0])
    seen: list[tuple[str, int]] = []
    decode, one = attention.attn_decode, gemv_t.gemv_t

    def attn_spy(*a, **k):
        seen.append(("attention", id(k.get("out_q"))))
        return decode(*a, **k)

    def one_spy(*a, **k):
        seen.append(("one", id(k.get("xq"))))
        return one(*a, **k)

    monkeypatch.setattr(attention, "attn_decode", attn_spy)
    monkeypatch.setattr(gemv_t, "gemv_t", one_spy)
    with beside_cpu(plan(iq, act_dtype="bf16", logits_rows=12),
                    plan(iq, logits_rows=12)) as (g, c):
        (st,) = g.pipe.stages
        assert {ly.attn.output.ggml_type for ly in st.layers} == {qt.IQ3_S}
        copies = {id(ly.attn.xq_o) for ly in st.layers}
        assert None not in {ly.attn.xq_o for ly in st.layers} and len(copies) == 1
        assert all(ly.attn.output.t_bytes is not None for ly in st.layers)
        errs, _ = decode_errors(g, c, ids(3, 1))
        assert max(errs) < 3e-2
    assert ("attention", *copies) in seen and ("one", *copies) in seen
    iq2 = str(write_model(tmp_path / "iq2_xxs.gguf", WIDE, "iq2_xxs")[0])
    for path, options, copy in ((iq2, RunnerOptions(), True),
                                (iq2, RunnerOptions(attn_q8=False), False),
                                (wide_q4k, RunnerOptions(), False)):
        g = load(plan(path, act_dtype="bf16"), options=options)
        try:
            assert all((ly.attn.xq_o is not None) == copy for ly in g.pipe.stages[0].layers)
        finally:
            g.close()


@pytest.mark.parametrize(("mix", "t_type"), [("q2_k", qt.Q2_K), ("iq2_xxs", qt.IQ2_XXS),
                                             ("iq3_xxs", qt.IQ3_XXS), ("q5_k_m", qt.Q5_K),
                                             ("q8_0", qt.Q8_0)])
def test_low_bit_t_matrices_decode_as_the_cpu_engine(tmp_path, all_t, mix, t_type) -> None:
    # the T bodies of gemv_t_low.py and gemv_t_grid.py (and Q5_K's) through the runner on decode's int8 copies:
    # the Q2_K mix's gate/up in one T launch beside its Q3_K ffn_down and attn_v; the
    # IQ2_XXS mix's gate/up, down (the GLU's int8 copy) and q/k/v (IQ2_XXS q and k beside a
    # Q2_K v); the IQ3_XXS mix's gate/up and down beside its IQ3_S attn_v; the Q5_K_M mix's
    # Q5_K gate/up read in the same steps; Q8_0 everywhere, its
    # blocks of 32 split as 256-value blocks would. (IQ4_XS's T body is
    # slow under the interpreter: tests/kernels/test_gemv_t.py and test_q8x.py check it.)
    path = str(write_model(tmp_path / f"{mix}.gguf", WIDE, mix)[0])
    with beside_cpu(plan(path, act_dtype="bf16", logits_rows=12),
                    plan(path, logits_rows=12)) as (g, c):
        (st,) = g.pipe.stages
        assert st.xq is not None
        assert all(ly.ffn.gate.ggml_type == t_type and ly.ffn.gate.t_bytes is not None
                   and ly.ffn.up.t_bytes is not None and ly.ffn.fused == "t_glu"
                   for ly in st.layers)
        if t_type in (qt.IQ2_XXS, qt.Q8_0):
            assert all(ly.ffn.down.t_bytes is not None and ly.attn.fused == "t3"
                       for ly in st.layers)
        assert_agree(g, c, ids(12), 3e-2)


def test_t_layout_decodes_as_the_gguf_order_kernels(wide, all_t) -> None:
    # float32 activations on float x (q8x off): the T and the GGUF-order GEMVs are float32
    # sums of the same exact weights, so decode through either differs by rounding only
    t = load(plan(wide, act_dtype="f32"), options=RunnerOptions(q8x=False))
    p = load(plan(wide, act_dtype="f32"), options=RunnerOptions(q8x=False, t_layout=False))
    try:
        (ts,), (ps,) = t.pipe.stages, p.pipe.stages
        assert ts.tmats and not ps.tmats and ts.xq is None and ps.xq is None
        assert {(ly.attn.fused, ly.ffn.fused) for ly in ps.layers} == {("gemv3", "gemv_glu")}
        prompt = ids(12)
        assert rel(t.logits(prompt), p.logits(prompt)) < 1e-5  # prefill: the same dq GEMMs
        errs, _ = decode_errors(t, p, ids(4, 2))
        assert max(errs) < 1e-4
    finally:
        t.close()
        p.close()


def test_perplexity_on_the_runner_matches_the_cpu_engine(cached) -> None:
    from engine.runtime.perplexity import perplexity

    g, c = cached
    text = ids(48, 7)  # three windows of 16, one chunk each
    pg, pc = perplexity(g, text, 16, None), perplexity(c, text, 16, None)
    assert pg.chunks == pc.chunks == 3 and pg.scored == pc.scored
    assert abs(pg.value / pc.value - 1) < 1e-2


KERNEL_MODULES = (attention, gemv_fused, gemv_t, gemv_t3, glu, kv_cache, norm, quant_matmul,
                  rope)


def kernel_inputs(monkeypatch) -> list[torch.Tensor]:
    """Every tensor handed to a kernel wrapper of carve_kernels/ from now on (lists and tuples of
    arguments opened)."""
    seen: list[torch.Tensor] = []

    def walk(v) -> None:
        if isinstance(v, torch.Tensor):
            seen.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)

    def spy(fn):
        def call(*a, **k):
            walk(a)
            walk(tuple(k.values()))
            return fn(*a, **k)
        return call

    for mod in KERNEL_MODULES:
        for name, fn in list(vars(mod).items()):
            if inspect.isfunction(fn) and fn.__module__ == mod.__name__ and name[0] != "_":
                monkeypatch.setattr(mod, name, spy(fn))
    return seen


def test_spans_cover_every_tensor_the_runner_touches(cached, monkeypatch) -> None:
    g, _ = cached
    seen = kernel_inputs(monkeypatch)
    g.generate(ids(5, 2), GREEDY, set(), lambda t: True)  # prefill and decode steps
    # decode replays the graph captured at load (no wrapper runs); prefill reads the dequant
    # cache's copies: one eager decode step shows the launches the graph holds
    g.pipe.decode_eager()
    (dl,) = g.layout.devices
    (st,) = g.pipe.stages
    span_names = {s.name for a in dl.arenas for s in a.spans}
    carve = {s.name for a in dl.arenas for s in a.spans if s.purpose in ("weights", "globals")}
    given = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in seen]

    def read(name: str) -> bool:  # some kernel got bytes of this span
        lo, hi = st.spans[name].data_ptr(), st.spans[name].data_ptr() + st.spans[name].nbytes
        return any(a < hi and lo < b for a, b in given)

    assert {n for n in carve if read(n)} == carve  # every weight the stage holds is used
    (arenas,) = g.pipe.arenas
    bounds = [(a.data_ptr(), a.data_ptr() + a.numel()) for a in arenas]
    for name, t in st.spans.items():
        assert name in span_names
        lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(a <= lo and hi <= b for a, b in bounds), name
    assert {"buf." + n for n in st.buf} <= span_names
    # and nothing else: every kernel read and wrote inside the arenas
    assert all(any(a <= lo and hi <= b for a, b in bounds) for lo, hi in given)


def test_runner_options_reach_every_kernel_launch(tiny, monkeypatch) -> None:
    # RunnerOptions.pdl goes to every kernel the runner launches as a plain argument (the
    # kernels read no environment); q8x and t_layout decide the stage's kernels at load
    flags: list[bool] = []
    opts = pdl.opts
    monkeypatch.setattr(pdl, "opts", lambda t, use_pdl: flags.append(use_pdl) or opts(t, use_pdl))
    for on in (False, True):
        flags.clear()
        g = load(plan(tiny), options=RunnerOptions(pdl=on))
        try:
            g.generate(ids(3, 4), dataclass_replace(GREEDY, max_tokens=2), set(), lambda t: True)
        finally:
            g.close()
        assert flags and set(flags) == {on}


@pytest.fixture(scope="module")
def exact(tiny):
    """Prefill chunks of 8 rows go through the f32 GEMV (no cache), as the CPU engine's f32
    path does: greedy ids must agree exactly."""
    pl = plan(tiny, prefill_chunk=8, cache_reserve=NO_CACHE, logits_rows=1)
    g = load(pl)
    yield g, pl
    g.close()


def test_greedy_ids_match_the_cpu_engine_and_a_two_stage_split(exact, tiny) -> None:
    g, pl = exact
    prompt = ids(12, 3)
    one: list[int] = []
    g.generate(prompt, GREEDY, set(), one.append)
    c = Session.load(pl)
    ref: list[int] = []
    c.generate(prompt, GREEDY, set(), ref.append)
    c.close()
    assert one == ref and len(one) == 4
    two = load(plan(tiny, SIM, (0, 1, 2), prefill_chunk=8, cache_reserve=NO_CACHE,
                    logits_rows=1))
    assert [st.le - st.lb for st in two.pipe.stages] == [1, 1]
    split: list[int] = []
    two.generate(prompt, GREEDY, set(), split.append)
    assert split == one
    assert rel(two.forward([one[-1]], 16, "last"), g.forward([one[-1]], 16, "last")) < 1e-6
    two.close()


def test_bf16_two_stages_give_the_logits_of_one_to_the_bit(tiny) -> None:
    """bf16 activations: the stream crosses a stage boundary as stored (bf16), and a fused
    add-and-norm inside a stage normalizes that stored value too, so a split changes no bit of
    prefill's or decode's logits (it did: ~4e-3 apart, which flipped a near tie of greedy ids)."""
    got = [chunk_and_decode_rows(load(plan(tiny, devices, split, prefill_chunk=8,
                                           cache_reserve=NO_CACHE, logits_rows=1,
                                           act_dtype="bf16")), ids(12, 3))
           for devices, split in ((SIM[:1], (0, 2)), (SIM, (0, 1, 2)))]
    assert torch.equal(got[0], got[1])


def test_nan_names_the_first_bad_layer(exact) -> None:
    g, _ = exact
    (st,) = g.pipe.stages
    w = st.spans["blk.1.ffn_norm.weight"].view(torch.float32)
    keep = float(w[0])
    w[0] = float("nan")
    try:
        with pytest.raises(CarveError, match="NaN/inf, first in layer 1") as e:
            g.logits(ids(6, 4))
        assert "\n" not in str(e.value)
    finally:
        w[0] = keep
    assert torch.isfinite(g.logits(ids(6, 4))).all()


def test_a_cancelled_load_leaves_nothing_allocated(tiny, watched) -> None:
    made, _, alive = watched
    seen = []
    with pytest.raises(CarveError, match="cancelled"):
        load(plan(tiny, SIM, (0, 1, 2), cache_reserve=NO_CACHE),
             on_progress=lambda *a: seen.append(a), cancelled=lambda: bool(seen))
    assert made and seen and alive() == 0


def test_close_after_a_sampled_reply_frees_every_arena(tiny, monkeypatch) -> None:
    ranges = []

    def new_arena(nbytes, device):
        t = torch.empty(nbytes, dtype=torch.uint8, device=device)
        ranges.append((t.data_ptr(), t.data_ptr() + nbytes))
        return t

    monkeypatch.setattr(gpu_stage, "new_arena", new_arena)
    g = load(plan(tiny))
    sampled = SamplingParams(temperature=0.8, seed=3, max_tokens=3)
    g.generate(ids(5, 2), sampled, set(), lambda t: True)  # the GPU sampler's path
    g.close()
    gc.collect()
    # no tensor anywhere (the session object is still alive) is a view into an arena
    views = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.numel()
             and any(a <= o.data_ptr() < b for a, b in ranges)]
    assert ranges and not views


def test_a_failed_allocation_leaves_nothing_allocated(tiny, watched) -> None:
    made, state, alive = watched
    pl = plan(tiny, SIM, (0, 1, 2), cache_reserve=NO_CACHE)
    state["fail_at"] = len(plan_arenas(pl)[0]) + 1  # the second device's first arena
    with pytest.raises(CarveError, match=r"\(GPU 1\): could not allocate arena 1 of") as e:
        load(pl)
    assert "\n" not in str(e.value)
    assert len(made) == state["fail_at"] - 1 and alive() == 0


def test_a_failure_after_loading_frees_everything_and_keeps_its_type(tiny, watched,
                                                                     monkeypatch) -> None:
    made, _, alive = watched

    def boom(self, on_progress=None, cancelled=None) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(GpuSession, "_warm_up", boom)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        load(plan(tiny, cache_reserve=NO_CACHE))
    assert made and alive() == 0


def plan_arenas(pl: Plan) -> list[list]:
    from engine.planning.price import price

    return [list(d.arenas) for d in price(pl).devices]


def test_memory_taken_since_the_check_fails_before_any_allocation(tiny, watched,
                                                                   monkeypatch) -> None:
    made, _, _ = watched
    pl = plan(tiny, SIM[:1], (0, 2))
    dl = plan_arenas(pl)
    need = sum(a.nbytes for a in dl[0])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (need // 2, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: 0)
    monkeypatch.setattr(gpu_memory, "nvml_use", lambda i: (None, 700 << 20))
    with pytest.raises(CarveError) as e:
        GpuSession.load(pl)
    msg = str(e.value)
    assert msg.startswith("cuda:0 (GPU 0): another process took memory since the check")
    assert "short" in msg and "\n" not in msg
    assert made == []


def test_the_runner_is_chosen_for_cuda_plans_of_supported_archs(tiny, monkeypatch) -> None:
    from engine.gguf.hparams import HParams
    from engine.gguf.reader import GGUFModel

    hp = HParams.from_model(GGUFModel.open(tiny))
    assert why_not(plan(tiny), hp) == "the plan places layers on the CPU"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    gpu = plan(tiny, SIM[:1], (0, 2))
    assert why_not(gpu, hp) is None
    assert "not mamba" in why_not(gpu, type("H", (), {"arch": "mamba"})())
    assert why_not(gpu, hp, RunnerOptions(runner="torch")) == "CARVE_RUNNER=torch"


@pytest.fixture
def engine(monkeypatch):
    """A server Engine whose Session.load is the GPU runner (on DEV), writing to a buffer."""
    monkeypatch.setattr(Session, "load", classmethod(
        lambda cls, pl, on_progress=None, cancelled=None, options=RunnerOptions():
        GpuSession.load(pl, on_progress, cancelled, devices=[DEV] * len(pl.devices),
                        options=options)))
    out = io.BytesIO()
    eng = server.Engine(out)
    return eng, lambda: p.LineDecoder(p.EVENTS).feed(out.getvalue())


def test_server_cancelled_load_emits_unloaded_and_frees(tiny, watched, engine) -> None:
    made, _, alive = watched
    eng, events = engine
    state = {"cancel": False}
    emit = eng.emit

    def cancel_on_progress(msg) -> None:  # a stop arriving once the weights started coming
        state["cancel"] |= isinstance(msg, p.Progress)
        emit(msg)

    eng.emit = cancel_on_progress
    eng.load(p.Load(plan(tiny, cache_reserve=NO_CACHE).to_json()), lambda: state["cancel"])
    assert isinstance(events()[-1], p.Unloaded) and eng.session is None
    assert made and alive() == 0


def test_server_load_that_no_longer_fits_is_one_error_line(tiny, watched, engine,
                                                           monkeypatch) -> None:
    made, _, _ = watched
    eng, events = engine
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda i: (1 << 20, 8 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda i=None: 0)
    monkeypatch.setattr(gpu_memory, "nvml_use", lambda i: (None, None))
    monkeypatch.setattr(Session, "load", classmethod(
        lambda cls, pl, on_progress=None, cancelled=None, options=RunnerOptions():
        GpuSession.load(pl, options=options)))
    eng._requests.put((1, p.Load(plan(tiny, SIM[:1], (0, 2)).to_json())))
    eng._requests.put((2, p.Shutdown()))
    assert eng.serve() == 0
    (err,) = [e for e in events() if isinstance(e, p.Error)]
    assert err.message.startswith("cuda:0 (GPU 0): another process took memory")
    assert "\n" not in err.message and not err.fatal
    assert made == [] and eng.session is None


# ------------------------------------------------------------------ on a real GPU


gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def cuda_plan(path: str, n: int = 1, **kw) -> Plan:
    """n stages on n GPUs where there are that many, else stages sharing GPU 0."""
    have = torch.cuda.device_count()
    devs = []
    for i in range(n):
        free, total = torch.cuda.mem_get_info(i % have)
        share = -(-n // have)
        devs.append(DeviceSpec(index=i % have, name=torch.cuda.get_device_name(i % have),
                               total=total, free=free // share))
    split = (0, 2) if n == 1 else (0, 1, 2)
    return plan(path, devs, split, **kw)


def settled_reserved() -> list[int]:
    """memory_reserved per GPU once cuBLAS holds its default stream's workspace (it keeps it
    until the last pipeline's close: part of the priced runtime overhead, not of the arenas)
    and the cache is empty."""
    for i in range(torch.cuda.device_count()):
        a = torch.ones(64, 64, device=f"cuda:{i}")
        _ = (a @ a).sum().item()
        b = a.bfloat16()
        _ = (b @ b).sum().item()
        del a, b
        torch.cuda.synchronize(i)
    torch.cuda.empty_cache()
    return [torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())]


@pytest.fixture
def calibration_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    return tmp_path


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("arena", ["packed", "per-tensor", "chunked:1"])
@pytest.mark.parametrize("stages", [1, 2])
def test_cuda_priced_equals_reserved_and_logits_match(tiny, arena, stages,
                                                      calibration_home) -> None:
    base = settled_reserved()
    pl = cuda_plan(tiny, stages, arena=arena)
    own_gpus = len({d.index for d in pl.devices}) == stages
    g = GpuSession.load(pl)
    rep = g.memory_report()
    for r in rep:
        assert r["runner"] == "triton" and r["allocated"] == r["reserved"]
        if own_gpus:  # a GPU of its own: the allocator replays exactly what price() modelled
            assert r["reserved"] == r["priced"], r
        if r["nvml_used"] is not None and r["overhead_measured"] is not None:
            assert 0 < r["overhead_measured"] < 4 * GIB, r
    # stages sharing a GPU may share the allocator's small segments: never more than priced
    assert sum(r["reserved"] for r in rep) <= sum(r["priced"] for r in rep)
    measured = rep[0]["overhead_measured"]
    if stages == 1 and measured is not None:  # remembered: the next price uses it
        from engine.planning.price import price

        assert price(pl).devices[0].terms["overhead"] == measured
    c = Session.load(plan(tiny, logits_rows=4, arena=arena))
    prompt = ids(20)
    assert rel(g.logits(prompt), c.logits(prompt)) < 3e-2
    g.generate(prompt, GREEDY, set(), lambda t: True)
    after_one = [torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())]
    g.generate(ids(30, 5), dataclass_replace(GREEDY, max_tokens=20), set(), lambda t: True)
    g.logits(ids(24, 6))
    # nothing allocated per token or per chunk once warm
    assert [torch.cuda.memory_reserved(i) for i in range(torch.cuda.device_count())] == after_one
    g.close()
    c.close()
    # nothing of the session left: its arenas, and its streams' cuBLAS workspaces (the last
    # pipeline's close frees every workspace; settling makes the default stream's again)
    assert settled_reserved() == base


@pytest.mark.gpu
@gpu
def test_cuda_greedy_ids_match_cpu_and_split(tiny, calibration_home) -> None:
    kw = {"prefill_chunk": 8, "cache_reserve": NO_CACHE, "logits_rows": 1}
    prompt = ids(12, 3)
    runs = []
    for pl in (cuda_plan(tiny, 1, **kw), cuda_plan(tiny, 2, **kw), plan(tiny, **kw)):
        s = GpuSession.load(pl) if pl.devices[0].index >= 0 else Session.load(pl)
        out: list[int] = []
        s.generate(prompt, dataclass_replace(GREEDY, max_tokens=16), set(), out.append)
        s.close()
        runs.append(out)
    assert runs[0] == runs[1] == runs[2]


@pytest.mark.gpu
@gpu
def test_cuda_prefill_graphs_give_the_eager_logits_and_ids(tiny, calibration_home) -> None:
    """CARVE_PREFILL_GRAPH (on by default): chunks replay the graphs of their padded length
    (8, 16 or 32 rows) captured at the load's warm-up, at any position (the chunk reads its
    positions on the device), with the eager chunks' logits and greedy ids; nothing is
    allocated per chunk."""
    kw = {"ctx": 128, "prefill_chunk": 32, "cache_reserve": NO_CACHE, "logits_rows": 4}
    prompt = ids(53, 3)  # a full chunk at 0, then 21 rows padded to 32
    got = []
    for on in (False, True):
        g = GpuSession.load(cuda_plan(tiny, 1, **kw), options=RunnerOptions(prefill_graph=on))
        try:
            st = g.pipe.stages[0]
            assert set(st._prefill_graphs) == ({8, 16, 32} if on else set())  # at the warm-up
            logits = g.logits(prompt).clone()
            before = torch.cuda.memory_reserved(0)
            out: list[int] = []
            g.generate(prompt, dataclass_replace(GREEDY, max_tokens=12), set(), out.append)
            assert torch.cuda.memory_reserved(0) == before
            got.append((logits, out))
        finally:
            g.close()
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]


@pytest.mark.gpu
@gpu
def test_cuda_decode_with_the_l2_prefetch_gives_the_same_logits_and_ids(wide, all_t,
                                                                         calibration_home) -> None:
    """CARVE_L2_PREFETCH (carve_kernels/l2.py): each decode layer's gate/up T matrices pulled
    into L2 from the stage's prefetch stream change no logit and no greedy id."""
    prompt = ids(8, 5)
    got = []
    for mib in (0, 1):
        g = GpuSession.load(cuda_plan(wide, 1), options=RunnerOptions(l2_prefetch=mib))
        try:
            st = g.pipe.stages[0]
            assert (st._l2_stream is not None) == bool(mib)  # the warm-up's step prefetched
            out: list[int] = []
            g.generate(prompt, dataclass_replace(GREEDY, max_tokens=12), set(), out.append)
            got.append((g.logits(prompt).clone(), out))
        finally:
            g.close()
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]
    assert len(got[0][1]) == 12


@pytest.mark.gpu
@gpu
def test_cuda_short_chunks_on_the_cache_copies_match_the_cpu_engine(tiny,
                                                                   calibration_home) -> None:
    """Prefill chunks of 2-8 rows with every matrix in the dequant cache run one GEMM each on
    the copies (no GEMV on 16-bit x): their logits as the CPU engine's, and as the same
    chunks' GEMVs on the packed bytes (no cache)."""
    prompt = ids(13, 4)  # chunks of 8 and 5 rows
    logits = []
    for reserve in (0, NO_CACHE):
        g = GpuSession.load(cuda_plan(tiny, 1, prefill_chunk=8, cache_reserve=reserve,
                                      logits_rows=1))
        cached = [m.dq is not None for st in g.pipe.stages for lay in st.layers
                  for m in lay.attn.qkv]
        assert all(cached) if reserve == 0 else not any(cached)
        logits.append(g.logits(prompt).float().cpu())
        g.close()
    c = Session.load(plan(tiny, prefill_chunk=8, logits_rows=1))
    ref = c.logits(prompt).float()
    c.close()
    assert rel(logits[0], ref) < 3e-2 and rel(logits[1], ref) < 3e-2


def dataclass_replace(obj, **kw):
    import dataclasses

    return dataclasses.replace(obj, **kw)


@pytest.mark.gpu
@gpu
def test_cuda_fit_check_and_cancel_leave_the_gpu_as_it_was(tmp_path, calibration_home) -> None:
    # a model whose arenas (hundreds of MiB) dwarf the few MiB the driver keeps back from
    # any one allocation, so that "another process" can leave less than they need
    path = str(write_model(tmp_path / "small.gguf", "qwen2-0.5b", "q4_k_m")[0])
    base = settled_reserved()
    free, total = torch.cuda.mem_get_info(0)
    pl = plan(path, (DeviceSpec(index=0, name=torch.cuda.get_device_name(0), total=total,
                                free=free),), (0, 24))
    need = sum(a.nbytes for arenas in plan_arenas(pl) for a in arenas)
    free, _ = torch.cuda.mem_get_info(0)
    blocker = torch.empty(free - min(need // 2, 256 << 20), dtype=torch.uint8, device="cuda:0")
    with pytest.raises(CarveError, match="another process took memory since the check"):
        GpuSession.load(pl)
    del blocker
    assert settled_reserved() == base
    seen = []
    with pytest.raises(CarveError, match="cancelled"):
        GpuSession.load(pl, on_progress=lambda *a: seen.append(a), cancelled=lambda: bool(seen))
    assert settled_reserved() == base

"""Experts in host memory on the GPU runner: a layer whose experts the plan keeps in host
memory routes on the device and runs its experts on the CPU (engine/runtime/gpu/host.py);
the logits and greedy ids are those of the same file with every expert in VRAM, the host
arenas are exactly the priced bytes, and a plan the host can no longer hold is refused before
anything is allocated. Without a GPU the runner runs under TRITON_INTERPRET=1."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from gpu_compare import rel
from test_gpu_moe import SHAPES

from engine.gguf.reader import GGUFModel
from engine.hardware import native
from engine.hardware.devices import DeviceSpec
from engine.planning.host import cpu_layout
from engine.planning.plan import Plan
from engine.planning.price import price
from engine.runtime.gpu.session import GpuSession
from engine.runtime.models import cpu_native
from engine.runtime.options import RunnerOptions
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from engine.synth.gen import write_model
from spec.errors import CarveError

GIB = 1 << 30
ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
GPU = DeviceSpec(index=0, name="card", total=16 * GIB, free=16 * GIB, simulated=True)
HOST = DeviceSpec(-1, "host", 8 * GIB, 8 * GIB, simulated=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("host")
    return {arch: str(write_model(root / f"{arch}.gguf", SHAPES[arch], "q4_k_m")[0])
            for arch in SHAPES}


def plan(path: str, resident: tuple[int, ...] = (), **kw) -> Plan:
    dtype = "bf16" if ON_GPU else "f32"
    return Plan(model=path, devices=(GPU,), split=(0, 2), ctx=64, prefill_chunk=16,
                cache_reserve=0, logits_rows=16, act_dtype=dtype, experts_resident=resident,
                host=HOST, **kw)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def run(sess, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """Logits of a prefill (every row) and of decode steps after it."""
    out = [sess.logits(prompt).clone()]
    sess.kv.n_past = len(prompt)
    for tok in steps:
        out.append(sess.forward([tok], sess.kv.n_past, "last")[-1:].clone())
        sess.kv.n_past += 1
    return out


def all_in_vram(path: str, prompt: list[int], steps: list[int]) -> list[torch.Tensor]:
    """`run` on the file with every expert in VRAM: the reference of a host placement."""
    everything = GpuSession.load(plan(path), devices=[DEV], remember=False)
    try:
        return run(everything, prompt, steps)
    finally:
        everything.close()


# the same weights, sums in another order: the GPU runner's bound against the CPU engine
# (tests/engine/test_gpu_moe.py, f32 activations); on a GPU bf16 activations
BOUND = 2e-2 if ON_GPU else 5e-3


def assert_agree(got: list[torch.Tensor], ref: list[torch.Tensor], what: str,
                 bound: float = BOUND) -> None:
    """The logits of every position within ``bound`` of the reference's (printed), and the
    same greedy ids."""
    errs = [rel(a, b) for a, b in zip(got, ref, strict=True)]
    print(f"{what}: rel errors {', '.join(f'{e:.1e}' for e in errs)}")
    assert max(errs) < bound
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in ref]


def held_bytes_match(h) -> None:
    """Every expert a layer's cache says it holds is, byte for byte, in its slot."""
    for e, slot in h.cache.held.items():
        for m, view, per in zip(h.mats, h.cache.views, h.cache.slices, strict=True):
            got = view.reshape(-1)[slot * per:(slot + 1) * per].cpu()
            assert torch.equal(got, m.raw[e * per:(e + 1) * per].cpu()), (e, slot)


def record_fills(stream, poison: bool = False) -> list[list[int] | None]:
    """The experts each `Stream.fill` of ``stream`` is asked for from now on (None: all);
    ``poison``: the span set to all-ones bytes (NaN scales wherever read) before each."""
    fills: list[list[int] | None] = []
    fill = stream.fill

    def recorded(experts: list[int] | None) -> int:
        fills.append(experts)
        if poison:
            for view in stream.views:
                view.fill_(255)
        return fill(experts)

    stream.fill = recorded
    return fills


def prefill_bytes(fills: list[list[int] | None], whole: int, ne: int) -> int:
    """What the one fill in ``fills`` (a prefill's) moved of a layer's ``whole`` expert bytes:
    its chosen experts' share of ``ne``."""
    (chosen,) = fills
    return whole if chosen is None else len(chosen) * whole // ne


def test_host_layers_give_the_logits_and_ids_of_all_in_vram(files, caplog) -> None:
    """qwen3moe, both MoE layers' experts on the host, run on the GPU, with 3 expert-cache
    slots: layer 0's 2 of them hold a decode step's 2 experts (copied in on a miss, the least
    recently used out); layer 1's 1 cannot, so its chosen experts are copied into the staging
    span; a prefill of 12 rows copies the experts its rows chose (the span's others poisoned
    first: no kernel reads them). Against the same file with every expert in VRAM, over the
    prefill and two decode steps: the same logits and greedy id at every position."""
    path = files["qwen3moe"]
    prompt, steps = ids(12), ids(2, 1)
    everything = GpuSession.load(plan(path), devices=[DEV], remember=False)
    try:
        assert everything.pipe.report[0]["host_allocated"] == 0
        ref = run(everything, prompt, steps)
    finally:
        everything.close()
    pl = plan(path, resident=(0,), expert_slots=(3,))
    layout = price(pl, model_file := GGUFModel.open(path))
    assert layout.host is not None and layout.devices[0].terms["experts"] == 0
    g = GpuSession.load(pl, devices=[DEV], remember=False, model=model_file)
    try:
        (rep,) = g.pipe.report
        # the host arenas are exactly the priced bytes (pinned on a GPU, pageable here)
        assert rep["host_priced"] == rep["host_allocated"] == layout.devices[0].host > 0
        assert rep["host_pinned"] == (rep["host_allocated"] if ON_GPU else 0)
        st = g.pipe.stages[0]
        # decode runs in pieces: before each host layer's experts (a graph on a GPU), the
        # experts (eager), and the rest of the step
        assert st.graph is None and len(st.pieces) == 2 * 2 + 1
        hosts = [la.ffn.host for la in st.layers]
        assert [h.cache.n for h in hosts] == [2, 1]
        moved = hosts[1].moved
        c0 = hosts[0].cache
        counted, seeded = c0.hits + c0.misses, [h.cache.seeded for h in hosts]
        fills = record_fills(hosts[1].stream, poison=True)
        got = run(g, prompt, steps)
        assert_agree(got, ref, "host experts on the GPU vs VRAM")
        # layer 1: the ids down (2 per row), then the prefill's chosen experts' slices, each
        # decode step its 2 chosen experts' (a quarter of the tensors each: 4 experts)
        whole = sum(t.nbytes for t in model_file.tensors
                    if t.layer == 1 and t.name.endswith("_exps.weight"))
        chose = 4 if fills[0] is None else len(fills[0])
        assert len(fills) == 3 and all(len(e) == 2 for e in fills[1:])
        assert hosts[1].moved - moved == 12 * 2 * 4 + chose * whole // 4 + 2 * (2 * 4 + 2 * whole // 4)
        assert hosts[1].cache.hits == hosts[1].cache.misses == 0
        # the two decode steps place 2 experts each in layer 0's slots
        assert c0.hits + c0.misses - counted == 2 * 2 and len(c0.held) == 2
        # the prefill seeded each layer's slots from the staging span on the device (nothing
        # of it crossed PCIe: the bytes moved above are exact), at most all of them
        for h, before in zip(hosts, seeded, strict=True):
            per = sum(m.raw.numel() // m.n_expert for m in h.mats)
            assert (h.cache.seeded - before) % per == 0
            assert h.cache.seeded - before <= h.cache.n * per
            held_bytes_match(h)
        # a reply logs what it moved per token and the cache's hit rate
        with caplog.at_level("INFO", logger="carve.engine"):
            g.generate(ids(3), SamplingParams(temperature=0.0, max_tokens=2), set(),
                       lambda t: True)
        line = [r.getMessage() for r in caplog.records if "experts in host memory" in r.message]
        assert len(line) == 1 and "kB moved per token, expert-cache hit rate " in line[0]
        # the GPU computed every host expert: no CPU time
        assert line[0].endswith("%, 0.00 ms of CPU compute per token")
        assert all(h.cpu_s == 0 for h in hosts)
    finally:
        g.close()


def test_the_staging_span_takes_only_the_chosen_experts_a_run_of_neighbours_at_once():
    """`Stream.fill`: the chosen experts of every matrix (and their bias rows) land at their
    own places, neighbours in one copy per tensor; the span's other experts keep their bytes;
    None copies every expert."""
    from types import SimpleNamespace

    from engine.runtime.gpu.host_slots import Stream, expert_runs

    assert expert_runs([0, 1, 2, 5, 7, 8]) == [(0, 3), (5, 6), (7, 9)]
    assert expert_runs([]) == [] and expert_runs([3]) == [(3, 4)]
    n_expert, rows, row_bytes = 6, 2, 8
    mats = [SimpleNamespace(raw=torch.arange(n_expert * rows * row_bytes, dtype=torch.uint8)
                            .add(50 * j), n_expert=n_expert, rows=rows) for j in range(2)]
    bias = torch.arange(n_expert * 4, dtype=torch.float32).view(torch.uint8)
    span = torch.full((4096,), 7, dtype=torch.uint8)
    st = Stream(span, mats, [bias])
    copies = []
    real = torch.Tensor.copy_

    def counted(dst, src, non_blocking=False):
        copies.append(src.numel())
        return real(dst, src, non_blocking=non_blocking)

    per = rows * row_bytes
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "copy_", counted)
        assert st.fill([1, 2, 4]) == 3 * (2 * per + 16)
    assert copies == [2 * per, per] * 2 + [2 * 16, 16]  # two runs a tensor
    for m, view in zip(mats, st.views, strict=True):
        got, want = view.reshape(-1), m.raw
        for e in range(n_expert):
            part = slice(e * per, (e + 1) * per)
            if e in (1, 2, 4):
                assert torch.equal(got[part], want[part]), e
            else:
                assert bool((got[part] == 7).all()), e
    b = st.biases[0].view(n_expert, 4)
    assert b[1].tolist() == [4, 5, 6, 7] and b[4].tolist() == [16, 17, 18, 19]
    assert st.fill(None) == 2 * n_expert * per + bias.numel()
    assert all(torch.equal(v.reshape(-1), m.raw) for m, v in zip(mats, st.views, strict=True))


def test_seeding_the_cache_holds_the_experts_chosen_last_and_copies_only_what_it_lacks():
    """`SlotCache.seed` after a chunk ran on the staging span: the n experts the rows chose
    last (a row's later choices after its earlier ones) end up held, most recent last, each
    slot holding its expert's bytes of every matrix; an expert already held is not copied
    again, and the one evicted for a newcomer is never one of those wanted."""
    from types import SimpleNamespace

    from engine.planning.arena import align_up
    from engine.runtime.gpu.host_slots import SlotCache

    n_expert, rows, row_bytes = 6, 2, 8
    mats = [SimpleNamespace(raw=torch.arange(n_expert * rows * row_bytes, dtype=torch.uint8)
                            .add(50 * j), n_expert=n_expert, rows=rows) for j in range(2)]
    staged = [m.raw.view(n_expert * rows, row_bytes).clone() for m in mats]
    per = rows * row_bytes
    cache = SlotCache(torch.zeros(2 * align_up(3 * per), dtype=torch.uint8), 3, mats)
    assert cache.place([0, 5]) == {0: 0, 5: 1} and cache.copied == 2 * 2 * per
    # rows' choices: 1 2 | 3 1 | 4 5: the last three distinct, oldest first, are 1, 4, 5
    cache.seed(staged, [[1, 2], [3, 1], [4, 5]])
    assert list(cache.held) == [1, 4, 5]
    assert cache.held[5] == 1  # held already: kept in its slot, not copied
    assert cache.seeded == 2 * 2 * per  # 1 and 4, both matrices
    assert cache.copied == 2 * 2 * per  # nothing more from host memory
    assert cache.hits == 0 and cache.misses == 2  # seeding is no placement
    held_bytes_match(SimpleNamespace(cache=cache, mats=mats))
    # then a decode row's placement finds them
    assert cache.place([4, 5]) == {4: cache.held[4], 5: 1} and cache.hits == 2


def test_a_prompt_leaves_the_expert_cache_holding_what_its_last_rows_chose(files) -> None:
    """qwen3moe, both layers' experts on the host with expert-cache slots: a prefill chunk too
    wide for the slots runs from the staging span (the experts its rows chose copied in), and leaves
    the layer's slots holding the experts its last rows chose, copied from the span on the
    device; nothing more crosses PCIe than those experts, and the decode steps after it
    give the logits and ids of every expert in VRAM."""
    path = files["qwen3moe"]
    prompt, steps = ids(12, 5), ids(2, 6)
    ref = all_in_vram(path, prompt, steps)
    g = GpuSession.load(plan(path, resident=(0,), expert_slots=(4,)), devices=[DEV],
                        remember=False)
    try:
        hosts = [la.ffn.host for la in g.pipe.stages[0].layers]
        for h in hosts:  # empty slots, as after a load that placed nothing
            h.cache.held.clear()
            h.cache.free = list(range(h.cache.n - 1, -1, -1))
            h.cache.seeded = 0
        moved = [h.moved for h in hosts]
        fills = [record_fills(h.stream) for h in hosts]
        first = g.logits(prompt).clone()
        for h, before, filled in zip(hosts, moved, fills, strict=True):
            per = sum(m.raw.numel() // m.n_expert for m in h.mats)
            # 12 rows of 2 ids down, then the experts they chose; the seeding on the device
            (chosen,) = filled
            n = h.cache.mats[0].n_expert if chosen is None else len(chosen)
            assert h.moved - before == 12 * 2 * 4 + per * n
            assert len(h.cache.held) == h.cache.n == 2
            assert h.cache.seeded == 2 * per
            held_bytes_match(h)
        g.kv.n_past = len(prompt)
        got = [first]
        for tok in steps:
            got.append(g.forward([tok], g.kv.n_past, "last")[-1:].clone())
            g.kv.n_past += 1
        assert_agree(got, ref, "decode after a seeded cache vs VRAM")
    finally:
        g.close()


def test_gpt_oss_host_layers_run_from_the_staging_span_with_their_biases(files) -> None:
    """gpt-oss (biases on every expert matrix, the clamped SwiGLU): every MoE layer's experts
    on the host, run on the GPU (biased experts take no cache slots): a prefill of 12 rows
    copies each layer's chosen experts and their biases into the staging span, a decode step's
    kernels read its chosen experts' slices and bias rows where they lie (in place, inside
    the step's graph). Against every expert in VRAM: the same logits and greedy ids."""
    path = files["gpt-oss"]
    prompt, steps = ids(12), ids(2, 1)
    ref = all_in_vram(path, prompt, steps)
    model_file = GGUFModel.open(path)
    g = GpuSession.load(plan(path, resident=(0,), expert_slots=(2,)), devices=[DEV],
                        remember=False, model=model_file)
    try:
        st = g.pipe.stages[0]
        hosts = {la.index: la.ffn.host for la in st.layers
                 if getattr(la.ffn, "host", None) is not None}
        assert len(hosts) == 2
        assert all(h.cache is None and h.stream is not None and h.stream.biases
                   and h.in_place is not None and h.in_place_biases for h in hosts.values())
        assert not st.pieces  # decode is one step again: no layer waits on the host
        moved = {i: h.moved for i, h in hosts.items()}
        fills = {i: record_fills(h.stream, poison=True) for i, h in hosts.items()}
        got = run(g, prompt, steps)
        assert_agree(got, ref, "gpt-oss host experts in place vs VRAM")
        hp = g.hp
        k, ne = hp.n_expert_used, hp.n_expert
        for layer, h in hosts.items():
            whole = sum(t.nbytes for t in model_file.tensors
                        if t.layer == layer and "_exps." in t.name)
            assert any(t.layer == layer and t.name.endswith("_exps.bias")
                       for t in model_file.tensors)
            # the ids down (4 bytes each), then the experts the prompt chose; each decode step
            # reads its k experts' slices and bias rows
            assert h.moved - moved[layer] == (12 * k * 4 + prefill_bytes(fills[layer], whole, ne)
                                              + 2 * (k * whole // ne))
    finally:
        g.close()


@pytest.mark.parametrize("read", ["gather", "direct"])
def test_decode_reads_host_experts_in_place_inside_one_graph(files, read, monkeypatch) -> None:
    """qwen3moe, layer 1's experts on the host, no cache slots: decode reads the routed
    experts in host memory where they lie (pinned, mapped into the GPU's address space; host
    memory itself under the interpreter), gathered into the staging span by a kernel or read
    by the expert kernels themselves, so the step is one graph on a GPU and no piece waits on
    the host; a prefill of 12 rows still copies its chosen experts into the staging span. The same logits and greedy
    ids as every expert in VRAM, and each decode step counts k experts' bytes read."""
    monkeypatch.setenv("CARVE_HOST_READ", read)
    path = files["qwen3moe"]
    prompt, steps = ids(12), ids(3, 1)
    ref = all_in_vram(path, prompt, steps)
    model_file = GGUFModel.open(path)
    g = GpuSession.load(plan(path, resident=(1,)), devices=[DEV], remember=False,
                        model=model_file)
    try:
        st = g.pipe.stages[0]
        (h,) = [la.ffn.host for la in st.layers if getattr(la.ffn, "host", None) is not None]
        assert h.in_place is not None and h.cache is None and h.in_place_biases is None
        assert h.gather == (read == "gather")
        assert st.eager_hosts() == set() and not st.pieces
        assert (st.graph is not None) == ON_GPU
        whole = sum(t.nbytes for t in model_file.tensors
                    if t.layer == 1 and t.name.endswith("_exps.weight"))
        k, ne = g.hp.n_expert_used, g.hp.n_expert
        assert h.row_bytes == k * whole // ne
        moved, fills = h.moved, record_fills(h.stream, poison=True)
        got = run(g, prompt, steps)
        assert_agree(got, ref, f"host experts read in place ({read}) vs VRAM")
        assert h.moved - moved == (12 * k * 4 + prefill_bytes(fills, whole, ne)
                                   + len(steps) * k * whole // ne)
    finally:
        g.close()


def test_a_shared_expert_layer_computed_by_the_cpu_gives_the_logits_of_all_in_vram(files):
    """glm4moe (a dense first layer, then a MoE layer with a shared expert, onto whose output
    the host's sum is added), the plan's host_compute "cpu": prefill and a decode step with
    that layer's experts on the host, computed by the CPU, against every expert in VRAM."""
    path = files["glm4moe"]
    prompt = ids(10)
    out = []
    for resident in ((), (0,)):
        g = GpuSession.load(plan(path, resident=resident, host_compute="cpu"), devices=[DEV],
                            remember=False)
        try:
            assert g.pipe.stages[0].host_layers == ({1} if resident else set())
            # the load's warm-up (on a GPU) ran prefill chunks and decode steps already
            moved0 = g.pipe.stages[0].host_moved()
            out.append(run(g, prompt, ids(1, 2)))  # the prefill, then a decode step
            # per row: the ids, the normed row and the weights down, the f32 sum up (each in
            # its host buffer's dtype: the normed row's follows the activations)
            hosts = g.pipe.stages[0]._hosts()
            row = sum(t[0].nbytes for h in hosts for t in (h.ids, h.x, h.w, h.y))
            assert all(h.y.dtype == torch.float32 for h in hosts)
            assert g.pipe.stages[0].host_moved() - moved0 == (11 * row if resident else 0)
        finally:
            g.close()
    # the CPU's layouts multiply bf16 x by bf16 weights (or bf16 scale/zero pairs) into bf16
    # results: bf16's rounding where the VRAM experts run in float32 (measured: 4.7e-3)
    assert_agree(out[1], out[0], "glm4moe host vs VRAM experts", max(BOUND, 1e-2))


def test_both_decodes_on_the_cpu_and_prefills_on_the_gpu(files, monkeypatch) -> None:
    """qwen3moe, host_compute "both" with the CPU's share every routed expert
    (CARVE_CPU_EXPERTS=2, the interpreter's default): host memory holds each host expert
    tensor's file bytes and, beside it, its CPU layout (cpu.<name>); a prefill of 12 rows
    copies the layer's chosen experts' file bytes into the staging span, each decode step runs its
    experts on the CPU from the layouts (its row down, the sum up, inside the step). Against
    every expert in VRAM: the same logits and greedy ids."""
    monkeypatch.setenv("CARVE_CPU_EXPERTS", "2")
    path = files["qwen3moe"]
    prompt, steps = ids(12), ids(2, 1)
    ref = all_in_vram(path, prompt, steps)
    model_file = GGUFModel.open(path)
    pl = plan(path, resident=(0,), host_compute="both")
    layout = price(pl, model_file)
    g = GpuSession.load(pl, devices=[DEV], remember=False, model=model_file)
    try:
        (rep,) = g.pipe.report
        assert rep["host_priced"] == rep["host_allocated"] == layout.devices[0].host > 0
        st = g.pipe.stages[0]
        hosts = [la.ffn.host for la in st.layers]
        for h in hosts:
            assert h.stream is not None and h.cache is None
            infos = [model_file.tensor(m.name) for m in h.mats]
            assert [m.layout for m in h.cpu_mats] == [
                cpu_layout(t.ggml_type, t.shape[1], t.shape[0]) for t in infos]
            assert "file" not in [m.layout for m in h.cpu_mats]
            assert [type(m).__name__ for m in h.mats] == ["QExperts"] * 3
            span = st.spans["cpu." + h.mats[0].name]
            assert h.cpu_mats[0].span.data_ptr() == span.data_ptr()
        moved = [h.moved for h in hosts]
        fills = [record_fills(h.stream, poison=True) for h in hosts]
        got = run(g, prompt, steps)
        # decode's CPU layouts round to bf16
        assert_agree(got, ref, "both (CPU decode, GPU prefill) vs VRAM", max(BOUND, 1e-2))
        for layer, h in enumerate(hosts):
            whole = sum(t.nbytes for t in model_file.tensors
                        if t.layer == layer and t.name.endswith("_exps.weight"))
            row = sum(t[0].nbytes for t in (h.ids, h.x, h.w, h.y))
            # prefill: its ids down, its chosen experts; each decode step: its row's traffic
            ne = h.mats[0].n_expert
            assert h.moved - moved[layer] == (12 * 2 * 4 + prefill_bytes(fills[layer], whole, ne)
                                              + 2 * row)
            assert h.cpu_s > 0  # the decode steps' experts, on the CPU
        assert st.host_cpu_s() == sum(h.cpu_s for h in hosts)
    finally:
        g.close()


@pytest.mark.parametrize("share", [1, 0])
def test_both_splits_each_decode_row_between_the_cpu_and_the_gpu(files, monkeypatch,
                                                                   share) -> None:
    """qwen3moe, host_compute "both", CARVE_CPU_EXPERTS=1: a decode row's first routed
    expert runs on the CPU from its layout while the GPU reads the other in place (one
    graph on a GPU, the host answering each step's ticket as it runs); prefill still copies
    its chosen experts. Against every expert in VRAM: the same logits and greedy ids; each
    step moves one expert's bytes over PCIe and the row and sum across, and every ticket is
    answered. With a share of 0 (what auto picks where the CPU is too slow to help) the GPU
    reads both experts in place and the CPU computes none."""
    monkeypatch.setenv("CARVE_CPU_EXPERTS", str(share))
    path = files["qwen3moe"]
    prompt, steps = ids(12), ids(3, 1)
    ref = all_in_vram(path, prompt, steps)
    model_file = GGUFModel.open(path)
    g = GpuSession.load(plan(path, resident=(0,), host_compute="both"), devices=[DEV],
                        remember=False, model=model_file)
    try:
        st = g.pipe.stages[0]
        hosts = [la.ffn.host for la in st.layers]
        assert st.cpu_shares == {0: share, 1: share}
        assert all(h.split == bool(share) and h.in_place is not None for h in hosts)
        assert st.eager_hosts() == set() and not st.pieces
        assert (st.graph is not None) == ON_GPU
        moved, cpu_s = [h.moved for h in hosts], [h.cpu_s for h in hosts]
        fills = [record_fills(h.stream, poison=True) for h in hosts]
        got = run(g, prompt, steps)
        assert_agree(got, ref, "both, split 1 CPU + 1 GPU vs VRAM", max(BOUND, 1e-2))
        k, ne = g.hp.n_expert_used, g.hp.n_expert
        for layer, h in enumerate(hosts):
            whole = sum(t.nbytes for t in model_file.tensors
                        if t.layer == layer and t.name.endswith("_exps.weight"))
            row = (k - share) * whole // ne + (
                h.x[0].nbytes + h.y[0].nbytes + 8 * share if share else 0)
            assert h.row_bytes == row
            assert h.moved - moved[layer] == (12 * k * 4 + prefill_bytes(fills[layer], whole, ne)
                                              + len(steps) * row)
            assert (h.cpu_s > cpu_s[layer]) == bool(share)
            f = h.flags.tolist()
            assert f[0] == f[1] and f[2] == 0  # every ticket answered, none timed out
        if share:
            # a wait that gave up marks flags[2]: the next answer still goes, then one sentence
            hosts[0].flags[2] = 1
            with pytest.raises(CarveError, match=r"^host experts of layer 0: the GPU stopped "
                               r"waiting for the CPU's share of a decode step; the host was "
                               r"too slow or busy$"):
                g.forward([steps[0]], g.kv.n_past, "last")
            f = hosts[0].flags.tolist()
            assert f[0] == f[1] and f[2] == 0
    finally:
        g.close()


# qwen3moe at the native kernel's widths (whole 256s): its Q4_K / Q6_K experts need no CPU layout
WIDE = replace(SHAPES["qwen3moe"], n_embd=256)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> str:
    return str(write_model(tmp_path_factory.mktemp("wide") / "qwen3moe.gguf", WIDE,
                           "q4_k_m")[0])


@pytest.fixture(scope="module")
def oss(tmp_path_factory) -> str:
    """gpt-oss as released: MXFP4 experts (widths of 32s) with biases, the rest Q8_0."""
    return str(write_model(tmp_path_factory.mktemp("oss") / "gpt-oss.gguf", SHAPES["gpt-oss"],
                           "mxfp4_moe")[0])


@pytest.mark.skipif(not native.available(), reason="no C compiler to build the native kernel")
@pytest.mark.parametrize(("arch", "share"), [("qwen3moe", 1), ("qwen3moe", 2), ("gpt-oss", 1),
                                           ("gpt-oss", 2)])
def test_both_runs_the_cpu_share_natively_from_the_file_bytes(wide, oss, monkeypatch, arch,
                                                              share) -> None:
    """host_compute "both" where the CPU's native kernel is built, on qwen3moe at widths of
    256 (Q4_K / Q6_K) and gpt-oss (MXFP4 at widths of 32, expert biases, clamped SwiGLU):
    the plan pins the host layers' file bytes alone (no cpu.<name> span), and each decode
    row's first ``share`` routed experts are multiplied by the kernel from those bytes (the
    span the GPU reads in place) while the GPU reads the rest; prefill copies its chosen experts.
    Against every expert in VRAM: the same greedy ids, the logits within the kernel's int8
    activations' rounding."""
    monkeypatch.setenv("CARVE_CPU_EXPERTS", str(share))
    wide = wide if arch == "qwen3moe" else oss
    prompt, steps = ids(12), ids(3, 1)
    ref = all_in_vram(wide, prompt, steps)
    model_file = GGUFModel.open(wide)
    pl = plan(wide, resident=(0,), host_compute="both")
    layout = price(pl, model_file)
    d = layout.devices[0]
    held = {s.name for a in d.host_arenas for s in a.spans}
    assert not any(n.startswith("cpu.") for n in held)
    assert d.terms["host_experts"] == sum(t.nbytes for t in model_file.tensors
                                          if "_exps." in t.name)
    g = GpuSession.load(pl, devices=[DEV], remember=False, model=model_file)
    try:
        (rep,) = g.pipe.report
        assert rep["host_priced"] == rep["host_allocated"] == d.host
        st = g.pipe.stages[0]
        hosts = [la.ffn.host for la in st.layers]
        assert st.cpu_shares == {0: share, 1: share}
        for h in hosts:
            assert h.native is not None and h.cpu_mats is None and h.split
            assert h.native.mats[0].data_ptr() == h.mats[0].raw.data_ptr()
        cpu_s = [h.cpu_s for h in hosts]
        got = run(g, prompt, steps)
        # the CPU kernel's int8 rows against the GPU's int8 copies, each rounding on its own:
        # 1.2e-2 measured on qwen3moe's zero-mean file (the int8 decode's bound of
        # tests/engine/test_gpu_moe.py)
        assert_agree(got, ref, f"{arch} both, {share} of 2 natively on the CPU vs VRAM",
                     max(BOUND, 2e-2))
        assert all(h.cpu_s > c for h, c in zip(hosts, cpu_s, strict=True))
        assert all(h.flags[0] == h.flags[1] for h in hosts)  # every ticket answered
    finally:
        g.close()


@pytest.mark.skipif(not native.available(), reason="no C compiler to build the native kernel")
def test_cpu_decodes_natively_a_type_without_a_cpu_layout(oss, monkeypatch) -> None:
    """host_compute "cpu" on gpt-oss's MXFP4 experts, which have no CPU layout (held as the
    file has them): decode's rows run through the native kernel instead of dequantizing each
    routed expert; prefill's chunk still takes torch's product. Against every expert in
    VRAM: the same greedy ids."""
    prompt, steps = ids(12), ids(2, 1)
    ref = all_in_vram(oss, prompt, steps)
    g = GpuSession.load(plan(oss, resident=(0,), host_compute="cpu"), devices=[DEV],
                        remember=False)
    try:
        hosts = [la.ffn.host for la in g.pipe.stages[0].layers]
        assert all(h.native is not None and h.cpu_mats is not None for h in hosts)
        calls = []
        run_native = cpu_native.NativeExperts.run
        monkeypatch.setattr(cpu_native.NativeExperts, "run",
                            lambda self, *a, **k: calls.append(1) or run_native(self, *a, **k))
        assert_agree(run(g, prompt, steps), ref, "gpt-oss host experts (cpu, native decode)",
                     max(BOUND, 1e-2))
        assert len(calls) == len(steps) * len(hosts)  # one a decode row and layer, no more
    finally:
        g.close()


@pytest.mark.skipif(not native.available(), reason="no C compiler to build the native kernel")
def test_both_without_the_kernel_at_load_leaves_decode_to_the_gpu(wide, monkeypatch,
                                                                  caplog) -> None:
    """A plan priced where the native kernel is built, loaded where it cannot run (here: the
    runner's copy refused): no layer is split, one log line says why, and the GPU reads
    every routed expert in place: the same greedy ids as all in VRAM."""
    monkeypatch.setenv("CARVE_CPU_EXPERTS", "2")
    prompt, steps = ids(12), ids(2, 1)
    ref = all_in_vram(wide, prompt, steps)
    monkeypatch.setattr(cpu_native, "library", lambda: None)
    g = GpuSession.load(plan(wide, resident=(0,), host_compute="both"), devices=[DEV],
                        remember=False)
    try:
        st = g.pipe.stages[0]
        hosts = [la.ffn.host for la in st.layers]
        assert st.cpu_shares == {}
        assert all(not h.cpu_ready and not h.split and h.in_place is not None for h in hosts)
        assert "the CPU cannot compute layer(s) 0,1" in caplog.text
        assert_agree(run(g, prompt, steps), ref, "both without the kernel vs VRAM")
        assert all(h.cpu_s == 0 for h in hosts)
    finally:
        g.close()


def test_a_cpu_share_out_of_range_is_one_sentence(files, monkeypatch) -> None:
    monkeypatch.setenv("CARVE_CPU_EXPERTS", "9")
    with pytest.raises(CarveError, match=r"^CARVE_CPU_EXPERTS='9': expected auto or a count "
                       r"from 0 to 2 \(the experts a token routes to\)$"):
        GpuSession.load(plan(files["qwen3moe"], resident=(0,), host_compute="both"),
                        devices=[DEV], remember=False)


def test_a_host_that_shrank_since_the_plan_is_refused_before_allocating(files, monkeypatch):
    import engine.hardware.devices as devices
    from engine.runtime.gpu import pipeline

    made: list[int] = []
    real = pipeline.gpu_host.new_host_arena
    monkeypatch.setattr(pipeline.gpu_host, "new_host_arena",
                        lambda n, pin: made.append(n) or real(n, pin))
    monkeypatch.setattr(devices, "cpu_spec", lambda reserve=0: DeviceSpec(
        -1, "cpu", 8 * GIB, 64 << 10, reserve=reserve))
    with pytest.raises(CarveError, match=r"^host RAM: the plan pins .* of experts and buffers "
                       r"in host memory and 64.0 KiB is available now \(8.00 GiB when it was "
                       r"priced\); re-plan"):
        GpuSession.load(plan(files["qwen3moe"], resident=(0,)), devices=[DEV], remember=False)
    assert made == []


def test_the_torch_engine_refuses_host_experts(files) -> None:
    with pytest.raises(CarveError, match="experts in host memory run on the Triton GPU runner"):
        Session.load(plan(files["qwen3moe"], resident=(0,)), options=RunnerOptions(runner="torch"))



@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")
def test_cuda_host_experts_priced_equals_reserved_and_pinned(files, tmp_path, monkeypatch):
    """On a GPU: the device reserves what was priced (the staging span and slots included,
    the host experts not), the host arenas are pinned at the priced bytes, replies allocate
    nothing more, and closing unpins them (a second load pins again)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    free, total = torch.cuda.mem_get_info(0)
    gpu0 = DeviceSpec(index=0, name=torch.cuda.get_device_name(0), total=total, free=free)
    pl = Plan(model=files["qwen3moe"], devices=(gpu0,), split=(0, 2), ctx=128,
              prefill_chunk=32, cache_reserve=0, act_dtype="bf16", experts_resident=(1,),
              expert_slots=(2,))
    for _ in range(2):
        torch.cuda.empty_cache()
        g = GpuSession.load(pl)
        try:
            (rep,) = g.pipe.report
            assert rep["host_priced"] == rep["host_allocated"] == rep["host_pinned"] > 0
            for r in g.memory_report():
                assert r["allocated"] == r["reserved"] == r["priced"], r
            g.generate(ids(40), SamplingParams(temperature=0.0, max_tokens=8), set(),
                       lambda t: True)
            after = torch.cuda.memory_reserved(0)
            g.generate(ids(20, 5), SamplingParams(temperature=0.0, max_tokens=8), set(),
                       lambda t: True)
            assert torch.cuda.memory_reserved(0) == after
        finally:
            g.close()


def test_a_damaged_host_expert_is_named(files) -> None:
    """The host arena's experts are scanned where they lie (a GPU stage's own scan reads only
    device memory): a block whose scale is inf is refused naming the file and tensor."""
    import numpy as np

    from carve_kernels.scale_scan import _fields
    from engine.runtime.gpu import host_arena
    from spec import quant_types as qt

    model = GGUFModel.open(files["qwen3moe"])
    name = "blk.1.ffn_down_exps.weight"
    info = model.tensor(name)
    raw = torch.from_numpy(np.array(model.tensor_data(info), dtype=np.uint8).reshape(-1))
    host_arena.check_scales(model, [name], {name: raw})  # as written: finite
    size = qt.QUANT[info.ggml_type].type_size
    raw[3 * size + _fields(info.ggml_type)[0]] |= 0x7C  # block 3: its f16 scale's exponent all ones
    with pytest.raises(CarveError, match=rf"qwen3moe.gguf: tensor {name} has a block whose "
                       rf"{qt.type_name(info.ggml_type)} scale is not finite"):
        host_arena.check_scales(model, [name], {name: raw})


@pytest.mark.parametrize("compute", ["gpu", "cpu"])
@pytest.mark.parametrize("arch,layers", [("minimax-m2", 2), ("deepseek2", 1)])
def test_host_layers_of_more_families_give_the_logits_of_all_in_vram(files, arch, layers,
                                                                     compute) -> None:
    """MiniMax-M2 (sigmoid routing by its selection bias, no shared expert; both layers MoE)
    and DeepSeek-V3 (latent attention, a dense first layer, a shared expert, routing limited
    to groups): every MoE layer's experts in host memory, read by the GPU or computed by the
    CPU, against every expert in VRAM over a prefill and two decode steps."""
    path = files[arch]
    prompt, steps = ids(12), ids(2, 1)
    ref = all_in_vram(path, prompt, steps)
    g = GpuSession.load(plan(path, resident=(0,), host_compute=compute), devices=[DEV],
                        remember=False)
    try:
        assert len(g.pipe.stages[0].host_layers) == layers
        # the CPU's layouts round to bf16 (the glm4moe test above): its bound
        assert_agree(run(g, prompt, steps), ref, f"{arch} host experts ({compute})",
                     BOUND if compute == "gpu" else max(BOUND, 1e-2))
    finally:
        g.close()

"""The load's precompile (engine/runtime/gpu/precompile.py) on a GPU: with a cold kernel cache,
the dry passes find the kernel variants the dequant-cache fill and the warm-up launch, worker
processes compile them into Triton's cache folder and this process loads them from there
under the same keys, so that the load itself compiles none or almost none; and the session
then gives the greedy ids of a load that compiled everything the usual way. Each load runs in
a process of its own with a fresh Triton cache folder (a process's compiled kernels stay in
memory)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.runtime.gpu import compile_worker, precompile
from engine.synth.gen import write_model
from spec.errors import CarveError

ON_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ROOT = Path(__file__).resolve().parents[2]
# counts the compiles each thread runs, loads the file and prints the greedy ids and counts
SCRIPT = r"""
import json, sys, threading
from collections import Counter
import triton
from engine.hardware.rigs import parse_rig
from engine.gguf.reader import GGUFModel
from engine.planning.defaults import default_plan
from engine.runtime.gpu.session import GpuSession
from engine.runtime.sampling import SamplingParams

from engine.runtime.gpu import precompile

compiles, phase = Counter(), ["outside"]
def count(**kw):  # the loading threads' loads (from the folder), else the load's own compiles
    compiles["pool" if threading.current_thread().name.startswith("carve-compile")
             else phase[0]] += 1
triton.knobs.runtime.jit_post_compile_hook = count
run = precompile.Compiler.round
def round_(self, *a, **k):  # the first variant is compiled on the spot, inside a round
    phase[0] = "round"
    try:
        return run(self, *a, **k)
    finally:
        phase[0] = "outside"
precompile.Compiler.round = round_
path = sys.argv[1]
plan = default_plan(GGUFModel.open(path), parse_rig("auto"), ctx=256, model_path=path)
sess = GpuSession.load(plan, remember=False)
ids = []
sess.generate([5, 9, 13, 200], SamplingParams(temperature=0.0, repeat_penalty=1.0,
              max_tokens=8), set(), lambda t: ids.append(t) or True)
print(json.dumps({"ids": ids, "compiles": dict(compiles), "precompile": sess.compiled}))
"""


def load(path: str, tmp: Path, threads: int) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp / f"cache-{threads}"),
               CARVE_COMPILE_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH"))
                                          if p))
    r = subprocess.run([sys.executable, "-c", SCRIPT, path], env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@ON_GPU
@pytest.mark.parametrize("shape", ["qwen2-tiny", "qwen3moe-tiny"])
def test_a_cold_load_compiles_its_kernels_in_the_pool_and_decodes_the_same(shape, tmp_path):
    if precompile._runtime_knobs() is None:
        pytest.skip("this Triton has no JIT cache hook: the warm-up compiles as before")
    path = str(write_model(tmp_path / f"{shape}.gguf", shape, "q4_k_m")[0])
    serial = load(path, tmp_path, 0)
    pooled = load(path, tmp_path, 8)
    print(shape, "serial:", serial["compiles"], "pooled:", pooled["compiles"],
          pooled["precompile"])
    assert serial["precompile"] == {"variants": 0}
    assert serial["compiles"].get("pool", 0) == 0
    pc = pooled["precompile"]
    assert pc["variants"] > 0 and pc["failed"] == 0 and pc["workers"]
    # a fresh process: the dequant-cache fill's and the warm-up's dry passes in one round
    assert pc["rounds"] == 1
    # what the workers compiled, this process found in the folder under the same keys
    assert pc.get("rebuilt", 0) == 0
    # each variant loaded once on a loading thread; outside the rounds at most a straggler or
    # two (a dry step that read a skipped kernel's zeros and took another branch)
    assert pooled["compiles"]["pool"] == pc["compiled"]
    assert pooled["compiles"].get("outside", 0) <= 1 + serial["compiles"]["outside"] // 10
    assert pooled["ids"] == serial["ids"]


def one_round(steps, clear, sync, n_threads=None, on_compiled=None, cancelled=None,
              processes=True) -> dict:
    """A Compiler of its own, one round of ``steps``, closed: what it did."""
    c = precompile.Compiler(n_threads, on_compiled, cancelled, processes)
    try:
        c.round(steps, clear, sync)
    finally:
        c.close()
    return c.report


def test_the_pool_size_comes_from_the_environment():
    assert precompile.threads({"CARVE_COMPILE_THREADS": "3"}) == 3
    assert precompile.threads({"CARVE_COMPILE_THREADS": "0"}) == 0
    assert precompile.threads({"CARVE_COMPILE_THREADS": "x"}) >= 1
    assert precompile.threads({}) >= 1


class FakeJit:
    """A JITFunction's stand-in: preload 'compiles' (records the thread) or fails."""

    def __init__(self, fail: bool = False, seconds: float = 0.0) -> None:
        self.fail, self.seconds, self.loaded = fail, seconds, []

    def preload(self, data: str) -> None:
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("no ptxas here")
        self.loaded.append((json.loads(data)["name"], threading.current_thread().name))


def hooked_launch(rt, jit: FakeJit, key: str):
    """A launch of a variant not in the JIT's cache, as Triton makes it: through the hook
    (None when the variant is in the cache: Triton launches it without asking)."""
    if key in (n for n, _ in jit.loaded):
        return None
    return rt.jit_cache_hook(key=key, fn=SimpleNamespace(jit_function=jit),
                             compile={"specialization_data": json.dumps({"name": key}),
                                      "device": None})


def test_the_dry_pass_records_declines_restores_and_compiles_on_the_pool(monkeypatch):
    """The control flow without a GPU: every launch the steps make goes through the hook,
    which declines it; a step that raises does not stop the others; the buffers are cleared
    before and after; the hook is handed back; each variant compiles once on a pool thread;
    one that fails is counted and left to the warm-up. The first compiles on the spot, slowly
    (Triton's cache folder did not have it): the dry pass goes on."""
    rt = SimpleNamespace(jit_cache_hook="theirs")
    monkeypatch.setattr(precompile, "_runtime_knobs", lambda: rt)
    monkeypatch.setattr(precompile, "_entries", lambda: None)  # cold or warm told by time
    good, bad = FakeJit(seconds=precompile.WARM_S + 0.05), FakeJit(fail=True)
    calls, hooked = [], []

    def launch(jit, key):
        declined = hooked_launch(rt, jit, key)
        if declined is not None:
            hooked.append(declined)

    def broken():
        launch(good, "b")
        raise IndexError("read a skipped kernel's output")

    progress = []
    out = one_round(
        [lambda: launch(good, "a"), broken, lambda: launch(good, "a"), lambda: launch(bad, "c")],
        clear=lambda: calls.append("clear"), sync=lambda: calls.append("sync"), n_threads=4,
        on_compiled=lambda done, n: progress.append((done, n)))
    assert progress == [(0, 2), (1, 2), (2, 2)]  # the pool's variants as each one finishes
    assert hooked == [True, True, True]
    assert rt.jit_cache_hook == "theirs"
    assert calls == ["clear", "sync", "clear"]
    # "a" on the spot (the dry pass's thread), then "b" on the pool
    assert [n for n, _ in good.loaded] == ["a", "b"]
    assert not good.loaded[0][1].startswith("carve-compile")
    assert good.loaded[1][1].startswith("carve-compile")
    assert out["variants"] == 2 and out["compiled"] == 1 and out["failed"] == 1
    assert not out["warm"]


def test_a_first_variant_from_the_cache_folder_stops_the_dry_pass(monkeypatch):
    """Every launch after the first: the first variant loads fast, so nothing more is
    recorded, no step after it runs, and the warm-up loads the rest as before."""
    rt = SimpleNamespace(jit_cache_hook=None)
    monkeypatch.setattr(precompile, "_runtime_knobs", lambda: rt)
    monkeypatch.setattr(precompile, "_entries", lambda: None)  # cold or warm told by time
    jit, ran, calls = FakeJit(), [], []

    def step(key):
        ran.append(key)
        hooked_launch(rt, jit, key)

    out = one_round([lambda: step("a"), lambda: step("b")],
                                clear=lambda: calls.append("clear"), sync=lambda: None,
                                n_threads=4)
    assert ran == ["a"] and [n for n, _ in jit.loaded] == ["a"]
    assert out["warm"] and out["variants"] == 0
    assert rt.jit_cache_hook is None and calls == ["clear", "clear"]


@pytest.mark.parametrize("writes", [False, True])
def test_the_cache_folder_tells_a_warm_first_variant_from_a_cold_one(writes, tmp_path,
                                                                     monkeypatch):
    """The first variant is warm when compiling it wrote nothing into Triton's cache folder,
    however long it took (a process's first compile also pays Triton's start), and cold when
    it wrote something, however fast."""
    rt = SimpleNamespace(jit_cache_hook=None)
    monkeypatch.setattr(precompile, "_runtime_knobs", lambda: rt)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))

    class Jit(FakeJit):
        def preload(self, data: str) -> None:
            super().preload(data)
            if writes:
                (tmp_path / json.loads(data)["name"]).mkdir()

    jit, ran = Jit(seconds=0.0 if writes else precompile.WARM_S + 0.05), []

    def step(key):
        ran.append(key)
        hooked_launch(rt, jit, key)

    out = one_round([lambda: step("a"), lambda: step("b")], lambda: None,
                                lambda: None, n_threads=2, processes=False)
    assert out["warm"] is not writes
    assert ran == (["a", "b"] if writes else ["a"])


def test_no_pool_no_dry_pass(monkeypatch):
    monkeypatch.setattr(precompile, "_runtime_knobs", lambda: SimpleNamespace(jit_cache_hook=None))
    ran = []
    assert one_round([lambda: ran.append(1)], lambda: None, lambda: None,
                                 n_threads=1) == {"variants": 0}
    assert ran == []


def test_cancel_drops_the_variants_not_started(monkeypatch):
    """Cancel during the pool: the compiles not yet started are dropped and the load ends with
    "load cancelled" (the running ones finish: a compile cannot be interrupted)."""
    rt = SimpleNamespace(jit_cache_hook=None)
    monkeypatch.setattr(precompile, "_runtime_knobs", lambda: rt)
    monkeypatch.setattr(precompile, "_entries", lambda: None)  # cold or warm told by time
    jit = FakeJit(seconds=precompile.WARM_S + 0.05)
    stop = []

    with pytest.raises(CarveError, match="load cancelled"):
        one_round([lambda k=k: hooked_launch(rt, jit, k) for k in "abcdefgh"],
                              lambda: None,
                              lambda: None, n_threads=2,
                              on_compiled=lambda done, n: stop.append(done),
                              cancelled=lambda: len(stop) >= 2)
    # "a" on the spot, then per thread at most the one that finished and the one it took next
    # before the cancel was seen; never all 8
    assert len(jit.loaded) <= 1 + 2 * 2 < 8
    assert rt.jit_cache_hook is None


def test_a_worker_process_compiles_a_variant_into_the_cache_folder(tmp_path, monkeypatch):
    """No GPU needed: a worker (forked from the server, so without CUDA) compiles a kernel
    variant, given as the JIT's hook records it, for a stated target into Triton's cache
    folder; compiling the same variant again here then finds it there and writes nothing."""
    pytest.importorskip("triton.backends.nvidia")
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    target = ("cuda", 90, 32)
    options = make_backend(GPUTarget(*target)).parse_options({"num_warps": 4}).__dict__
    sig = {"w_ptr": "*u8", "nblk": "i32", "flag_ptr": "*i32", "tag": "i32",
           **{k: "constexpr" for k in ("TS", "O0", "O1", "IQ1M", "SC", "BLOCK")}}
    data = json.dumps({
        "name": "_scan_kernel", "signature": sig,
        "constant_keys": [[4], [5], [6], [7], [8], [9]],
        "constant_vals": [144, 0, 2, False, 48, 256],
        "attrs_keys": [[0], [2]],
        "attrs_vals": [[["tt.divisibility", 16]], [["tt.divisibility", 16]]],
        "options": options, "key": "test"}, default=list)
    job = ("carve_kernels.scale_scan", "_scan_kernel", data, target)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the engine compiles, never interprets

    def in_worker(*job) -> str | None:
        workers = compile_worker.workers(1)
        assert workers is not None
        try:
            return workers.submit(compile_worker.build, *job).result(timeout=600)
        finally:
            workers.shutdown()
            compile_worker.stop_server()

    assert in_worker(*job) is None
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written
    assert in_worker(*job) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == written
    # a kernel the worker cannot find by name: the error's text, for the threads to compile it
    missing = in_worker("carve_kernels.scale_scan", "_no_such_kernel",
                        data.replace("_scan_kernel", "_no_such_kernel"), target)
    assert "_no_such_kernel" in missing


def test_a_dry_pass_runs_each_kind_of_layer_once(tmp_path, monkeypatch) -> None:
    """A precompile's dry pass runs a layer only where its tensor types and attention, with
    its predecessor's, have not run yet (and the stage's last layer): the layers it skips
    would launch variants already recorded. gemma3-tiny's six layers (local and global
    attention, two tensor mixes) run five. On the GPU where there is one, else under the
    interpreter."""
    from engine.hardware.devices import DeviceSpec
    from engine.planning.plan import Plan
    from engine.runtime.gpu.layers import dry_pass_layers
    from engine.runtime.gpu.session import GpuSession

    path = str(write_model(tmp_path / "g.gguf", "gemma3-tiny")[0])
    cpu = DeviceSpec(index=-1, name="cpu", total=8 << 30, free=8 << 30)
    plan = Plan(model=path, devices=(cpu,), split=(0, 6), ctx=64, prefill_chunk=16,
                cache_reserve=0, logits_rows=4)
    dev = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    sess = GpuSession.load(plan, devices=[dev], remember=False)
    try:
        (st,) = sess.pipe.stages
        model = st.model

        def kind(i: int) -> tuple:
            layer = st.layers[i]
            types = tuple(sorted((t.name.split(".", 2)[2], t.ggml_type) for t in model.tensors
                                 if t.name.startswith(f"blk.{layer.index}.")))
            return types, layer.attn.window

        seen, expected = set(), []
        for i in range(len(st.layers)):
            pair = (kind(i - 1) if i else None, kind(i))
            expected.append(pair not in seen or i == len(st.layers) - 1)
            seen.add(pair)
        runs = dry_pass_layers(st.layers)
        assert runs == expected and runs.count(False) == 1
        ran: list[int] = []
        attend = st._attention
        index = {id(layer.attn): layer.index for layer in st.layers}
        monkeypatch.setattr(st, "_attention", lambda att, *a: ran.append(index[id(att)])
                            or attend(att, *a))
        sess.pipe.clear_buffers()  # token ids and positions in range, as a dry pass has them
        with sess.pipe.dry_pass():
            st.forward(3, 0)
        assert ran == [layer.index for layer, r in zip(st.layers, runs, strict=True) if r]
        assert st.dry_runs is None  # outside a dry pass every layer runs
    finally:
        sess.close()


def test_workers_of_a_main_module_run_by_name_print_no_warning(tmp_path) -> None:
    # `carve bench` runs `python -m engine.runtime.bench`; the workers' server preloads that
    # module by name and each worker runs its body again, which runpy would warn about in
    # every worker (a screenful of RuntimeWarnings before the figures). No CUDA needed
    pkg = tmp_path / "mainpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "run.py").write_text(
        "from engine.runtime.gpu import compile_worker as cw\n"
        "def twice(x):\n"
        "    return 2 * x\n"
        "if __name__ == '__main__':\n"
        "    pool = cw.workers(2)\n"
        "    print(sorted(pool.map(twice, range(4))))\n"
        "    pool.shutdown()\n"
        "    cw.stop_server()\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    done = subprocess.run([sys.executable, "-m", "mainpkg.run"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 2, 4, 6]"
    assert "Warning" not in done.stderr, done.stderr

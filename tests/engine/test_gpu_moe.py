"""The Triton GPU runner on mixture-of-experts models (carve_kernels/moe.py through
engine/runtime/gpu/) against the CPU engine (engine/runtime/models/moe.py) on the same file:
prefill over chunks (the sorted, grouped path), decode steps (the expert GEMVs the captured
step holds) and greedy ids; and on a GPU, two stages on one device giving one stage's ids.

Tiny synthetic files written by engine.synth.gen, norm weights made random (as
tests/engine/test_gpu_archs.py does). Without a GPU the runner runs under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_compare import (
    GREEDY,
    against_cpu_engine,
    chunk_and_decode_rows,
    decode_errors,
    rel,
    tie_free,
)

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.buffers import activation_buffers
from engine.planning.plan import Plan
from engine.runtime.gpu.layers import Experts
from engine.runtime.gpu.session import GpuSession
from engine.runtime.options import RunnerOptions
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from engine.synth.gen import write_model
from engine.synth.shapes import Shape
from spec import quant_types as qt
from spec.launch import moe_tiles

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")
NO_CACHE = 1 << 50  # a cache reserve beyond any device: nothing cached
# 2 layers run, 4 experts of 256 with 2 used: gate/up experts have 128-value rows (a 32-block
# type in the q4_k_m mix), down experts 256-value rows (a K type). glm4moe: a dense first layer,
# a shared expert, sigmoid routing with its selection bias and a routed scale, RoPE on half of
# each head, q/k/v biases, and a declared NextN layer that is not run.
SHAPES = {
    "qwen3moe": Shape("qwen3moe", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512, n_expert=4,
                      n_expert_used=2, n_ff_exp=256),
    "glm4moe": Shape("glm4moe", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512, n_expert=4,
                     n_expert_used=2, n_ff_exp=256, n_expert_shared=1, n_layer_dense_lead=1,
                     n_nextn=1, rope_dim=32, expert_weights_scale=2.5),
    # gpt-oss: MXFP4 experts with biases and the clamped SwiGLU, router bias, top-k then softmax,
    # attention sinks, q/k/v/o biases, a window of 8 on even layers, YaRN RoPE
    "gpt-oss": Shape("gpt-oss", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512,
                     rope_base=150000.0, rms_eps=1e-5, sliding_window=8, n_expert=4,
                     n_expert_used=2, n_ff_exp=256, yarn=(4.0, 64), mix="mxfp4_moe"),
    # Mixtral: a llama file with experts (adjacent-pair RoPE, softmax routing renormalised)
    "mixtral": Shape("llama", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512, n_expert=4,
                     n_expert_used=2, n_ff_exp=256),
    # MiniMax-M2: RMSNorms over each token's whole q and k, RoPE on half of each head (halves),
    # sigmoid routing by its selection bias, weights normalised, no shared expert
    "minimax-m2": Shape("minimax-m2", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512,
                        n_expert=4, n_expert_used=2, n_ff_exp=256, rope_dim=32,
                        expert_gating=2),
    # dots.llm1: qwen3's per-head q/k norms, a dense first layer, a shared expert, sigmoid
    # routing by its selection bias, weights normalised and scaled
    "dots1": Shape("dots1", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512, n_expert=4,
                   n_expert_used=2, n_ff_exp=256, n_expert_shared=1, n_layer_dense_lead=1,
                   expert_weights_scale=2.5, expert_gating=2),
    # DeepSeek-V3 (deepseek2): latent attention (a q LoRA, the latent row in the cache, the
    # absorbed per-head matrices), YaRN, a dense first layer, a shared expert, sigmoid routing
    # by its selection bias, weights normalised and scaled. No group limit here: with 4
    # experts in 2 groups of 2, each row's whole FFN hangs on one comparison of two group
    # scores (~3.2, margins down to 7e-4 on these rows), which bf16 activations flip on a GPU
    # (0.49 prefill error, H200 2026-12-05); test_deepseek2.py runs the group limit on
    # DeepSeek-V3's own file, and tests/kernels/test_moe.py the route kernel's
    "deepseek2": Shape("deepseek2", 2, 128, 4, 1, 256, 320, n_ctx=512, rope_base=1e4,
                       n_expert=4, n_expert_used=2, n_ff_exp=256, n_expert_shared=1,
                       n_layer_dense_lead=1, q_lora_rank=64, kv_lora_rank=64, qk_nope_dim=32,
                       qk_rope_dim=16, v_head_dim=32, expert_gating=2,
                       expert_weights_norm=True, expert_weights_scale=2.5,
                       yarn=(4.0, 64), mscale_all_dim=0.707),
    # ERNIE-4.5: adjacent-pair RoPE, a dense first layer, a shared expert, softmax routing
    # that selects by softmax + its selection bias, weights normalised
    "ernie4_5-moe": Shape("ernie4_5-moe", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512,
                          n_expert=4, n_expert_used=2, n_ff_exp=256, n_expert_shared=1,
                          n_layer_dense_lead=1),
}

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module", params=list(SHAPES))
def model(request, tmp_path_factory) -> str:
    arch = request.param
    shape = SHAPES[arch]
    (out,) = write_model(tmp_path_factory.mktemp("moe") / f"{arch}.gguf", shape,
                         None if arch == "gpt-oss" else "q4_k_m")
    m = GGUFModel.open(out)
    rng = np.random.default_rng(1)
    with open(out, "r+b") as f:
        for t in m.tensors:
            # random norms (synth's are ~1), selection biases and sinks (synth's are 0), so
            # that one read from the wrong tensor shows
            if "norm" in t.name or "exp_probs_b" in t.name or "sinks" in t.name:
                f.seek(t.offset)
                f.write(rng.uniform(0.5, 1.5, t.n_elements).astype(np.float32).tobytes())
    return str(out)


def plan(path: str, devices=(CPU,), split=(0, 2), **kw) -> Plan:
    base = {"ctx": 64, "prefill_chunk": 16, "cache_reserve": NO_CACHE, "logits_rows": 16}
    base.update(kw)
    return Plan(model=path, devices=tuple(devices), split=split, **base)


def ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_moe_buffers_are_sized_for_the_routed_rows(model) -> None:
    hp = HParams.from_model(GGUFModel.open(model))
    glm = hp.arch == "glm4moe"
    assert hp.n_expert == 4 and hp.n_expert_used == 2
    assert hp.expert_gating == {"glm4moe": "sigmoid", "gpt-oss": "softmax_topk",
                                "minimax-m2": "sigmoid", "dots1": "sigmoid",
                                "deepseek2": "sigmoid"}.get(hp.arch,
                                                                                 "softmax")
    if glm:
        assert hp.n_layer_run == 2 and hp.rope_dim == 32 and hp.n_ff_shexp == 256
        assert not hp.is_moe_layer(0) and hp.is_moe_layer(1)
    bufs = {b.name: b for b in activation_buffers(hp, 16, "f32", 1)}
    assert bufs["moe_h"].shape == (32, 256) and bufs["moe_out"].shape == (32, 128)
    assert bufs["moe_ids"].shape == (16, 2) and bufs["moe_logits"].shape == (16, 4)
    assert bufs["moe_tiles"].shape == (3, moe_tiles(32, 4))
    dense = HParams.from_model(GGUFModel.open(write_model_dense(model)))
    assert not any(b.name.startswith("moe_") for b in activation_buffers(dense, 16, "f32", 1))


def write_model_dense(path: str) -> str:
    out = path.replace(".gguf", "-dense.gguf")
    write_model(out, Shape("qwen3", 2, 128, 4, 2, 256, 320, head_dim=64, n_ctx=512), "q8_0")
    return out


def _options(model: str) -> RunnerOptions | None:
    """The runner options a comparison at 5e-3 runs ``model`` with. gpt-oss's experts on x
    itself (below). MiniMax-M2's whole-vector q/k norms and dots1's per-head ones (with these
    files' random norm weights) pass more of decode's int8 copies' rounding on to the logits:
    7.4e-3 and 6.6e-3 measured, 3.2e-4 and 3.5e-4 with CARVE_Q8X=0 (qwen3moe's 4.3e-3, glm4moe's
    7.3e-4); their int8 decode is held to the int8 test's bound below."""
    if "gpt-oss" in model:
        return RunnerOptions(expert_q8=False)
    if "minimax" in model or "dots1" in model or "deepseek2" in model:
        return RunnerOptions(q8x=False)
    return None


@pytest.fixture
def norm_router_calls(monkeypatch) -> list[int]:
    """moe.norm_router's launches (one entry each) while the test runs."""
    from carve_kernels import moe

    calls: list[int] = []
    fused = moe.norm_router
    monkeypatch.setattr(moe, "norm_router", lambda *a, **k: calls.append(1) or fused(*a, **k))
    return calls


def test_logits_and_decode_match_the_cpu_engine(model, norm_router_calls) -> None:
    """f32 activations: prefill of 20 rows over two chunks (16 rows through the grouped GEMMs,
    4 through the expert GEMVs), decode steps, then (qwen3moe) greedy ids from a fresh cache.
    Decode's FFN norm and router run in one launch (moe.norm_router) and give what the CPU
    engine gives, the residual stream included (the next layers read it)."""
    # as the dense families: f32 activations, prefill attention rounds q, k, v to f16; the
    # greedy loop is the same code for every family: qwen3moe's is enough here. gpt-oss's
    # decode experts on x itself (RunnerOptions.expert_q8 off): the int8 copies' rounding
    # reaches ~1e-2 of its logits, checked at that bound by the test below
    options = _options(model)
    against_cpu_engine(plan(model), DEV, ids(20), ids(2, 1),
                       ids(6, 3) if "qwen3moe" in model else None, 5e-3, model,
                       options=options)
    assert norm_router_calls  # decode's rows went through the fused launch


def test_chunks_padded_to_a_graphs_length_match_the_cpu_engine(model, monkeypatch) -> None:
    """Prefill chunks padded as the prefill graphs run them on a GPU (stage_graph.graph_rows,
    forced here on the interpreter, where no graph runs): the padding repeats the last token
    at its position, and neither the KV cache (gpt-oss's ring of 8 cells too) nor the logits
    keep anything of it; decode and greedy ids after it as the CPU engine's."""
    from engine.runtime.gpu.pipeline import GpuPipeline
    from engine.runtime.gpu.stage_graph import graph_rows

    pads: list[int] = []

    def padded(self, n: int, check=None) -> int:
        rows = n if check is not None else graph_rows(n, self.stages[0].buf["positions"].shape[0])
        pads.append(rows - n)
        return rows

    monkeypatch.setattr(GpuPipeline, "chunk_rows", padded)
    options = _options(model)
    # 16 rows, then 5 padded to 8; the greedy prompt's 6 rows padded to 8. Decode's int8 x
    # (its Q5_0 q/k/gate/up and experts) leaves up to 5e-3; padding kept in the cache 2e-2 to 9e-2
    against_cpu_engine(plan(model), DEV, ids(21), ids(2, 1), ids(6, 3), 1e-2, model,
                       options=options)
    assert 3 in pads and 2 in pads


def test_bf16_two_stages_give_the_decode_logits_of_one_to_the_bit(model,
                                                                  norm_router_calls) -> None:
    """bf16: a split between the layers moves the stream as stored, and decode's fused FFN norm
    and router (which writes the stream back from its last program) normalizes that stored
    value too, so two stages give one stage's prefill and decode logits to the bit."""
    sim = tuple(DeviceSpec(index=i, name="sim", total=8 * GIB, free=8 * GIB, simulated=True)
                for i in range(2))
    got = [chunk_and_decode_rows(GpuSession.load(
        plan(model, devices, split, prefill_chunk=8, logits_rows=1, act_dtype="bf16"),
        devices=[DEV] * len(devices), remember=False), ids(12, 3))
        for devices, split in ((sim[:1], (0, 2)), (sim, (0, 1, 2)))]
    assert torch.isfinite(got[0]).all() and torch.equal(got[0], got[1])
    assert norm_router_calls  # decode's rows went through the fused launch


@pytest.mark.parametrize("arch", ["qwen3moe", "gpt-oss", "minimax-m2", "dots1"])
def test_decode_on_the_int8_copies_matches_the_cpu_engine(arch, tmp_path) -> None:
    """Experts of a type with an int8-x body (Q4_K gate/up and Q6_K or Q4_K down; gpt-oss's
    MXFP4): decode's expert GEMVs multiply the int8 copies of the normed row and of the routed
    GLU outputs (carve_kernels/gemv_q8.py) and still match the CPU engine, greedy ids included;
    with RunnerOptions.expert_q8 off they read bf16 x."""
    if arch == "gpt-oss":
        shape, mix = SHAPES["gpt-oss"], None
    elif arch in ("minimax-m2", "dots1"):
        shape, mix = SHAPES[arch], "q4_k_m"
    else:
        shape, mix = Shape("qwen3moe", 2, 256, 4, 2, 256, 320, head_dim=64, n_ctx=512,
                           n_expert=4, n_expert_used=2, n_ff_exp=256), "q4_k_m"
    (out,) = write_model(tmp_path / "q8.gguf", shape, mix)

    def on_int8(g) -> None:
        layers = [la for la in g.pipe.stages[0].layers if hasattr(la.ffn, "xq_h")]  # MoE
        assert layers
        for layer in layers:
            assert layer.ffn.xq is not None and layer.ffn.xq_h is not None

    # the int8 rounding of x and of the GLU outputs is the whole error (the kernels match the
    # reference on the rounded input to 1e-5, tests/kernels/test_q8x.py); on random rows it
    # is ~1 % of a GEMV's output for Q4_K and MXFP4 alike, and gpt-oss's synthetic file passes
    # more of it on to the logits (9.6e-3 measured, 1.3e-4 on bf16 x) than qwen3moe's (4.9e-4)
    bound = 2e-2 if arch in ("gpt-oss", "minimax-m2", "dots1") else 5e-3
    # ids away from the router's and the logits' near-ties, which any rounding may flip
    # (tie_free; with minimax-m2's file and ids(2, 1) one decode row took another expert)
    against_cpu_engine(plan(str(out)), DEV, *tie_free(plan(str(out)), 20, 2, 6), bound,
                       str(out), on_int8)
    if arch == "gpt-oss":  # CARVE_EXPERT_Q8=0: the experts read bf16 x
        g = GpuSession.load(plan(str(out)), devices=[DEV], remember=False,
                            options=RunnerOptions(expert_q8=False))
        try:
            assert all(layer.ffn.xq is None for layer in g.pipe.stages[0].layers)
        finally:
            g.close()


@pytest.mark.parametrize(("mix", "trial", "types"), [
    # GLM-4.5-Air's Q3_K_M experts: Q3_K gate/up, Q5_0 down (Q4_K's fallback on rows that are
    # no whole 256-value blocks, 224 here as 1408 there)
    ("q3_k_m", None, {(qt.Q3_K, qt.Q5_0)}),
    # its Q4_K_M experts: the bumped layer's down Q6_K, whose fallback is Q8_0
    ("q4_k_m", None, {(qt.Q4_K, qt.Q5_0), (qt.Q4_K, qt.Q8_0)}),
    ("iq4_nl", "iq4nl_experts", {(qt.IQ4_NL, qt.IQ4_NL)})])
def test_glm_shaped_experts_decode_on_int8_x_as_the_cpu_engine(mix, trial, types, tmp_path,
                                                               monkeypatch) -> None:
    """The int8-x expert bodies (gemv_q8's quarter_q8_rows_dot for Q3_K and gemv_dot's
    q80_rows_dot for Q8_0; iq4nl_q8_rows_dot on trial) multiply the int8 copies of the normed
    row and of the GLU outputs in every layer and still match the CPU engine; without its
    trial a layer with IQ4_NL experts reads bf16 x for them."""
    from carve_kernels import gemv_q8, moe_decode_q8

    shape = Shape("qwen3moe", 2, 256, 4, 2, 256, 320, head_dim=64, n_ctx=512, n_expert=4,
                  n_expert_used=2, n_ff_exp=224)
    (out,) = write_model(tmp_path / f"{mix}.gguf", shape, mix)
    on_trial = set(gemv_q8.Q8_TRIAL_TYPES[trial]) if trial else set()

    def on_int8(g) -> None:
        ffns = [layer.ffn for layer in g.pipe.stages[0].layers]
        assert {(f.gate.ggml_type, f.down.ggml_type) for f in ffns} == types
        assert all(f.xq is not None and f.xq_h is not None for f in ffns)

    options = RunnerOptions(trials=frozenset({trial} if trial else ()))
    monkeypatch.setattr(moe_decode_q8, "Q8_ON_TRIAL", moe_decode_q8.Q8_ON_TRIAL)  # restored after
    options.apply()
    against_cpu_engine(plan(str(out)), DEV, ids(20), ids(2, 1), ids(6, 3), 5e-3, str(out),
                       on_int8, options=options)
    if not trial:
        return
    monkeypatch.undo()  # the trial off
    g = GpuSession.load(plan(str(out)), devices=[DEV], remember=False)
    try:
        for layer in g.pipe.stages[0].layers:
            f = layer.ffn
            if f.gate.ggml_type in on_trial:
                assert f.xq is None
            elif f.down.ggml_type in on_trial:
                assert f.xq is not None and f.xq_h is None
    finally:
        g.close()


def test_split_expert_gate_up_decodes_as_the_cpu_engine(tmp_path, monkeypatch) -> None:
    """Decode's Q4_K expert gate/up along each row's blocks in two programs (the default),
    their partial sums in the T GEMVs' priced scratch (this shape's ffn_down split holds
    them), matches the CPU engine; every launch split."""
    from carve_kernels import moe_decode_q8

    shape = Shape("qwen3moe", 2, 512, 8, 2, 1024, 320, head_dim=64, n_ctx=512, n_expert=4,
                  n_expert_used=2, n_ff_exp=256)
    (out,) = write_model(tmp_path / "split.gguf", shape, "q4_k_m")
    splits: list[int] = []
    choose = moe_decode_q8._glu_split

    def spy(*a, **k):
        splits.append(choose(*a, **k))
        return splits[-1]

    monkeypatch.setattr(moe_decode_q8, "_glu_split", spy)
    assert moe_decode_q8.GLU_SPLIT == 2
    against_cpu_engine(plan(str(out)), DEV, ids(20), ids(2, 1), ids(6, 3), 5e-3, str(out))
    assert splits and set(splits) == {2}


# ------------------------------------------------------------------ on a real GPU

gpu = pytest.mark.skipif(not ON_GPU, reason="needs a CUDA GPU")


def cuda_plan(path: str, split: tuple[int, ...], n_dev: int = 1, **kw) -> Plan:
    free, total = torch.cuda.mem_get_info(0)
    dev = DeviceSpec(index=0, name=torch.cuda.get_device_name(0), total=total,
                     free=free // n_dev)
    base = {"ctx": 128, "prefill_chunk": 32, "cache_reserve": 0, "logits_rows": 1,
            "act_dtype": "bf16"}
    base.update(kw)
    return Plan(model=path, devices=(dev,) * n_dev, split=split, **base)


@pytest.mark.gpu
@gpu
def test_cuda_two_stages_give_the_greedy_ids_of_one(model, tmp_path, monkeypatch) -> None:
    """bf16, decode in CUDA graphs: the split moves bytes, not results."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    got = []
    for split, n_dev in (((0, 2), 1), ((0, 1, 2), 2)):
        g = GpuSession.load(cuda_plan(model, split, n_dev))
        try:
            out: list[int] = []
            g.generate(ids(40, 5), SamplingParams(temperature=0.0, repeat_penalty=1.0,
                                                  max_tokens=24), set(), out.append)
            got.append(out)
        finally:
            g.close()
            torch.cuda.empty_cache()
    assert got[0] == got[1] and len(got[0]) == 24


@pytest.mark.gpu
@gpu
def test_cuda_moe_decode_with_the_l2_prefetch_gives_the_same_logits_and_ids(model, tmp_path,
                                                                           monkeypatch) -> None:
    """CARVE_L2_PREFETCH under a MoE layer's experts (stage_dense.py ``_l2_next``: the next
    layer's attention matrices pulled into L2 from the stage's prefetch stream, inside the
    captured step) changes no logit and no greedy id."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    prompt = ids(21, 7)
    got = []
    for mib in (0, 1):
        g = GpuSession.load(cuda_plan(model, (0, 2)), options=RunnerOptions(l2_prefetch=mib))
        try:
            st = g.pipe.stages[0]
            if not mib:
                assert st._l2_stream is None
            elif isinstance(st.layers[0].ffn, Experts):  # it prefetched layer 1's attention
                assert st._l2_stream is not None
            out: list[int] = []
            g.generate(prompt, SamplingParams(temperature=0.0, repeat_penalty=1.0,
                                              max_tokens=12), set(), out.append)
            got.append((g.logits(prompt).clone(), out))
        finally:
            g.close()
            torch.cuda.empty_cache()
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]
    assert len(got[0][1]) == 12


@pytest.mark.gpu
@gpu
def test_cuda_moe_prefill_graphs_give_the_eager_logits_and_ids(model, tmp_path,
                                                               monkeypatch) -> None:
    """Chunks of a MoE model (device-side sort, grouped GEMMs, combine; the expert GEMVs up to
    8 rows) replay the graphs each stage captured at the load's warm-up, at any position, the
    last chunk's 5 rows padded to 8: the eager chunks' logits to the bit and their greedy ids,
    over two stages."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    prompt = ids(37, 6)  # full chunks at 0 and 16, then 5 rows eagerly
    got = []
    for on in (False, True):
        g = GpuSession.load(cuda_plan(model, (0, 1, 2), 2, prefill_chunk=16, logits_rows=4),
                            options=RunnerOptions(prefill_graph=on))
        try:
            assert ([set(st._prefill_graphs) for st in g.pipe.stages]
                    == [{8, 16} if on else set()] * 2)
            logits = g.logits(prompt).clone()
            out: list[int] = []
            g.generate(prompt, SamplingParams(temperature=0.0, repeat_penalty=1.0,
                                              max_tokens=12), set(), out.append)
            got.append((logits, out))
        finally:
            g.close()
            torch.cuda.empty_cache()
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]


@pytest.mark.gpu
@gpu
def test_cuda_bf16_moe_logits_near_the_cpu_engine(model, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    g = GpuSession.load(cuda_plan(model, (0, 2), prefill_chunk=16, logits_rows=16, ctx=64))
    c = Session.load(plan(model))
    try:
        prompt = ids(20)
        errs = [rel(g.logits(prompt), c.logits(prompt)), *decode_errors(g, c, ids(4, 1))[0]]
        print(f"{model}: bf16 rel errors prefill {errs[0]:.2e}, decode {max(errs[1:]):.2e}")
        assert max(errs) < 0.15  # bf16 rounding on random tiny models (test_gpu_archs.py)
    finally:
        g.close()
        c.close()
        torch.cuda.empty_cache()


@pytest.mark.gpu
@gpu
def test_cuda_moe_priced_equals_reserved_and_nothing_more_per_token(model, tmp_path,
                                                                     monkeypatch) -> None:
    """The MoE buffers are what the runner holds: the load reserves what was priced, and
    prefill chunks (sort, grouped GEMMs, combine) and decode steps allocate nothing more."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    torch.cuda.empty_cache()
    g = GpuSession.load(cuda_plan(model, (0, 2), prefill_chunk=32, logits_rows=1))
    try:
        for r in g.memory_report():
            assert r["runner"] == "triton" and r["allocated"] == r["reserved"] == r["priced"], r
        g.generate(ids(40), GREEDY, set(), lambda t: True)
        after_one = torch.cuda.memory_reserved(0)
        g.generate(ids(70, 5), SamplingParams(temperature=0.0, repeat_penalty=1.0,
                                              max_tokens=20), set(), lambda t: True)
        assert torch.cuda.memory_reserved(0) == after_one
    finally:
        g.close()
        torch.cuda.empty_cache()


@pytest.mark.parametrize("shape", ["qwen3moe-30b-a3b", "gpt-oss-20b", "glm4.5-air", "minimax-m2",
                                   "deepseek-v2-lite",
                                   "dots1", "ernie4.5-21b-a3b"])
def test_published_moe_shapes_plan_onto_the_gpu_runner(shape) -> None:
    """The issue's shapes on a simulated H200: the GPU runner is the one chosen, every tensor
    type has a kernel, the plan fits, and the routed-row buffers are priced at the chunk's
    size (what carve_kernels/moe.py writes: chunk x k rows)."""
    from engine.planning.capability import runner_for
    from engine.planning.carve import model_index
    from engine.planning.price import price
    from engine.synth.header import HeaderModel
    from engine.synth.shapes import SHAPES as PUBLISHED

    model = HeaderModel(PUBLISHED[shape])
    hp = HParams.from_model(model)
    h200 = DeviceSpec(index=0, name="NVIDIA H200", total=140 * GIB, free=139 * GIB,
                      simulated=True)
    pl = Plan(model="m", devices=(h200,), split=(0, hp.n_layer_run), ctx=4096,
              prefill_chunk=512, act_dtype="bf16")
    assert runner_for(pl, model_index(model)).name == "triton"
    layout = price(pl, model)
    d = layout.devices[0]
    assert d.verdict.runs and layout.fits, d.advice
    spans = {s.name: s for a in d.arenas for s in a.spans}
    k = hp.n_expert_used
    assert spans["buf.moe_h"].shape == (512 * k, hp.n_ff_exp)
    assert spans["buf.moe_tiles"].shape == (3, moe_tiles(512 * k, hp.n_expert))
    assert not any(n.startswith("dq.") and "_exps." in n for n in spans)  # experts stay quantized

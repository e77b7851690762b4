"""DeepSeek-V2/V3 (GGUF arch deepseek2) on the torch engine against transformers: tiny random
DeepseekV3ForCausalLM (q LoRA, sigmoid routing with the selection bias limited to groups,
YaRN) and DeepseekV2ForCausalLM (V2-Lite's plain q, softmax routing, two shared experts)
written to GGUF in llama.cpp's current layout (attn_k_b / attn_v_b) and its legacy one
(attn_kv_b); logits at every position and 32 greedy tokens compared. The KV cache holds MLA's
latent row (priced as such), the group-limited router matches transformers', bad files are
refused in one sentence. A GPU plan runs on the Triton runner (carve_kernels/latent.py), whose
logits and greedy ids are the CPU engine's (under the interpreter without a GPU), on an f16 or
a q8_0 KV cache."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.gguf.writer import F32, U32
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from spec.errors import CarveError

sys.path.insert(0, str(Path(__file__).parent))
from hf_compare import errors, f32_kv, session  # noqa: E402
from moe_files import write_pair  # noqa: E402

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=16 * GIB, free=16 * GIB)
GREEDY = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=32)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# (transformers class, layout, quant): every layout and family once, quantized and not
CASES = [("deepseek3", "mla", "f32"), ("deepseek3", "mla", "q8_0"), ("deepseek3", "legacy", "q8_0"),
         ("deepseek2", "mla", "q8_0"), ("deepseek2", "legacy", "f32")]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict = {}

    def get(arch: str, layout: str, quant: str):
        key = arch, layout, quant
        if key not in cache:
            path = tmp_path_factory.mktemp("ds") / f"{arch}-{layout}-{quant}.gguf"
            cache[key] = write_pair(arch, quant, path, layout=layout)
        return cache[key]

    return get


def _session(path: Path, cached: bool) -> Session:
    return session(path, cached, ctx=256, chunk=32)


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return errors(ours, ref)[1]


@pytest.mark.parametrize("arch,layout,quant", CASES)
def test_logits_and_greedy_match_transformers(pairs, arch: str, layout: str, quant: str) -> None:
    hf, path = pairs(arch, layout, quant)
    ids = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    # float32 KV cache: only the model's maths remains (three prefill chunks of 32)
    exact = f32_kv(_session(path, cached=False))
    rel = _rel(exact.logits(ids.tolist()), ref)
    assert rel < 1e-4, f"{arch} {layout} {quant}: logits differ by {rel:.2e} of their range"
    prompt = ids[:12].tolist()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out: list[int] = []
    exact.generate(prompt, GREEDY, set(), out.append)
    exact.close()
    assert out == want, f"{arch} {layout} {quant}: greedy continuation differs"
    # the priced f16 latent cache: rounding the latent moves a tie-close routing choice at
    # most here and there (these models are made to route and attend sharply)
    sess = _session(path, cached=False)
    got = sess.logits(ids.tolist())
    sess.close()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.95


def test_without_the_latent_attention_the_logits_are_wrong(pairs) -> None:
    # the check above can fail: the same file read with each head's key and value matrices
    # swapped between heads (a transposition of attn_k_b / attn_v_b) is far off
    hf, path = pairs("deepseek3", "mla", "f32")
    ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    sess = f32_kv(_session(path, cached=False))
    for st in sess.loaded:
        for name, w in st.tensors.items():
            if name.endswith("attn_k_b.weight"):
                per = w.raw.numel() // w.n_expert
                w.raw.copy_(torch.cat([w.raw[(e - 1) * per:e * per] if e else w.raw[-per:]
                                       for e in range(w.n_expert)]))
    rel = _rel(sess.logits(ids.tolist()), ref)
    sess.close()
    assert rel > 1e-2


def test_legacy_and_split_layouts_agree_through_the_dequant_cache(pairs) -> None:
    # the product path: bf16 cache copies of attn_kv_b and of attn_k_b / attn_v_b give the
    # same per-head matrices (to bf16), so both layouts' absorbed attention agree
    from engine.runtime.models.deepseek2 import Deepseek2Stage
    from engine.runtime.models.ops import QExperts, QWeight

    _, split = pairs("deepseek3", "mla", "q8_0")
    _, legacy = pairs("deepseek3", "legacy", "q8_0")
    a, b = _session(split, cached=True), _session(legacy, cached=True)
    sa, sb = a.stages[0], b.stages[0]
    assert isinstance(sa, Deepseek2Stage)
    kb = sa.t["blk.1.attn_k_b.weight"]
    assert isinstance(kb, QExperts) and kb.cached is not None
    assert isinstance(sb.t["blk.1.attn_kv_b.weight"], QWeight)
    ka, kl = sa._k_b(1), sb._k_b(1)  # [h, c, nope] each, the legacy one a view of attn_kv_b
    torch.testing.assert_close(ka, kl, rtol=2e-2, atol=2e-2)  # two Q8_0 roundings
    torch.testing.assert_close(sa._v_b(1), sb._v_b(1), rtol=2e-2, atol=2e-2)
    a.close()
    b.close()


def test_the_kv_cache_holds_one_latent_row_per_token(pairs) -> None:
    from engine.planning.price import price

    _, path = pairs("deepseek3", "mla", "q8_0")
    hp = HParams.from_model(GGUFModel.open(path))
    assert hp.mla and hp.kv_rows() == ((1, hp.kv_lora_rank + hp.rope_dim), None)
    plan = Plan(model=str(path), devices=(CPU,), split=(0, hp.n_layer_run), ctx=256,
                prefill_chunk=32)
    spans = {s.name: s for d in price(plan).devices for a in d.arenas for s in a.spans}
    kv = sorted(n for n in spans if n.startswith("kv."))
    assert kv == [f"kv.{i}.k" for i in range(hp.n_layer_run)]  # no value span: the latent
    assert all(spans[n].nbytes == 256 * (hp.kv_lora_rank + hp.rope_dim) * 2 for n in kv)
    # a per-head cache would be n_head (head_dim + head_dim_v) wide
    assert hp.kv_lora_rank + hp.rope_dim < hp.n_head * (hp.head_dim + hp.head_dim_v)


def test_group_limited_routing_matches_transformers() -> None:
    import transformers as tf

    from engine.runtime.models.ops import route

    cfg = tf.DeepseekV3Config(hidden_size=16, n_routed_experts=16, num_experts_per_tok=4,
                              n_group=4, topk_group=2, norm_topk_prob=True,
                              routed_scaling_factor=2.5)
    router = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.3)
        x = torch.randn(64, 16, generator=g)
        logits, want_w, want_ids = router(x)
    ids, w = route(logits, 4, "sigmoid", True, 2.5, router.e_score_correction_bias, (4, 2))
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(-1, order), want_ids.gather(-1, want_order))
    torch.testing.assert_close(w.gather(-1, order), want_w.gather(-1, want_order))
    # the limit matters: without it some token chooses an expert of a third group
    free, _ = route(logits, 4, "sigmoid", True, 2.5, router.e_score_correction_bias)
    assert ((free // 4).unsqueeze(-1) != (free // 4).unsqueeze(-2)).any()
    assert any(len(set((row // 4).tolist())) > 2 for row in free)
    assert all(len(set((row // 4).tolist())) <= 2 for row in ids)


def _edit_meta(key: str, value):
    def edit(meta, table):
        return [(k, t, value if k == key else v) for k, t, v in meta], table
    return edit


def _drop(name: str):
    def edit(meta, table):
        return meta, [row for row in table if row[0] != name]
    return edit


def _reshape(name: str, shape: tuple[int, ...]):
    def edit(meta, table):
        return meta, [(n, shape if n == name else d, t) for n, d, t in table]
    return edit


@pytest.mark.parametrize("layout,edit,expect", [
    ("mla", _edit_meta("deepseek2.attention.kv_lora_rank", 0), "kv_lora_rank is 0"),
    ("mla", _edit_meta("deepseek2.attention.kv_lora_rank", 32), "attn_kv_a_mqa.weight has shape"),
    ("mla", _edit_meta("deepseek2.attention.key_length_mla", 40), "attn_q_b.weight has shape"),
    ("mla", _drop("blk.2.attn_kv_a_norm.weight"), "blk.2.attn_kv_a_norm.weight is missing"),
    ("mla", _drop("blk.0.attn_v_b.weight"), "blk.0.attn_v_b.weight is missing"),
    ("legacy", _edit_meta("deepseek2.attention.value_length", 16), "attn_kv_b.weight has shape"),
    ("mla", _edit_meta("deepseek2.expert_group_count", 3), "expert_group_count 3"),
    ("mla", _reshape("blk.1.exp_probs_b.bias", (4,)), "blk.1.exp_probs_b.bias has shape [4]"),
])
def test_bad_files_are_refused_in_one_sentence(tmp_path, layout, edit, expect) -> None:
    _, path = write_pair("deepseek3", "f32", tmp_path / "bad.gguf", layout=layout, edit=edit)
    with pytest.raises(CarveError) as e:
        HParams.from_model(GGUFModel.open(path))
    msg = str(e.value)
    assert expect in msg and str(path) in msg and "\n" not in msg, msg


def test_a_gpu_plan_runs_on_the_triton_runner_with_either_kv_cache(pairs, synth_model) -> None:
    """A GPU plan runs on the Triton runner (latent attention on an f16 or a q8_0 cache), its
    experts in host memory too (only the Triton runner computes those)."""
    from dataclasses import replace

    from engine.planning.capability import runner_for
    from engine.planning.carve import model_index
    from engine.planning.price import price
    from engine.planning.rules import KvType, Verdict
    from spec.runners import TRITON

    gpu = DeviceSpec(index=0, name="NVIDIA H200", total=GIB // 64, free=GIB // 64)  # 16 MiB
    # deepseek2-tiny's latent rows (256 + 32 values) are whole q8_0 blocks
    for path, kv in ((pairs("deepseek3", "mla", "q8_0")[1], KvType.F16),
                     (synth_model("deepseek2-tiny"), KvType.Q8_0)):
        model = GGUFModel.open(path)
        hp = HParams.from_model(model)
        plan = Plan(model=str(path), devices=(gpu,), split=(0, hp.n_layer_run), ctx=256,
                    prefill_chunk=32, cache_reserve=0, kv_type=kv)
        assert runner_for(plan, model_index(model)) is TRITON
        # (16 MiB does not fit it, but nothing says it does not run)
        assert price(replace(plan, experts_resident=(0,)), model).devices[0].verdict in (
            Verdict.FITS, Verdict.DOES_NOT_FIT)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_the_torch_engine_runs_it_as_priced(pairs, tmp_path, monkeypatch) -> None:
    """A CUDA plan of deepseek2 loads on the torch engine where asked (bf16 dequant cache and
    activations), its load's allocation the priced one, its logits near the CPU engine's."""
    from engine.runtime.options import RunnerOptions

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    _, path = pairs("deepseek3", "mla", "q8_0")
    hp = HParams.from_model(GGUFModel.open(path))
    free, total = torch.cuda.mem_get_info(0)
    dev = DeviceSpec(index=0, name=torch.cuda.get_device_name(0), total=total, free=free)
    plan = Plan(model=str(path), devices=(dev,), split=(0, hp.n_layer_run), ctx=128,
                prefill_chunk=32, cache_reserve=0, logits_rows=1, act_dtype="bf16")
    g = Session.load(plan, options=RunnerOptions(runner="torch"))
    c = _session(path, cached=True)  # the same bf16 copies of the matrices
    try:
        assert type(g) is Session  # not the Triton runner's
        (report,) = g.memory_report()  # the load allocated the priced arenas, nothing else
        assert report["allocated"] == report["priced"]
        ids = torch.randint(3, 500, (40,), generator=torch.Generator().manual_seed(6)).tolist()
        got, ref = g.logits(ids).float().cpu(), c.logits(ids)
        # bf16 activations move a close routing choice here and there in these sharp models
        assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    finally:
        g.close()
        c.close()
        torch.cuda.empty_cache()


def test_latent_attention_in_blocks_is_the_plain_softmax(monkeypatch) -> None:
    # the heads of a token are rows of one product over the single key head, in blocks of
    # tokens; any block size gives the plain masked softmax
    from engine.runtime.models import deepseek2

    g = torch.Generator().manual_seed(7)
    t, h, s, d, dv = 5, 3, 9, 24, 16
    q, k, v = torch.randn(t, h, d, generator=g), torch.randn(s, d, generator=g), torch.randn(s, dv, generator=g)
    mask = torch.arange(s)[None, :] <= torch.arange(s - t, s)[:, None]  # causal, the last t
    scores = torch.einsum("thd,sd->ths", q, k) * 0.3
    want = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), -1) @ v
    for block in (1 << 24, h * s * 2, h * s):  # one block, blocks of 2 tokens, of 1
        monkeypatch.setattr(deepseek2, "SCORES", block)
        torch.testing.assert_close(deepseek2.latent_attention(q, k, v, mask, 0.3), want)
    torch.testing.assert_close(deepseek2.latent_attention(q[-1:], k, v, None, 0.3), want[-1:])


def test_a_q8_0_latent_cache_reads_back_close_to_the_f16_one(synth_model) -> None:
    # deepseek2-tiny's latent rows (256 + 32 values) are whole q8_0 blocks: the cache holds
    # 34 bytes per 32 values of each row, its first layer's rows read back (gguf's dequantize)
    # as the f16 cache's to q8_0's rounding, and the logits stay near the f16 cache's
    from gguf import GGMLQuantizationType, dequantize

    path = synth_model("deepseek2-tiny")
    hp = HParams.from_model(GGUFModel.open(path))
    got, rows = {}, {}
    for kv in ("f16", "q8_0"):
        plan = Plan(model=str(path), devices=(CPU,), split=(0, hp.n_layer_run), ctx=64,
                    prefill_chunk=16, kv_type=kv, logits_rows=16)
        s = Session.load(plan)
        k0 = s.kv.layers[0].k
        assert k0.dtype == (torch.uint8 if kv == "q8_0" else torch.float16)
        assert k0.numel() * k0.element_size() == 64 * (hp.kv_lora_rank + hp.rope_dim) * (
            34 / 32 if kv == "q8_0" else 2)
        got[kv] = s.logits(list(range(5, 45)))
        k0 = k0.reshape(64, -1)[:40].cpu()
        rows[kv] = (torch.from_numpy(dequantize(k0.numpy(), GGMLQuantizationType.Q8_0))
                    if kv == "q8_0" else k0.float())
        s.close()
    assert _rel(rows["q8_0"], rows["f16"]) < 1e-2
    # a row whose router sat near a tie takes another expert over the cache's rounding: with
    # 16 experts (2 used) in 3 sigmoid-routed layers, 7 of these 40 rows did (0.12-0.37 off,
    # the rest 0.7-1.6e-2); a misread cache moves every row
    errs = torch.tensor([_rel(got["q8_0"][i], got["f16"][i]) for i in range(40)])
    assert errs.median() < 2e-2 and (errs < 5e-2).sum() >= 30, errs
    assert (got["q8_0"].argmax(-1) == got["f16"].argmax(-1)).float().mean() >= 0.75


def test_mistral_large_attention_temperature(tmp_path) -> None:
    # a file with llama.cpp's attention temperature (length 32, scale 0.5): positions below
    # 32 read exactly as the same file without it, later ones warmer by 1 + 0.5 ln(floor(p /
    # 32) + 1)
    from engine.runtime.models.deepseek2 import temperature

    def with_temp(meta, table):
        return meta + [("deepseek2.attention.temperature_scale", F32, 0.5),
                       ("deepseek2.attention.temperature_length", U32, 32)], table

    _, plain = write_pair("deepseek3", "f32", tmp_path / "plain.gguf")
    _, warm = write_pair("deepseek3", "f32", tmp_path / "warm.gguf", edit=with_temp)
    hp = HParams.from_model(GGUFModel.open(warm))
    assert (hp.attn_temp_scale, hp.attn_temp_length) == (0.5, 32)
    f = temperature(hp, 30, 36, torch.device("cpu"))
    assert f[:2].tolist() == [1.0, 1.0]  # positions 30, 31
    torch.testing.assert_close(f[2:34], torch.full((32,), 1 + 0.5 * math.log(2)))
    torch.testing.assert_close(f[34:], torch.full((2,), 1 + 0.5 * math.log(3)))
    ids = torch.randint(3, 500, (70,), generator=torch.Generator().manual_seed(8)).tolist()
    a, b = f32_kv(_session(plain, cached=False)), f32_kv(_session(warm, cached=False))
    la, lb = a.logits(ids), b.logits(ids)
    a.close()
    b.close()
    assert torch.equal(la[:32], lb[:32])
    assert _rel(lb[32:], la[32:]) > 1e-3


@pytest.mark.parametrize("edit,expect", [
    (lambda meta, table: (meta + [("deepseek2.attention.temperature_scale", F32, 0.5)], table),
     "temperature_length is 0"),
])
def test_an_attention_temperature_without_its_length_is_refused(tmp_path, edit, expect) -> None:
    _, path = write_pair("deepseek3", "f32", tmp_path / "bad.gguf", edit=edit)
    with pytest.raises(CarveError, match=expect):
        HParams.from_model(GGUFModel.open(path))


@pytest.mark.parametrize("n_layer,n_vocab,gating", [
    (27, 102400, "softmax"),  # DeepSeek-V2-Lite's shape without the key: V2's softmax
    (47, 154880, "sigmoid"),  # GLM-4.7 Lite's, as llama.cpp tells its files apart
    (47, 102400, "softmax"),
])
def test_routing_of_files_without_a_gating_key(n_layer, n_vocab, gating) -> None:
    from dataclasses import replace

    from engine.synth.header import HeaderModel
    from engine.synth.shapes import SHAPES

    shape = replace(SHAPES["deepseek-v2-lite"], n_layer=n_layer, n_vocab=n_vocab, expert_gating=0)
    assert HParams.from_model(HeaderModel(shape)).expert_gating == gating


# the Triton runner's f32 logits against the CPU engine's: 2-4e-5 under the interpreter, 3.3e-4
# and 2.9e-4 on an H200 (its GEMVs' and cuBLAS's sums in other orders; 2026-12-05)
BOUND = 2e-3 if torch.cuda.is_available() else 2e-4


@pytest.mark.parametrize("arch,layout,quant,temp", [
    ("deepseek3", "mla", "q8_0", False), ("deepseek2", "legacy", "q8_0", False),
    ("deepseek3", "legacy", "q8_0", True)])
def test_the_triton_runner_gives_the_cpu_engines_logits(pairs, tmp_path, arch, layout, quant,
                                                        temp) -> None:
    """The Triton runner's latent attention (carve_kernels/latent.py: the absorbed per-head
    matrices, the latent cache, split-K decode, Mistral Large 3's temperature past its
    length) and group-limited routing on the transformers models' files: prefill over two
    chunks, decode steps and greedy ids as the CPU engine's (float x in decode: the int8
    copies' rounding is the dense families' own)."""
    from gpu_compare import against_cpu_engine

    from engine.runtime.options import RunnerOptions

    if temp:
        def with_temp(meta, table):
            return meta + [("deepseek2.attention.temperature_scale", F32, 0.5),
                           ("deepseek2.attention.temperature_length", U32, 8)], table

        _, path = write_pair(arch, quant, tmp_path / "warm.gguf", layout=layout, edit=with_temp)
    else:
        _, path = pairs(arch, layout, quant)
    hp = HParams.from_model(GGUFModel.open(path))
    plan = Plan(model=str(path), devices=(CPU,), split=(0, hp.n_layer_run), ctx=64,
                prefill_chunk=16, cache_reserve=1 << 50, logits_rows=16)
    ids = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(9)).tolist()
    against_cpu_engine(plan, torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"),
                       ids[:24], ids[24:27], ids[:6], BOUND, f"{arch}-{layout}-{quant}",
                       options=RunnerOptions(q8x=False))


def test_the_triton_runner_on_a_q8_0_cache_gives_the_cpu_engines_logits(synth_model) -> None:
    """deepseek2-tiny (q LoRA, group-limited sigmoid routing, YaRN; 288-value latent rows) on a
    q8_0 KV cache: both engines quantize each row as ggml does and read it back, so prefill,
    decode and greedy ids agree as on an f16 cache."""
    from gpu_compare import against_cpu_engine

    from engine.runtime.options import RunnerOptions

    path = synth_model("deepseek2-tiny")
    hp = HParams.from_model(GGUFModel.open(path))
    plan = Plan(model=str(path), devices=(CPU,), split=(0, hp.n_layer_run), ctx=64,
                prefill_chunk=16, cache_reserve=1 << 50, logits_rows=16, kv_type="q8_0")
    ids = torch.randint(3, 500, (30,), generator=torch.Generator().manual_seed(10)).tolist()
    against_cpu_engine(plan, torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"),
                       ids[:24], ids[24:27], ids[:6], BOUND, "deepseek2-tiny q8_0 cache",
                       check=_q8_caches, options=RunnerOptions(q8x=False))


def _q8_caches(g) -> None:
    caches = [la.attn.cache for st in g.pipe.stages for la in st.layers]
    assert caches and all(c.dtype == torch.uint8 for c in caches)

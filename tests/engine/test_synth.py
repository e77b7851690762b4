"""Synthetic models: llama.cpp's Q4_K_M choices, well-formed blocks, split sets, the CLI."""

from __future__ import annotations

import subprocess
import sys
import tracemalloc
import warnings

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from app.__main__ import main as carve_main
from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.gguf.writer import tensor_bytes
from engine.synth.contents import tensor_table
from engine.synth.file_types import FILE_TYPES
from engine.synth.gen import SHAPES, Shape, main, tensor_types, write_model
from spec.errors import CarveError
from spec.quant_types import QUANT, type_name


def _shape_of(model: GGUFModel) -> Shape:
    hp = HParams.from_model(model)
    return Shape(hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.n_ff, hp.n_vocab,
                 head_dim=hp.head_dim, tied_embeddings=hp.tied_embeddings,
                 sliding_window=hp.sliding_window)


def _assert_same_table_and_types(model: GGUFModel, layer_order=None) -> None:
    shape = _shape_of(model)
    real = {t.name: (t.shape, t.ggml_type) for t in model.tensors}
    ours = dict(tensor_table(shape))
    types = tensor_types(shape, "q4_k_m", layer_order)
    assert set(ours) == set(real)
    wrong = [(n, type_name(real[n][1]), type_name(types[n])) for n in ours
             if real[n] != (ours[n], types[n])]
    assert wrong == []


def _gen_read_back(tmp_path, capsys, shape: str) -> GGUFModel:
    """`carve gen --shape SHAPE` (its default q4_k_m mix) into tmp_path, read back: every tensor
    the shape's table names, with its shape and the mix's type, and each quantized one
    dequantizing to finite values."""
    sh = SHAPES[shape]
    out = tmp_path / f"{shape}.gguf"
    assert carve_main(["gen", "--shape", shape, "-o", str(out)]) == 0
    assert f"{shape} q4_k_m: 1 file(s)" in capsys.readouterr().out
    model = GGUFModel.open(out)
    table = dict(tensor_table(sh))
    types = tensor_types(sh, "q4_k_m")
    assert {t.name for t in model.tensors} == set(table)
    for t in model.tensors:
        assert (t.shape, t.ggml_type) == (table[t.name], types[t.name]), t.name
        if len(t.shape) < 2 or t.ggml_type == 0:
            continue
        w = dequantize(model.tensor_data(t), GGMLQuantizationType(t.ggml_type))
        assert np.isfinite(w).all(), t.name
    return model


def test_q4_k_m_equals_llama_cpp_on_gemma(gemma_model_path):
    # a file llama.cpp quantized: every tensor's name, shape and type, fallbacks included
    # (640-wide rows cannot hold K blocks: Q4_K -> Q5_0, Q6_K -> Q8_0, as llama.cpp does)
    _assert_same_table_and_types(GGUFModel.open(gemma_model_path))


def test_q4_k_m_equals_llama_cpp_on_demo(demo_model_path):
    # The demo's source listed layers as strings (0, 1, 10, 11, ...); llama.cpp's more-bits rule
    # counts attn_v / ffn_down in that order, so the file order is the layer order here.
    model = GGUFModel.open(demo_model_path)
    order = [t.layer for t in model.tensors if t.name.endswith("ffn_down.weight")]
    assert order[:3] == [0, 1, 10]
    _assert_same_table_and_types(model, order)
    size = sum(t.nbytes for t in model.tensors)
    shape = SHAPES["qwen2-0.5b"]
    ours = tensor_types(shape, "q4_k_m")
    assert sum(tensor_bytes(ours[n], d) for n, d in tensor_table(shape)) == size


@pytest.mark.parametrize(("shape", "expect"), [
    # model sizes of the llama.cpp reference runs (docs/DESIGN.md): tensor bytes of Q4_K_M files
    ("qwen2-7b", "4.36 GiB"), ("qwen2-32b", "18.48 GiB"), ("qwen2-0.5b", "463.0 MiB"),
])
def test_real_shape_sizes(shape, expect):
    sh = SHAPES[shape]
    types = tensor_types(sh, "q4_k_m")
    total = sum(tensor_bytes(types[n], d) for n, d in tensor_table(sh))
    got = f"{total / 2**30:.2f} GiB" if expect.endswith("GiB") else f"{total / 2**20:.1f} MiB"
    assert got == expect


def test_q4_k_m_rule_on_the_7b_shape():
    types = tensor_types(SHAPES["qwen2-7b"], "q4_k_m")
    more = [i for i in range(28) if types[f"blk.{i}.attn_v.weight"] == 14]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert more == [i for i in range(28) if types[f"blk.{i}.ffn_down.weight"] == 14]
    assert types["token_embd.weight"] == 12 and types["output.weight"] == 14
    assert types["blk.3.attn_q.weight"] == 12 and types["blk.3.attn_norm.weight"] == 0
    assert types["blk.3.attn_q.bias"] == 0


def test_q5_k_m_rule_on_the_7b_shape():
    # llama.cpp's Q5_K_M: Q4_K_M's attn_v / ffn_down rule on a Q5_K base, output Q6_K
    types = tensor_types(SHAPES["qwen2-7b"], "q5_k_m")
    more = [i for i in range(28) if types[f"blk.{i}.attn_v.weight"] == 14]
    assert more == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27]
    assert more == [i for i in range(28) if types[f"blk.{i}.ffn_down.weight"] == 14]
    assert types["blk.3.attn_v.weight"] == types["blk.3.ffn_down.weight"] == 13
    assert types["token_embd.weight"] == 13 and types["output.weight"] == 14
    assert types["blk.3.attn_q.weight"] == types["blk.3.ffn_up.weight"] == 13


_FLOATS = ("F32", "F16", "BF16", "F64")
_TYPES = [q.name.lower() for q in QUANT.values() if q.block_size > 1 or q.name in _FLOATS]


@pytest.mark.parametrize("mix", _TYPES)
def test_every_type_writes_well_formed_blocks(synth_model, mix):
    # a type whose name is also a llama.cpp file type's: "pure-" asks for that type alone
    model = GGUFModel.open(synth_model("llama", f"pure-{mix}" if mix in FILE_TYPES else mix))
    for t in model.tensors:
        if len(t.shape) == 1:
            assert t.ggml_type == 0
            continue
        assert type_name(t.ggml_type).lower() == mix
        raw = model.tensor_data(t)
        try:
            w = dequantize(raw, GGMLQuantizationType(t.ggml_type))
            mean = float(np.mean(w, dtype=np.float64))
        except NotImplementedError:  # Q8_1, Q8_K, Q1_0, F64: check the scale fields instead
            q = QUANT[t.ggml_type]
            blocks = raw.reshape(-1, q.type_size)
            if mix == "f64":
                w = blocks.view(np.float64)
            elif mix == "q8_k":  # float d; int8 quants have an RMS of ~74
                w = blocks[:, :4].copy().view(np.float32) * 74
            else:  # Q8_1: f16 d times int8 quants; Q1_0: f16 d times +-1
                w = blocks[:, :2].copy().view(np.float16).astype(np.float32)
                w = w * (74 if mix == "q8_1" else 1)
            mean = 0.0  # (scales alone: no values to average)
        assert np.isfinite(w).all(), t.name
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
        assert 0.002 < rms < 0.2, (t.name, rms)
        # near zero-mean, as trained weights quantize (Q4_0 / Q5_0's q - 8 / q - 16 on
        # uniform q leave half a step: -0.1 of the spread); a mean as large as the spread made
        # every token's hidden state alike (test_a_synthetic_router_spreads_its_tokens)
        assert abs(mean) < 0.12 * rms, (t.name, mix, mean / rms)


def test_a_synthetic_router_spreads_its_tokens(tmp_path):
    """The router of a synthetic Qwen3-30B-A3B layer (its widths, 128 experts, 8 used; one
    layer) sends 64 random tokens to many experts through the CPU engine, not all to the same
    8 (as every file did while Q4_K blocks had a mean as large as their spread)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from engine.hardware.devices import cpu_spec
    from engine.planning.plan import Plan
    from engine.runtime.models.ops import TORCH_OPS
    from engine.runtime.session import Session

    shape = dataclasses.replace(SHAPES["qwen3moe-30b-a3b"], n_layer=1, n_vocab=1024)
    path = write_model(tmp_path / "m.gguf", shape)[0]
    chosen: list[torch.Tensor] = []

    def route(*a, **kw):
        ids, w = TORCH_OPS.route(*a, **kw)
        chosen.append(ids)
        return ids, w

    plan = Plan(model=str(path), devices=(cpu_spec(),), split=(0, 1), ctx=256,
                prefill_chunk=64, cache_reserve=0, act_dtype="f32")
    sess = Session.load(plan, ops=SimpleNamespace(**{**vars(TORCH_OPS), "route": route}))
    try:
        g = torch.Generator().manual_seed(0)
        sess.logits(torch.randint(3, 1000, (64,), generator=g).tolist())
    finally:
        sess.close()
    (ids,) = chosen
    assert ids.shape == (64, 8)
    distinct = len(set(ids.reshape(-1).tolist()))
    assert distinct >= 64, distinct  # 512 choices: ~126 at uniform routing; 8 when degenerate


def test_norms_near_one_and_vocabulary(synth_model):
    path = synth_model("gemma3")
    model = GGUFModel.open(path)
    norm = model.tensor_data(model.tensor("blk.0.attn_norm.weight")).view(np.float32)
    assert abs(float(norm.mean()) - 1.0) < 0.01
    md = model.metadata
    assert len(md["tokenizer.ggml.tokens"]) == HParams.from_model(model).n_vocab == 512
    assert md["tokenizer.ggml.tokens"][md["tokenizer.ggml.eos_token_id"]] == "<|im_end|>"
    from transformers import AutoTokenizer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    text = "the cat sat on the mat. Ünïcode ✓"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and tok.convert_ids_to_tokens(ids[:2]) == ["t", "he"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_transformers_runs_the_synthetic_model(synth_model, arch):
    # someone else's loader and model code: names, shapes, blocks and metadata all fit
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    path = synth_model(arch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 512) and bool(torch.isfinite(logits).all())
    assert 0.1 < float(logits.std()) < 100


def test_split_set_holds_the_same_bytes(synth_model):
    one = GGUFModel.open(synth_model("qwen3", "q6_k"))
    three = GGUFModel.open(synth_model("qwen3", "q6_k", split=3))
    assert len(three.paths) == 3 and {t.shard for t in three.tensors} == {0, 1, 2}
    for a, b in zip(one.tensors, three.tensors, strict=True):
        assert (a.name, a.shape, a.ggml_type) == (b.name, b.shape, b.ggml_type)
        assert np.array_equal(one.tensor_data(a), three.tensor_data(b)), a.name
    second = GGUFReader(three.paths[1]).fields
    assert int(second["split.no"].contents()) == 1 and int(second["split.count"].contents()) == 3
    assert int(second["split.tensors.count"].contents()) == len(one.tensors)
    assert "general.architecture" not in second  # like gguf-split: metadata in shard 1 only


def test_streams_instead_of_holding_the_model(tmp_path):
    tracemalloc.start()
    try:
        paths = write_model(tmp_path / "half.gguf", "qwen2-0.5b", "q4_k_m")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = paths[0].stat().st_size
    assert size > 480e6 and peak < size / 4


def test_cli_prints_what_it_wrote(tmp_path, capsys):
    out = tmp_path / "m.gguf"
    assert main(["--shape", "qwen2-tiny", "--mix", "q8_0", "-o", str(out), "--split", "2"]) == 0
    text = capsys.readouterr().out
    assert "m-00001-of-00002.gguf" in text and "m-00002-of-00002.gguf" in text
    assert "qwen2-tiny q8_0: 2 file(s)" in text and " s (" in text
    assert carve_main(["gen", "--shape", "llama-tiny", "-o", str(out)]) == 0
    assert GGUFModel.open(out).arch == "llama"
    capsys.readouterr()
    assert carve_main(["gen", "--list"]) == 0
    assert "qwen2-7b           qwen2     28 layers" in capsys.readouterr().out


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "qwen9"], "unknown --shape 'qwen9'"),
    (["--list", "--mix", "q9"], "unknown --mix 'q9'"),
    (["--mix", "q8_0"], "--shape and -o are needed"),
    (["--shape", "llama-tiny", "--mix", "q9"], "unknown --mix 'q9'"),
    (["--shape", "llama-tiny", "--split", "0"], "--split 0"),
    (["--shape", "qwen2-0.5b", "--mix", "q4_0", "-o", "/proc/no/m.gguf"], "cannot write"),
])
def test_cli_bad_input(tmp_path, capsys, args, message):
    if "-o" not in args and "--shape" in args:
        args = [*args, "-o", str(tmp_path / "x.gguf")]
    assert carve_main(["gen", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("carve: ") and message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())


def test_rows_no_type_can_hold():
    odd = Shape("llama", 1, 48, 1, 1, 64, 300)
    with pytest.raises(CarveError, match="Q4_0 cannot store rows of 48 values"):
        tensor_types(odd, "q4_0")
    assert tensor_types(odd, "f16")["blk.0.attn_q.weight"] == 1


def test_gen_never_imports_torch(tmp_path):
    code = ("import sys; from app.cli_gen import main; "
            f"main(['gen', '--shape', 'gemma3-tiny', '-o', {str(tmp_path / 'g.gguf')!r}]); "
            "import engine.gguf.reader, engine.gguf.hparams; "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


# --- mixture of experts ---------------------------------------------------------------------

@pytest.mark.parametrize(("shape", "expect"), [
    # the Qwen3-30B-A3B Q4_K_M reference file; gpt-oss as ggml-org publishes it (12.1 GB,
    # 63.4 GB: MXFP4 experts, Q8_0 elsewhere)
    ("qwen3moe-30b-a3b", "17.28 GiB"), ("gpt-oss-20b", "11.27 GiB"), ("gpt-oss-120b", "59.02 GiB"),
    # Mixtral 8x22B's published Q4_K_M files: 85.6 GB
    ("mixtral-8x22b", "79.72 GiB"),
])
def test_moe_shape_sizes_without_writing(shape, expect, capsys):
    from engine.synth.gen import model_bytes

    assert f"{model_bytes(SHAPES[shape]) / 2**30:.2f} GiB" == expect
    assert main(["--list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(shape + " "))
    assert line.endswith(expect) and f"{SHAPES[shape].n_expert} experts" in line


def test_q4_k_m_rule_on_moe_tensors():
    sh = SHAPES["qwen3moe-30b-a3b"]
    types = tensor_types(sh, "q4_k_m")
    # ffn_down_exps takes the dense ffn_down rule, the layer read from its name
    more = [i for i in range(48) if types[f"blk.{i}.ffn_down_exps.weight"] == 14]
    assert more == [i for i in range(48) if types[f"blk.{i}.attn_v.weight"] == 14]
    assert more[:8] == [0, 1, 2, 3, 4, 5, 8, 11] and len(more) == 24
    assert {types[f"blk.{i}.ffn_gate_exps.weight"] for i in range(48)} == {12}
    assert types["blk.7.ffn_gate_inp.weight"] == 0  # the router stays F32
    assert types["blk.7.attn_k.weight"] == 12 and types["blk.7.attn_output.weight"] == 12
    assert dict(tensor_table(sh))["blk.0.ffn_down_exps.weight"] == (768, 2048, 128)
    # 8 experts (Mixtral's rule): attn_v and attn_k Q8_0, attn_output Q5_K
    eight = Shape("qwen3moe", 8, 256, 4, 2, 512, 512, head_dim=64, n_expert=8, n_expert_used=2,
                  n_ff_exp=256)
    t8 = tensor_types(eight, "q4_k_m")
    assert (t8["blk.3.attn_v.weight"], t8["blk.3.attn_k.weight"]) == (8, 8)
    assert t8["blk.3.attn_output.weight"] == 13


def test_glm_mix_counts_the_nextn_layer_and_falls_back():
    sh = SHAPES["glm4.5-air"]
    types = tensor_types(sh, "q4_k_m")
    table = dict(tensor_table(sh))
    assert sh.n_block == 47 and "blk.46.nextn.eh_proj.weight" in table
    assert "blk.46.ffn_down_exps.weight" in table and "blk.47.attn_q.weight" not in table
    assert "blk.0.ffn_down.weight" in table and "blk.0.ffn_gate_inp.weight" not in table
    # 1408-wide expert rows cannot hold K blocks: Q4_K -> Q5_0, Q6_K -> Q8_0 (llama.cpp's
    # fallback); the more-bits layers are those of all 47 declared layers
    down = {i: types[f"blk.{i}.ffn_down_exps.weight"] for i in range(1, 47)}
    assert set(down.values()) == {6, 8}
    assert [i for i, t in down.items() if t == 8][-5:] == [42, 43, 44, 45, 46]
    assert types["blk.44.ffn_down_shexp.weight"] == 8 and types["blk.45.ffn_down_shexp.weight"] == 8
    assert types["blk.1.ffn_gate_exps.weight"] == 12 and types["blk.1.exp_probs_b.bias"] == 0


def test_gpt_oss_mix_as_published():
    types = tensor_types(SHAPES["gpt-oss-20b"], "mxfp4_moe")
    assert {types[f"blk.{i}.ffn_{p}_exps.weight"] for i in range(24) for p in ("gate", "up", "down")} == {39}
    assert types["blk.0.attn_q.weight"] == types["output.weight"] == types["token_embd.weight"] == 8
    assert types["blk.0.ffn_gate_exps.bias"] == types["blk.0.attn_sinks.weight"] == 0
    assert types["blk.0.ffn_gate_inp.weight"] == 0


@pytest.mark.parametrize(("shape", "mix"), [
    ("qwen3moe-tiny", "q4_k_m"), ("gpt-oss-tiny", "mxfp4_moe"), ("glm4moe-tiny", "q4_k_m"),
    ("mixtral-tiny", "q4_k_m"),
])
def test_moe_files_read_back_with_well_formed_experts(synth_model, shape, mix):
    sh = SHAPES[shape]
    model = GGUFModel.open(synth_model(shape, mix))
    hp = HParams.from_model(model)
    assert (hp.n_expert, hp.n_expert_used, hp.n_ff_exp) == (sh.n_expert, sh.n_expert_used, sh.n_ff_exp)
    assert (hp.n_layer, hp.n_layer_run, hp.n_layer_dense_lead) == (sh.n_block, sh.n_layer,
                                                                   sh.n_layer_dense_lead)
    assert hp.rope_dim == (sh.rope_dim or sh.hd)
    assert hp.n_ff_shexp == sh.n_ff_exp * sh.n_expert_shared
    types = tensor_types(sh, mix)
    experts = 0
    for t in model.tensors:
        assert t.ggml_type == types[t.name], t.name
        if len(t.shape) < 2 or t.ggml_type in (0, 1):
            continue
        w = dequantize(model.tensor_data(t), GGMLQuantizationType(t.ggml_type))
        assert np.isfinite(w).all(), t.name
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
        assert 0.002 < rms < 0.2, (t.name, rms)
        experts += "_exps." in t.name
    assert experts == 3 * (sh.n_block - sh.n_layer_dense_lead)


def test_transformers_runs_a_synthetic_qwen3moe(tmp_path):
    # someone else's loader: names, stacked expert shapes and blocks fit Qwen3MoeForCausalLM.
    # (its GGUF reader ignores expert_feed_forward_length and assumes 768, hence that width)
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    sh = Shape("qwen3moe", 2, 256, 4, 2, 512, 512, head_dim=64, n_ctx=2048, n_expert=4,
               n_expert_used=2, n_ff_exp=768)
    path = write_model(tmp_path / "moe.gguf", sh)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name)
    assert model.config.num_experts == 4 and model.config.num_experts_per_tok == 2
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 512) and bool(torch.isfinite(logits).all())
    assert 0.1 < float(logits.std()) < 100


def test_gen_writes_each_shapes_published_mix_by_default(tmp_path, capsys):
    out = tmp_path / "oss.gguf"
    assert main(["--shape", "gpt-oss-tiny", "-o", str(out)]) == 0
    assert "gpt-oss-tiny mxfp4_moe: 1 file(s)" in capsys.readouterr().out
    model = GGUFModel.open(out)
    assert model.tensor("blk.0.ffn_up_exps.weight").ggml_type == 39  # MXFP4
    assert model.metadata["general.file_type"] == 38  # LLAMA_FTYPE_MOSTLY_MXFP4_MOE
    assert model.metadata["gpt-oss.rope.scaling.type"] == "yarn"


# --- deepseek2 (DeepSeek-V2/V3, Kimi K2: MLA attention) -------------------------------------

@pytest.mark.parametrize(("shape", "expect"), [
    # published Q4_K_M files: DeepSeek-V2-Lite about 10.4 GB, DeepSeek-V3 about 404 GB (377 GiB)
    ("deepseek-v2-lite", "9.65 GiB"), ("deepseek-v3", "376.71 GiB"),
])
def test_deepseek2_shape_sizes_without_writing(shape, expect, capsys):
    from engine.synth.gen import model_bytes

    assert SHAPES[shape].mix == "q4_k_m"
    assert f"{model_bytes(SHAPES[shape]) / 2**30:.2f} GiB" == expect
    assert main(["--list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(shape + " "))
    assert line.endswith(expect) and f"{SHAPES[shape].n_expert} experts" in line


def test_deepseek2_tables_as_the_converter_writes_them():
    v3 = dict(tensor_table(SHAPES["deepseek-v3"]))
    assert v3["blk.0.attn_q_a.weight"] == (7168, 1536) and v3["blk.0.attn_q_b.weight"] == (
        1536, 128 * 192)
    assert v3["blk.0.attn_kv_a_mqa.weight"] == (7168, 576)
    assert v3["blk.0.attn_k_b.weight"] == (128, 512, 128)
    assert v3["blk.0.attn_v_b.weight"] == (512, 128, 128)
    assert v3["blk.0.attn_output.weight"] == (128 * 128, 7168)
    assert "blk.2.ffn_down.weight" in v3 and "blk.3.ffn_down.weight" not in v3
    assert v3["blk.3.ffn_down_exps.weight"] == (2048, 7168, 256)
    assert v3["blk.3.ffn_gate_shexp.weight"] == (7168, 2048) and v3["blk.3.exp_probs_b.bias"] == (
        256,)
    assert "blk.61.attn_norm.weight" not in v3  # the MTP layer is not converted
    lite = dict(tensor_table(SHAPES["deepseek-v2-lite"]))
    assert lite["blk.0.attn_q.weight"] == (2048, 16 * 192) and "blk.0.attn_q_a.weight" not in lite
    assert lite["blk.1.ffn_up_shexp.weight"] == (2048, 2 * 1408)
    assert "blk.1.exp_probs_b.bias" not in lite  # softmax gating: no selection bias
    kimi = SHAPES["kimi-k2"]
    assert kimi.expert_groups == (0, 0) and dict(tensor_table(kimi))["blk.1.ffn_gate_inp.weight"] == (
        7168, 384)


def test_deepseek2_quant_rules():
    from spec import quant_types as qt

    t = tensor_types(SHAPES["deepseek-v3"], "q4_k_m")
    # attn_k_b's rows are 128 long: no K block fits, llama.cpp's fallback Q4_K -> Q5_0
    assert {t[f"blk.{i}.attn_k_b.weight"] for i in range(61)} == {qt.Q5_0}
    assert t["blk.5.attn_v_b.weight"] == t["blk.5.attn_q_b.weight"] == qt.Q4_K
    assert t["blk.5.attn_kv_a_mqa.weight"] == t["blk.5.attn_output.weight"] == qt.Q4_K
    assert t["blk.5.attn_q_a_norm.weight"] == t["blk.5.attn_kv_a_norm.weight"] == qt.F32
    assert t["blk.5.ffn_gate_inp.weight"] == t["blk.5.exp_probs_b.bias"] == qt.F32
    # ffn_down: dense, routed and shared alike by the layer in the name (61 layers)
    assert t["blk.0.ffn_down.weight"] == t["blk.3.ffn_down_exps.weight"] == qt.Q6_K
    assert t["blk.3.ffn_down_shexp.weight"] == qt.Q6_K and t["blk.8.ffn_down_exps.weight"] == qt.Q4_K
    # the legacy attn_kv_b takes attn_v's rule (llama.cpp counts and treats it so)
    legacy = tensor_types(SHAPES["deepseek2-lite-tiny"], "q4_k_m")
    assert [legacy[f"blk.{i}.attn_kv_b.weight"] for i in range(4)] == [qt.Q4_K, qt.Q4_K, qt.Q6_K,
                                                                       qt.Q6_K]
    q8 = tensor_types(SHAPES["deepseek-v3"], "iq2_xxs-q8attn")
    assert q8["blk.4.attn_kv_a_mqa.weight"] == q8["blk.4.attn_v_b.weight"] == qt.Q8_0
    assert q8["blk.4.attn_k_b.weight"] == q8["blk.4.attn_q_a.weight"] == qt.Q8_0
    assert q8["blk.4.ffn_gate_exps.weight"] == qt.IQ2_XXS


@pytest.mark.parametrize("shape", ["deepseek2-tiny", "deepseek2-lite-tiny"])
def test_deepseek2_files_read_back(tmp_path, capsys, shape):
    sh = SHAPES[shape]
    model = _gen_read_back(tmp_path, capsys, shape)
    names = {t.name for t in model.tensors}  # the shape's table's (_gen_read_back)
    md = model.metadata
    a = "deepseek2."
    assert model.arch == "deepseek2" and md[a + "block_count"] == 4
    assert md[a + "attention.head_count"] == 4 and md[a + "rope.dimension_count"] == 32
    assert md[a + "attention.kv_lora_rank"] == 256 and md[a + "leading_dense_block_count"] == 1
    assert md[a + "expert_count"] == 16 and md[a + "expert_feed_forward_length"] == 256
    assert md[a + "rope.scaling.type"] == "yarn" and md[a + "rope.scaling.factor"] == 4.0
    assert md[a + "rope.scaling.original_context_length"] == 512
    assert md[a + "rope.scaling.yarn_log_multiplier"] == pytest.approx(0.1 * sh.mscale_all_dim)
    if not sh.mla_legacy:  # the current converter's MLA layout, V3-style routing
        assert md[a + "attention.head_count_kv"] == 1 and md[a + "attention.q_lora_rank"] == 256
        assert (md[a + "attention.key_length"], md[a + "attention.value_length"]) == (288, 256)
        assert (md[a + "attention.key_length_mla"], md[a + "attention.value_length_mla"]) == (
            96, 64)
        assert md[a + "expert_gating_func"] == 2 and md[a + "expert_weights_norm"] is True
        assert md[a + "expert_weights_scale"] == 2.5 and md[a + "expert_shared_count"] == 1
        assert (md[a + "expert_group_count"], md[a + "expert_group_used_count"]) == (4, 2)
        assert model.tensor("blk.1.attn_k_b.weight").shape == (64, 256, 4)
        assert model.tensor("blk.1.attn_v_b.weight").shape == (256, 64, 4)
        assert model.tensor("blk.1.attn_q_b.weight").shape == (256, 4 * 96)
        assert model.tensor("blk.1.attn_k_b.weight").ggml_type == 6  # Q5_0: 64-long rows
        assert model.tensor("blk.1.exp_probs_b.bias").shape == (16,)
        assert "blk.1.attn_kv_b.weight" not in names
    else:  # the pre-2025 layout: one attn_kv_b, per-head key and value lengths
        assert md[a + "attention.head_count_kv"] == 4 and a + "attention.q_lora_rank" not in md
        assert (md[a + "attention.key_length"], md[a + "attention.value_length"]) == (96, 64)
        assert a + "attention.key_length_mla" not in md and a + "expert_group_count" not in md
        assert md[a + "expert_gating_func"] == 1 and md[a + "expert_weights_norm"] is False
        assert md[a + "expert_shared_count"] == 2
        assert model.tensor("blk.1.attn_kv_b.weight").shape == (256, 4 * (64 + 64))
        assert model.tensor("blk.1.attn_q.weight").shape == (256, 4 * 96)
        assert model.tensor("blk.1.ffn_down_shexp.weight").shape == (512, 256)
        assert "blk.1.exp_probs_b.bias" not in names and "blk.1.attn_k_b.weight" not in names
    assert model.tensor("blk.0.ffn_gate.weight").shape == (256, 512)
    assert model.tensor("blk.1.attn_kv_a_mqa.weight").shape == (256, 256 + 32)


# --- minimax-m2 (MiniMax-M2: all-MoE, sigmoid routing, whole-vector q/k norms) ---------------

def test_minimax_m2_size_and_table_without_writing(capsys):
    from engine.synth.gen import model_bytes

    sh = SHAPES["minimax-m2"]
    # published Q4_K_M files: about 138 GB
    assert sh.mix == "q4_k_m" and f"{model_bytes(sh) / 2**30:.2f} GiB" == "128.83 GiB"
    assert main(["--list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("minimax-m2 "))
    assert line.endswith("128.83 GiB") and "256 experts of 1536 (8 used)" in line
    table = dict(tensor_table(sh))
    assert table["blk.0.attn_q.weight"] == (3072, 48 * 128)
    assert table["blk.0.attn_k.weight"] == table["blk.0.attn_v.weight"] == (3072, 8 * 128)
    assert table["blk.0.attn_q_norm.weight"] == (48 * 128,)  # the whole q, not one head
    assert table["blk.0.attn_k_norm.weight"] == (8 * 128,)
    assert table["blk.61.ffn_down_exps.weight"] == (1536, 3072, 256)
    assert table["blk.0.exp_probs_b.bias"] == (256,) and "blk.62.attn_q.weight" not in table
    assert not any("shexp" in n or n.endswith("ffn_down.weight") for n in table)
    assert table["output.weight"] == (3072, 200064)
    types = tensor_types(sh, "q4_k_m")
    more = [i for i in range(62) if types[f"blk.{i}.ffn_down_exps.weight"] == 14]  # Q6_K
    assert more == [i for i in range(62) if types[f"blk.{i}.attn_v.weight"] == 14]
    assert types["blk.5.attn_q_norm.weight"] == types["blk.5.exp_probs_b.bias"] == 0
    assert types["blk.5.ffn_gate_inp.weight"] == 0 and types["blk.5.attn_k.weight"] == 12


def test_minimax_m2_tiny_reads_back(tmp_path, capsys):
    model = _gen_read_back(tmp_path, capsys, "minimax-m2-tiny")
    md = model.metadata
    a = "minimax-m2."
    assert model.arch == "minimax-m2"
    assert (md[a + "block_count"], md[a + "context_length"], md[a + "embedding_length"]) == (
        4, 2048, 256)
    assert (md[a + "feed_forward_length"], md[a + "expert_feed_forward_length"]) == (256, 256)
    assert (md[a + "attention.head_count"], md[a + "attention.head_count_kv"]) == (4, 2)
    assert (md[a + "attention.key_length"], md[a + "attention.value_length"]) == (64, 64)
    assert md[a + "rope.dimension_count"] == 32 and md[a + "rope.freq_base"] == 1e4
    assert md[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-6)
    assert (md[a + "expert_count"], md[a + "expert_used_count"]) == (16, 2)
    assert md[a + "expert_gating_func"] == 2 and md[a + "vocab_size"] == 512
    assert a + "expert_shared_count" not in md and a + "leading_dense_block_count" not in md
    assert md["tokenizer.ggml.pre"] == "minimax-m2"  # as the real files (gpt-4o's passes)
    for i in range(4):  # every layer MoE; q/k norms over all heads' q and k; F32 bias
        assert model.tensor(f"blk.{i}.attn_q_norm.weight").shape == (4 * 64,)
        assert model.tensor(f"blk.{i}.attn_k_norm.weight").shape == (2 * 64,)
        bias = model.tensor(f"blk.{i}.exp_probs_b.bias")
        assert bias.shape == (16,) and bias.ggml_type == 0
        assert model.tensor(f"blk.{i}.ffn_gate_inp.weight").shape == (256, 16)
        assert model.tensor(f"blk.{i}.ffn_gate_exps.weight").shape == (256, 256, 16)
    assert not any(t.name.endswith(".bias") and "exp_probs_b" not in t.name
                   for t in model.tensors)
    assert model.tensor("output.weight").shape == (256, 512)


# --- dots1 (dots.llm1: qwen3's attention, a leading dense layer, sigmoid MoE with shared experts)

def test_dots1_size_and_table_without_writing(capsys):
    from engine.synth.gen import model_bytes

    sh = SHAPES["dots1"]
    # 142.8 B parameters (14.0 B active); Q4_K_M: 94.5 GB
    assert sh.mix == "q4_k_m" and f"{model_bytes(sh) / 2**30:.2f} GiB" == "87.99 GiB"
    assert main(["--list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("dots1 "))
    assert line.endswith("87.99 GiB") and "128 experts of 1408 (6 used)" in line
    table = dict(tensor_table(sh))
    assert table["blk.0.attn_q.weight"] == table["blk.0.attn_k.weight"] == (4096, 32 * 128)
    assert table["blk.0.attn_q_norm.weight"] == table["blk.0.attn_k_norm.weight"] == (128,)
    assert table["blk.0.ffn_gate.weight"] == (4096, 10944)  # the leading dense layer
    assert "blk.0.ffn_gate_inp.weight" not in table and "blk.0.exp_probs_b.bias" not in table
    assert table["blk.1.ffn_gate_inp.weight"] == (4096, 128)
    assert table["blk.61.exp_probs_b.bias"] == (128,)
    assert table["blk.61.ffn_down_exps.weight"] == (1408, 4096, 128)
    assert table["blk.1.ffn_gate_shexp.weight"] == (4096, 2 * 1408)
    assert table["blk.1.ffn_down_shexp.weight"] == (2 * 1408, 4096)
    assert "blk.62.attn_q.weight" not in table and "blk.1.ffn_gate.weight" not in table
    assert not any(n.endswith(".bias") and "exp_probs_b" not in n for n in table)
    assert table["output.weight"] == (4096, 152064)
    types = tensor_types(sh, "q4_k_m")
    # 1408-wide expert rows take llama.cpp's fallbacks (Q4_K -> Q5_0, Q6_K -> Q8_0); the
    # shared experts' 2816 fit the K types
    more = [i for i in range(1, 62) if types[f"blk.{i}.ffn_down_exps.weight"] == 8]
    assert more == [i for i in range(1, 62) if types[f"blk.{i}.ffn_down_shexp.weight"] == 14]
    assert {types[f"blk.{i}.ffn_down_exps.weight"] for i in range(1, 62)} == {6, 8}
    assert types["blk.5.attn_q_norm.weight"] == types["blk.5.exp_probs_b.bias"] == 0
    assert types["blk.5.ffn_gate_inp.weight"] == 0 and types["blk.5.ffn_up_exps.weight"] == 12


def test_dots1_tiny_reads_back(tmp_path, capsys):
    model = _gen_read_back(tmp_path, capsys, "dots1-tiny")
    md = model.metadata
    a = "dots1."
    assert model.arch == "dots1"
    assert (md[a + "block_count"], md[a + "context_length"], md[a + "embedding_length"]) == (
        4, 2048, 256)
    assert (md[a + "feed_forward_length"], md[a + "expert_feed_forward_length"]) == (512, 256)
    assert (md[a + "attention.head_count"], md[a + "attention.head_count_kv"]) == (4, 2)
    assert (md[a + "attention.key_length"], md[a + "attention.value_length"]) == (64, 64)
    assert md[a + "rope.freq_base"] == 1e4 and a + "rope.dimension_count" not in md
    assert md[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert (md[a + "expert_count"], md[a + "expert_used_count"]) == (16, 2)
    assert (md[a + "expert_shared_count"], md[a + "leading_dense_block_count"]) == (1, 1)
    assert md[a + "expert_gating_func"] == 2 and md[a + "expert_weights_norm"] is True
    assert md[a + "expert_weights_scale"] == 2.5 and md[a + "vocab_size"] == 512
    assert md["tokenizer.ggml.pre"] == "qwen2"  # as the real files
    for i in range(4):  # per-head q/k norms everywhere; layer 0 dense, the rest MoE
        assert model.tensor(f"blk.{i}.attn_q_norm.weight").shape == (64,)
        assert model.tensor(f"blk.{i}.attn_k_norm.weight").shape == (64,)
    assert model.tensor("blk.0.ffn_down.weight").shape == (512, 256)
    for i in range(1, 4):
        bias = model.tensor(f"blk.{i}.exp_probs_b.bias")
        assert bias.shape == (16,) and bias.ggml_type == 0
        assert model.tensor(f"blk.{i}.ffn_gate_inp.weight").shape == (256, 16)
        assert model.tensor(f"blk.{i}.ffn_gate_exps.weight").shape == (256, 256, 16)
        assert model.tensor(f"blk.{i}.ffn_up_shexp.weight").shape == (256, 256)
    assert model.tensor("output.weight").shape == (256, 512)


# --- ernie4_5-moe (ERNIE-4.5 MoE: a leading dense layer, softmax MoE with a selection bias and
# shared experts)

def test_ernie45_size_and_table_without_writing(capsys):
    from engine.synth.gen import model_bytes

    sh = SHAPES["ernie4.5-21b-a3b"]
    # 21.8 B parameters; Q4_K_M: 13.24 GB (the published files: about 13.3 GB)
    assert sh.mix == "q4_k_m" and f"{model_bytes(sh) / 2**30:.2f} GiB" == "12.33 GiB"
    assert main(["--list"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines()
                if x.startswith("ernie4.5-21b-a3b "))
    assert line.endswith("12.33 GiB") and "64 experts of 1536 (6 used)" in line
    table = dict(tensor_table(sh))
    assert table["blk.0.attn_q.weight"] == (2560, 20 * 128)
    assert table["blk.0.attn_k.weight"] == table["blk.0.attn_v.weight"] == (2560, 4 * 128)
    assert table["blk.0.ffn_gate.weight"] == (2560, 12288)  # the leading dense layer
    assert "blk.0.ffn_gate_inp.weight" not in table and "blk.0.exp_probs_b.bias" not in table
    assert table["blk.1.ffn_gate_inp.weight"] == (2560, 64)
    assert table["blk.27.exp_probs_b.bias"] == (64,)
    assert table["blk.27.ffn_down_exps.weight"] == (1536, 2560, 64)
    assert table["blk.1.ffn_gate_shexp.weight"] == (2560, 2 * 1536)
    assert table["blk.1.ffn_down_shexp.weight"] == (2 * 1536, 2560)
    assert "blk.28.attn_q.weight" not in table and "blk.1.ffn_gate.weight" not in table
    assert "blk.0.attn_q_norm.weight" not in table  # no q/k norms
    assert not any(n.endswith(".bias") and "exp_probs_b" not in n for n in table)
    assert "output.weight" not in table  # tied embeddings
    # the converter's shared width, intermediate_size // num_key_value_heads, is n_ff_exp * 2
    assert sh.n_ff // sh.n_head_kv == sh.n_ff_exp * sh.n_expert_shared
    types = tensor_types(sh, "q4_k_m")
    assert types["token_embd.weight"] == 14  # Q6_K: it is the output matrix too
    assert {types[f"blk.{i}.ffn_down_exps.weight"] for i in range(1, 28)} == {12, 14}
    assert types["blk.5.exp_probs_b.bias"] == types["blk.5.ffn_gate_inp.weight"] == 0
    assert types["blk.5.ffn_up_exps.weight"] == 12


def test_ernie45_tiny_reads_back(tmp_path, capsys):
    sh = SHAPES["ernie4.5-tiny"]
    model = _gen_read_back(tmp_path, capsys, "ernie4.5-tiny")
    md = model.metadata
    a = "ernie4_5-moe."
    assert model.arch == "ernie4_5-moe"
    assert (md[a + "block_count"], md[a + "context_length"], md[a + "embedding_length"]) == (
        4, 2048, 256)
    assert (md[a + "feed_forward_length"], md[a + "expert_feed_forward_length"]) == (512, 256)
    assert (md[a + "attention.head_count"], md[a + "attention.head_count_kv"]) == (4, 2)
    assert (md[a + "attention.key_length"], md[a + "attention.value_length"]) == (64, 64)
    assert md[a + "rope.freq_base"] == 1e4 and a + "rope.dimension_count" not in md
    assert md[a + "attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert (md[a + "expert_count"], md[a + "expert_used_count"]) == (16, 2)
    assert (md[a + "expert_shared_count"], md[a + "leading_dense_block_count"]) == (1, 1)
    assert md[a + "interleave_moe_layer_step"] == 1
    assert md[a + "expert_shared_feed_forward_length"] == 256 == sh.n_ff // sh.n_head_kv
    for k in ("expert_gating_func", "expert_weights_norm", "expert_weights_scale"):
        assert a + k not in md  # softmax, normalised, no scale: llama.cpp's defaults for it
    assert md["tokenizer.ggml.pre"] == "llama-bpe"
    assert not any("q_norm" in t.name or "k_norm" in t.name for t in model.tensors)
    assert model.tensor("blk.0.ffn_down.weight").shape == (512, 256)
    for i in range(1, 4):
        bias = model.tensor(f"blk.{i}.exp_probs_b.bias")
        assert bias.shape == (16,) and bias.ggml_type == 0
        assert model.tensor(f"blk.{i}.ffn_gate_inp.weight").shape == (256, 16)
        assert model.tensor(f"blk.{i}.ffn_gate_exps.weight").shape == (256, 256, 16)
        assert model.tensor(f"blk.{i}.ffn_up_shexp.weight").shape == (256, 256)
    assert model.tensor("output.weight").shape == (256, 512)

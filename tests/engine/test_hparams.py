"""HParams against transformers' own GGUF config reading, and against the real models' configs."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.gguf.writer import F32, F64, I32, STR, U32, U64
from engine.synth.gen import SHAPES, write_model
from spec.errors import CarveError


def _hf_config(path) -> dict:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_gguf_checkpoint(str(path), return_tensors=False)["config"]


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_matches_transformers_gguf_config(synth_model, arch):
    path = synth_model(arch)
    hp = HParams.from_model(GGUFModel.open(path))
    cfg = _hf_config(path)
    assert hp.arch == arch
    assert hp.n_layer == cfg["num_hidden_layers"]
    assert hp.n_embd == cfg["hidden_size"]
    assert hp.n_ff == cfg["intermediate_size"]
    assert hp.n_head == cfg["num_attention_heads"]
    assert hp.n_head_kv == cfg["num_key_value_heads"]
    assert hp.n_ctx_train == cfg["max_position_embeddings"]
    assert hp.n_vocab == cfg["vocab_size"]
    assert hp.rope_base == cfg["rope_theta"]
    assert hp.rms_eps == cfg["rms_norm_eps"]
    assert hp.tied_embeddings == cfg["tie_word_embeddings"]
    # transformers leaves head_dim out when the file does not say; then it is n_embd / n_head.
    # Its qwen3 mapping drops attention.key_length, which llama.cpp reads (see test_styles_per_arch)
    if arch != "qwen3":
        assert hp.head_dim == cfg.get("head_dim", hp.n_embd // hp.n_head)
    assert hp.sliding_window == cfg.get("sliding_window", 0)


def test_gemma3_layers_match_transformers(synth_model):
    from transformers import Gemma3TextConfig

    path = synth_model("gemma3")
    hp = HParams.from_model(GGUFModel.open(path))
    cfg = _hf_config(path)
    hf = Gemma3TextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "rope_theta")})
    assert hp.swa_layers == tuple(t == "sliding_attention" for t in hf.layer_types)
    assert hp.rope_base_swa == hf.rope_parameters["sliding_attention"]["rope_theta"]
    assert hp.sliding_window == hf.sliding_window == 64
    assert hp.rope_style == "neox" and hp.act == "gelu" and hp.qk_norm and hp.sandwich_norm
    assert hp.embed_scale == math.sqrt(256) and hp.attn_scale == 128**-0.5
    assert [hp.kv_cells(i, 1000) for i in range(6)] == [64] * 5 + [1000]
    assert hp.kv_cells(0, 10) == 10


def test_styles_per_arch(synth_model):
    llama = HParams.from_model(GGUFModel.open(synth_model("llama")))
    qwen2 = HParams.from_model(GGUFModel.open(synth_model("qwen2")))
    qwen3 = HParams.from_model(GGUFModel.open(synth_model("qwen3")))
    assert llama.rope_style == "normal" and qwen2.rope_style == qwen3.rope_style == "neox"
    assert not llama.qk_norm and not qwen2.qk_norm and qwen3.qk_norm
    assert qwen3.head_dim == 128 and qwen3.attn_scale == 128**-0.5
    assert llama.act == qwen2.act == "silu" and llama.embed_scale == 1.0
    assert llama.swa_layers == (False,) * 4 and llama.kv_cells(3, 4096) == 4096
    assert qwen2.tied_embeddings and not llama.tied_embeddings
    assert not any(h.sandwich_norm for h in (llama, qwen2, qwen3))


def test_demo_model(demo_model_path):
    # Qwen2.5-Coder-0.5B-Instruct config.json; this file carries its own output.weight
    hp = HParams.from_model(GGUFModel.open(demo_model_path))
    assert (hp.arch, hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim) == \
        ("qwen2", 24, 896, 14, 2, 64)
    assert (hp.n_ff, hp.n_vocab, hp.n_ctx_train, hp.rope_base) == (4864, 151936, 32768, 1e6)
    assert hp.rope_style == "neox" and hp.sliding_window == 0 and not hp.tied_embeddings
    assert hp.rms_eps == pytest.approx(1e-6)


def test_gemma_model(gemma_model_path):
    # google/gemma-3-270m config.json: query_pre_attn_scalar 256, sliding_window 512,
    # layer_types five sliding then one full, rope_local_base_freq 10000
    hp = HParams.from_model(GGUFModel.open(gemma_model_path))
    assert (hp.n_layer, hp.n_embd, hp.n_head, hp.n_head_kv, hp.head_dim, hp.n_ff) == \
        (18, 640, 4, 1, 256, 2048)
    assert hp.n_vocab == 262144 and hp.tied_embeddings and hp.sliding_window == 512
    assert [i for i, s in enumerate(hp.swa_layers) if not s] == [5, 11, 17]
    assert hp.attn_scale == 256**-0.5 and hp.rope_base_swa == 10000 and hp.rope_base == 1e6
    assert hp.embed_scale == pytest.approx(math.sqrt(640))


def _edited(tmp_path, shape, edit):
    return GGUFModel.open(write_model(tmp_path / "m.gguf", shape, "q8_0", edit=edit)[0])


def _set(key, vtype, value):
    def edit(meta):
        return [kv for kv in meta if kv[0] != key] + [(key, vtype, value)]
    return edit


def test_rope_scaling_and_attention_scale(tmp_path):
    m = _edited(tmp_path, "llama-tiny", lambda meta: _set("llama.rope.scaling.type", STR,
                "linear")(meta) + [("llama.rope.scaling.factor", F32, 4.0)])
    hp = HParams.from_model(m)
    assert hp.rope_scaling == "linear" and hp.rope_scale == 4.0
    m = _edited(tmp_path, "gemma3-tiny", _set("gemma3.attention.query_pre_attn_scalar", F32, 64.0))
    assert HParams.from_model(m).attn_scale == 64**-0.5
    m = _edited(tmp_path, "gemma3-tiny", _set("gemma3.attention.sliding_window_pattern", U32, 2))
    assert HParams.from_model(m).swa_layers == (True, False) * 3


def test_gemma3_27b_attention_scale(tmp_path):
    # 62 layers is Gemma 3 27B, whose query_pre_attn_scalar is n_embd / n_head, not head_dim
    shape = dataclasses.replace(SHAPES["gemma3-tiny"], n_layer=62)
    hp = HParams.from_model(GGUFModel.open(write_model(tmp_path / "g.gguf", shape, "q8_0")[0]))
    assert hp.attn_scale == (256 / 2) ** -0.5 and hp.swa_layers.count(False) == 10


def test_mistral_style_head_dim(tmp_path):
    # Mistral-NeMo-like: llama arch whose head_dim is not n_embd / n_head (key_length given)
    shape = dataclasses.replace(SHAPES["llama-tiny"], n_layer=2, head_dim=128)
    hp = HParams.from_model(GGUFModel.open(write_model(tmp_path / "m.gguf", shape, "q8_0")[0]))
    assert (hp.head_dim, hp.head_dim_v, hp.n_head, hp.n_embd) == (128, 128, 4, 256)
    assert hp.attn_scale == 128**-0.5 and hp.rope_style == "normal"


@pytest.mark.parametrize(("edit", "message"), [
    (_set("general.architecture", STR, "mamba"), "unsupported architecture 'mamba'"),
    (lambda meta: [kv for kv in meta if kv[0] != "llama.block_count"],
     "llama.block_count is missing"),
    (_set("llama.attention.head_count_kv", U32, 3), "impossible shape"),
    (_set("llama.embedding_length", STR, "big"), "llama.embedding_length is 'big'"),
    (_set("llama.attention.head_count_kv", U32, 1),
     r"attn_k.weight has shape \[256, 128\] but the metadata implies \[256, 64\]"),
    (_set("llama.block_count", U32, 5),
     "llama.block_count is 5 but the file holds tensors of 4 layers"),
    # a count no file can hold is refused before anything is sized per layer
    (_set("llama.block_count", U32, 2**32 - 1), "block_count is 4294967295 but the file holds"),
    (_set("llama.block_count", U64, 2**60), f"block_count is {2**60} but the file holds"),
    (_set("llama.feed_forward_length", U32, 1024), "ffn_up.weight has shape"),
    # numbers the engine computes with: finite and in their domain, or one sentence
    (_set("llama.rope.freq_base", F32, math.nan), r"llama.rope.freq_base is nan; it must be"),
    (_set("llama.rope.freq_base", F32, 0.0), r"llama.rope.freq_base is 0.0; it must be a "
     "number above 1"),
    (_set("llama.attention.layer_norm_rms_epsilon", F32, math.inf), "epsilon is inf"),
    (_set("llama.attention.layer_norm_rms_epsilon", F32, -1.0), "epsilon is -1.0"),
    (_set("llama.context_length", I32, -1), "llama.context_length is -1; it must be a token"),
    (_set("llama.attention.sliding_window", I32, -1), "sliding_window is -1"),
    (_set("llama.attention.scale", F32, 0.0), "llama.attention.scale is 0.0"),
    (_set("llama.attention.scale", F64, 1e300), "llama.attention.scale is 1e[+]300"),  # inf in f32
    (_set("llama.attention.query_pre_attn_scalar", F32, math.nan), "query_pre_attn_scalar is nan"),
    (_set("llama.rope.scaling.factor", F32, -2.0), "llama.rope.scaling.factor is -2.0"),
])
def test_bad_models(tmp_path, edit, message):
    m = _edited(tmp_path, "llama-tiny", edit)
    with pytest.raises(CarveError, match=message) as err:
        HParams.from_model(m)
    assert str(m.paths[0]) in str(err.value)


@pytest.mark.parametrize(("shape", "key", "value", "message"), [
    ("gpt-oss-tiny", "gpt-oss.rope.scaling.yarn_beta_fast", 0.0, "yarn_beta_fast is 0.0"),
    ("gpt-oss-tiny", "gpt-oss.rope.scaling.yarn_beta_slow", math.inf, "yarn_beta_slow is inf"),
    ("glm4moe-tiny", "glm4moe.expert_weights_scale", math.nan, "expert_weights_scale is nan"),
    ("qwen3moe-tiny", "qwen3moe.expert_feed_forward_length", -1,
     "qwen3moe.expert_feed_forward_length is -1; it must be a width above 0"),
])
def test_bad_numbers_of_the_moe_families(tmp_path, shape, key, value, message):
    """The YaRN and routing numbers once loaded and then failed in the RoPE tables (math
    domain error, division by zero) or gave NaN weights."""
    kind = F32 if isinstance(value, float) else I32
    m = _edited(tmp_path, shape, _set(key, kind, value))
    with pytest.raises(CarveError, match=message) as err:
        HParams.from_model(m)
    assert str(err.value).startswith(str(m.paths[0]))


def _written(path, meta, table, types) -> GGUFModel:
    """A GGUF of ``table`` (name, dims) with random bytes for data (only headers are read)."""
    import numpy as np

    from engine.gguf.writer import GGUFSink

    rng = np.random.default_rng(0)
    GGUFSink(meta, [(n, d, types[n]) for n, d in table], [path]).write(
        lambda n, t, nbytes: [rng.integers(0, 255, nbytes, dtype=np.uint8).tobytes()])
    return GGUFModel.open(path)


@pytest.mark.parametrize(("shape", "name"), [
    ("llama-tiny", "blk.2.ffn_down.weight"),
    ("llama-tiny", "blk.3.attn_k.weight"),
    ("qwen3moe-tiny", "blk.1.ffn_down_exps.weight"),
    ("qwen3moe-tiny", "blk.2.attn_v.weight"),
    ("llama-tiny", "output.weight"),
])
def test_a_later_layers_transposed_matrix_is_refused_at_open(tmp_path, shape, name):
    """Only layer 0's matrices were checked against the metadata: a later layer's tensor with
    its dimensions swapped (same bytes) planned, loaded, then failed mid-reply in a matmul."""
    from engine.synth.gen import metadata, tensor_table, tensor_types

    def swap(d):  # a matrix's two dims; an expert tensor's width and expert count
        return (d[1], d[0]) if len(d) == 2 else (d[0], d[2], d[1])

    sh = SHAPES[shape]
    table = [(n, swap(d) if n == name else d) for n, d in tensor_table(sh)]
    assert any(n == name for n, _ in table)
    says = rf"tensor {name} (has shape \[.*\] but|holds \d+ experts but) .*inconsistent"
    with pytest.raises(CarveError, match=says):
        HParams.from_model(_written(tmp_path / "swapped.gguf", metadata(sh, "q8_0"), table,
                                    tensor_types(sh, "q8_0")))


def test_a_glm_file_without_its_next_token_layer_opens(tmp_path):
    """block_count counts GLM's next-token-prediction layer, which is never run: a file that
    leaves that layer's tensors out is not short of layers."""
    from engine.synth.gen import metadata, tensor_table, tensor_types

    sh = SHAPES["glm4moe-tiny"]
    meta = metadata(sh, "q8_0")
    n_layer = next(v for k, _, v in meta if k == "glm4moe.block_count")
    types = tensor_types(sh, "q8_0")
    kept = [(n, d) for n, d in tensor_table(sh) if not n.startswith(f"blk.{n_layer - 1}.")]
    hp = HParams.from_model(_written(tmp_path / "no-nextn.gguf", meta, kept, types))
    assert (hp.n_layer, hp.n_layer_run) == (n_layer, n_layer - 1)
    # without the nextn key the same file is short of a layer
    short = [kv for kv in meta if kv[0] != "glm4moe.nextn_predict_layers"]
    with pytest.raises(CarveError, match=f"block_count is {n_layer} but the file holds tensors "
                                         f"of {n_layer - 1} layers"):
        HParams.from_model(_written(tmp_path / "short.gguf", short, kept, types))

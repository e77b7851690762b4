"""`carve gen`'s llama.cpp low-bit file types (engine/synth/file_types.py): sizes against
published files, llama_tensor_get_type's rules on dense and MoE shapes, and the two mixes of the
issue's large files, written as well-formed blocks."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from engine.gguf.reader import GGUFModel
from engine.gguf.writer import tensor_bytes
from engine.synth.contents import tensor_table
from engine.synth.file_types import FILE_TYPES
from engine.synth.gen import SHAPES, tensor_types
from spec import quant_types as qt
from spec.errors import CarveError

GB = 1e9


def _size(shape: str, mix: str) -> float:
    types = tensor_types(SHAPES[shape], mix)
    return sum(tensor_bytes(types[n], d) for n, d in tensor_table(SHAPES[shape])) / GB


# Qwen2.5-7B-Instruct as llama-quantize wrote it with an importance matrix (a widely used
# published set), GB as listed; the files add ~5 MB of tokenizer metadata to the tensors
@pytest.mark.parametrize(("mix", "published"), [
    ("q2_k", 3.02), ("q3_k_m", 3.81), ("iq2_m", 2.78), ("iq3_xxs", 3.11), ("iq3_m", 3.57),
    ("iq4_xs", 4.22),
])
def test_7b_sizes_are_the_published_files(mix, published):
    assert _size("qwen2-7b", mix) == pytest.approx(published, rel=0.01)


def test_iq2_xxs_rules_on_the_7b_shape():
    t = tensor_types(SHAPES["qwen2-7b"], "iq2_xxs")  # 28 layers, 28/4 heads: GQA 7
    assert t["output.weight"] == qt.Q5_K and t["token_embd.weight"] == qt.Q2_K
    assert {t[f"blk.{i}.attn_v.weight"] for i in range(28)} == {qt.Q4_K}  # GQA >= 4
    downs = [t[f"blk.{i}.ffn_down.weight"] for i in range(28)]
    assert downs == [qt.Q2_K] * 3 + [qt.IQ2_XXS] * 25  # the first eighth
    assert t["blk.5.attn_q.weight"] == t["blk.5.ffn_up.weight"] == qt.IQ2_XXS


def test_q3_k_m_and_iq3_rules_on_the_7b_shape():
    sh = SHAPES["qwen2-7b"]
    t = tensor_types(sh, "q3_k_m")
    assert [t[f"blk.{i}.attn_v.weight"] for i in range(3)] == [qt.Q5_K, qt.Q5_K, qt.Q4_K]
    assert [t[f"blk.{i}.ffn_down.weight"] for i in range(3)] == [qt.Q5_K, qt.Q4_K, qt.Q4_K]
    assert t["blk.4.attn_output.weight"] == qt.Q4_K and t["blk.4.ffn_gate.weight"] == qt.Q3_K
    t = tensor_types(sh, "iq3_xxs")
    assert t["blk.1.attn_q.weight"] == t["blk.1.attn_k.weight"] == qt.IQ2_S
    assert t["blk.1.attn_output.weight"] == qt.IQ3_S and t["output.weight"] == qt.Q5_K
    t = tensor_types(sh, "iq3_m")
    assert t["blk.2.ffn_down.weight"] == qt.Q4_K and t["blk.3.ffn_down.weight"] == qt.IQ3_S
    assert t["blk.9.attn_v.weight"] == t["blk.9.attn_output.weight"] == qt.Q4_K


def test_file_types_on_a_moe_shape():
    sh = SHAPES["qwen3moe-30b-a3b"]  # 128 experts, 48 layers, 32/4 heads
    t = tensor_types(sh, "iq2_xxs")
    assert t["blk.0.ffn_down_exps.weight"] == qt.Q2_K  # llama.cpp's counter: the first eighth
    assert t["blk.6.ffn_down_exps.weight"] == qt.IQ2_XXS
    assert t["blk.0.attn_v.weight"] == qt.Q4_K and t["blk.0.ffn_gate_inp.weight"] == qt.F32
    t = tensor_types(sh, "iq3_m")
    assert t["blk.5.ffn_down_exps.weight"] == qt.Q4_K and t["blk.6.ffn_down_exps.weight"] == (
        qt.IQ3_S)


def test_the_issue_mixes():
    sh = SHAPES["glm4.5-air"]  # shared experts, a leading dense layer
    t = tensor_types(sh, "iq2_xxs-q8attn")
    moe = sh.n_layer_dense_lead
    assert t["output.weight"] == t["blk.3.attn_q.weight"] == t["blk.3.attn_output.weight"] == (
        qt.Q8_0)
    assert t[f"blk.{moe}.ffn_up_shexp.weight"] == t[f"blk.{moe}.ffn_down_shexp.weight"] == qt.Q8_0
    assert t[f"blk.{moe}.ffn_gate_exps.weight"] == t["blk.0.ffn_up.weight"] == qt.IQ2_XXS
    # its down-projections' rows (10944, 1408 values) are no whole 256-blocks: llama.cpp's
    # fallback, IQ4_NL
    assert t["blk.0.ffn_down.weight"] == t[f"blk.{moe}.ffn_down_exps.weight"] == qt.IQ4_NL
    t = tensor_types(SHAPES["qwen3moe-30b-a3b"], "iq2_xxs-q8attn")
    assert {t[f"blk.{i}.ffn_down_exps.weight"] for i in range(48)} == {qt.Q2_K}
    t = tensor_types(SHAPES["qwen2-7b"], "iq3_s-bumped")
    assert t["output.weight"] == qt.Q6_K
    # llama.cpp's "more bits" layers of 28: 0-2, 5, 8, 11, 14, 17, 20, 23, 24-27
    bumped = {i for i in range(28) if t[f"blk.{i}.ffn_up.weight"] == qt.IQ4_XS}
    assert bumped == {0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 24, 25, 26, 27}
    assert all(t[f"blk.{i}.attn_q.weight"] == (qt.IQ4_XS if i in bumped else qt.IQ3_S)
               for i in range(28))


def test_pure_names_one_type_and_a_bad_mix_lists_the_file_types():
    t = tensor_types(SHAPES["qwen2-7b"], "pure-iq2_xxs")
    assert {v for v in t.values() if v != qt.F32} == {qt.IQ2_XXS}
    with pytest.raises(CarveError, match="iq2_xxs-q8attn"):
        tensor_types(SHAPES["qwen2-7b"], "iq2_xxx")


@pytest.mark.parametrize(("arch", "mix"), [("qwen2", "iq2_xxs-q8attn"), ("llama", "iq3_s-bumped"),
                                           ("glm4moe-tiny", "iq2_xxs-q8attn")])
def test_the_mixes_write_well_formed_blocks(synth_model, arch, mix):
    model = GGUFModel.open(synth_model(arch, mix))
    seen = set()
    for t in model.tensors:
        if len(t.shape) < 2 or t.ggml_type == qt.F32:
            continue
        seen.add(t.ggml_type)
        w = dequantize(model.tensor_data(t), GGMLQuantizationType(t.ggml_type))
        assert np.isfinite(w).all(), t.name
        rms = float(np.sqrt(np.mean(np.square(w, dtype=np.float64))))
        assert 0.002 < rms < 0.2, (t.name, rms)
    assert len(seen) >= 3 and FILE_TYPES[mix] in seen

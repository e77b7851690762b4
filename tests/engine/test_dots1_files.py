"""The tiny random dots.llm1 of moe_files: the transformers model routes as llama.cpp's dots1 graph
does (sigmoid scores, the selection bias only for the choice, the plain scores of the chosen
normalised and scaled, shared experts added), and its GGUF (float32 and Q8_0) holds llama.cpp's
converter's keys, tensor names, shapes and types, with the model's weights (no q/k row
permutation)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_files import N_VOCAB, file_array, hf_model, read_converter_file, write_pair  # noqa: E402

A = "dots1"
KEYS = {"block_count": 3, "context_length": 4096, "embedding_length": 64,
        "feed_forward_length": 96, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 32, "attention.value_length": 32, "rope.freq_base": 10000.0,
        "expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 32,
        "leading_dense_block_count": 1, "expert_shared_count": 1, "expert_weights_scale": 2.5,
        "expert_weights_norm": True, "expert_gating_func": 2, "vocab_size": N_VOCAB}
# GGUF name -> shape in torch order ([rows, cols], experts [E, rows, cols])
ATTN = {"attn_norm.weight": (64,), "attn_q.weight": (128, 64), "attn_k.weight": (64, 64),
        "attn_v.weight": (64, 64), "attn_q_norm.weight": (32,), "attn_k_norm.weight": (32,),
        "attn_output.weight": (64, 128), "ffn_norm.weight": (64,)}
DENSE = {"ffn_gate.weight": (96, 64), "ffn_up.weight": (96, 64), "ffn_down.weight": (64, 96)}
MOE = {"ffn_gate_inp.weight": (8, 64), "exp_probs_b.bias": (8,),
       "ffn_gate_exps.weight": (8, 32, 64), "ffn_up_exps.weight": (8, 32, 64),
       "ffn_down_exps.weight": (8, 64, 32), "ffn_gate_shexp.weight": (32, 64),
       "ffn_up_shexp.weight": (32, 64), "ffn_down_shexp.weight": (64, 32)}
GLOBAL = {"token_embd.weight": (N_VOCAB, 64), "output_norm.weight": (64,),
          "output.weight": (N_VOCAB, 64)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("dots1")
    return {q: write_pair(A, q, d / f"{A}-{q}.gguf") for q in ("f32", "q8_0")}


def test_hf_model_routes_as_llama_cpp() -> None:
    m = hf_model(A)
    assert [type(x.mlp).__name__ for x in m.model.layers] == ["Dots1MLP", "Dots1MoE", "Dots1MoE"]
    assert all(t == "full_attention" for t in m.config.layer_types)
    gate = m.model.layers[1].mlp.gate
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 64, generator=g)
    with torch.no_grad():
        _, w, idx = gate(x)
        # llama.cpp: sigmoid(router), + exp_probs_b for the choice, weights the plain sigmoid
        # of the chosen, normalised (expert_weights_norm) and times expert_weights_scale
        p = torch.sigmoid(x @ gate.weight.T)
    want = torch.topk(p + gate.e_score_correction_bias, 2, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
    chosen = p.gather(1, idx)
    torch.testing.assert_close(w, 2.5 * chosen / chosen.sum(-1, keepdim=True))
    # the selection bias changes choices (its random values are of order 0.1)
    assert not torch.equal(torch.topk(p, 2, dim=-1).indices.sort(-1).values,
                           want.sort(-1).values)
    ids = torch.randint(3, 500, (1, 24), generator=g)
    with torch.inference_mode():
        ref = m(ids).logits
        assert ref.shape == (1, 24, N_VOCAB) and torch.isfinite(ref).all()
        m.model.layers[2].mlp.shared_experts.down_proj.weight.zero_()  # shared experts count
        assert (m(ids).logits - ref).abs().max() > 1e-3


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_file_keys_names_shapes_and_weights(files, quant: str) -> None:
    m, path = files[quant]
    want = dict(GLOBAL)
    for i in range(3):
        want |= {f"blk.{i}.{n}": s for n, s in (ATTN | (DENSE if i == 0 else MOE)).items()}
    fields, tensors = read_converter_file(path, A, KEYS, want, quant)
    assert f"{A}.rope.dimension_count" not in fields  # RoPE on whole heads
    assert fields["tokenizer.ggml.pre"].contents() == "qwen2"
    # the transformers model holds what the file holds (Q8_0: the dequantized weights)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    h = "model.layers.1."
    gu = sd[h + "mlp.experts.gate_up_proj"]  # [E, 2 n_ff, n_embd]: gate rows, then up
    pairs = {"attn_q.weight": sd[h + "self_attn.q_proj.weight"],  # not permuted
             "attn_k.weight": sd[h + "self_attn.k_proj.weight"],
             "attn_q_norm.weight": sd[h + "self_attn.q_norm.weight"],
             "attn_k_norm.weight": sd[h + "self_attn.k_norm.weight"],
             "ffn_norm.weight": sd[h + "post_attention_layernorm.weight"],
             "ffn_gate_inp.weight": sd[h + "mlp.gate.weight"],
             "exp_probs_b.bias": sd[h + "mlp.gate.e_score_correction_bias"],
             "ffn_gate_exps.weight": gu[:, :32], "ffn_up_exps.weight": gu[:, 32:],
             "ffn_down_exps.weight": sd[h + "mlp.experts.down_proj"],
             "ffn_gate_shexp.weight": sd[h + "mlp.shared_experts.gate_proj.weight"],
             "ffn_down_shexp.weight": sd[h + "mlp.shared_experts.down_proj.weight"]}
    for n, a in pairs.items():
        np.testing.assert_array_equal(file_array(tensors["blk.1." + n]), a, err_msg=n)
    np.testing.assert_array_equal(file_array(tensors["blk.0.ffn_up.weight"]),
                                  sd["model.layers.0.mlp.up_proj.weight"])
    bias = sd[h + "mlp.gate.e_score_correction_bias"]
    assert 0.02 < np.abs(bias).mean() < 0.3  # of order 0.1: the selection bias matters

"""The tiny random MiniMax-M2 of moe_files: the transformers model really rotates only rotary_dim
(16) of each head's 32 dims, and its GGUF (float32 and Q8_0) holds llama.cpp's converter's keys,
tensor names, shapes and types, with the model's weights (no q/k row permutation)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from moe_files import N_VOCAB, file_array, hf_model, read_converter_file, write_pair  # noqa: E402

A = "minimax-m2"
KEYS = {"block_count": 2, "context_length": 4096, "embedding_length": 64,
        "feed_forward_length": 32, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 32, "attention.value_length": 32, "rope.freq_base": 10000.0,
        "rope.dimension_count": 16, "expert_count": 8, "expert_used_count": 2,
        "expert_feed_forward_length": 32, "expert_gating_func": 2, "vocab_size": N_VOCAB}
# GGUF name -> shape in torch order ([rows, cols], experts [E, rows, cols])
LAYER = {"attn_norm.weight": (64,), "attn_q.weight": (128, 64), "attn_k.weight": (64, 64),
         "attn_v.weight": (64, 64), "attn_q_norm.weight": (128,), "attn_k_norm.weight": (64,),
         "attn_output.weight": (64, 128), "ffn_norm.weight": (64,), "ffn_gate_inp.weight": (8, 64),
         "exp_probs_b.bias": (8,), "ffn_gate_exps.weight": (8, 32, 64),
         "ffn_up_exps.weight": (8, 32, 64), "ffn_down_exps.weight": (8, 64, 32)}
GLOBAL = {"token_embd.weight": (N_VOCAB, 64), "output_norm.weight": (64,),
          "output.weight": (N_VOCAB, 64)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("minimax")
    return {q: write_pair(A, q, d / f"{A}-{q}.gguf") for q in ("f32", "q8_0")}


def test_hf_model_rotates_16_of_32_dims() -> None:
    from transformers.models.minimax_m2.modeling_minimax_m2 import apply_rotary_pos_emb

    m = hf_model(A)
    assert m.config.rope_parameters["partial_rotary_factor"] == 0.5
    rot = m.model.rotary_emb
    torch.testing.assert_close(rot.inv_freq, 1e4 ** -(torch.arange(0, 16, 2).float() / 16))
    cos, sin = rot(torch.zeros(1, 8, 64), torch.arange(8)[None])
    assert cos.shape[-1] == 16
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 8, 32, generator=g), torch.randn(1, 2, 8, 32, generator=g)
    qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
    assert torch.equal(qr[..., 16:], q[..., 16:]) and torch.equal(kr[..., 16:], k[..., 16:])
    assert (qr[..., 1:, :16] - q[..., 1:, :16]).abs().amin(-1).gt(0).all()  # rotated past pos 0
    # the model runs the narrow rotation: widening it to all 32 dims moves the logits
    ids = torch.randint(3, 500, (1, 24), generator=g)
    with torch.inference_mode():
        ref = m(ids).logits
        assert torch.isfinite(ref).all()
        rot.inv_freq = 1e4 ** -(torch.arange(0, 32, 2).float() / 32)
        assert (m(ids).logits - ref).abs().max() > 0.1


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_file_keys_names_shapes_and_weights(files, quant: str) -> None:
    m, path = files[quant]
    want = dict(GLOBAL)
    for i in range(2):
        want |= {f"blk.{i}.{n}": s for n, s in LAYER.items()}
    fields, tensors = read_converter_file(path, A, KEYS, want, quant)
    assert fields["tokenizer.ggml.model"].contents() == "gpt2"
    # the transformers model holds what the file holds (Q8_0: the dequantized weights)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    h = "model.layers.1."
    gu = sd[h + "mlp.experts.gate_up_proj"]  # [E, 2 n_ff, n_embd]: gate (w1) rows, then up (w3)
    pairs = {"attn_q.weight": sd[h + "self_attn.q_proj.weight"],  # not permuted
             "attn_k.weight": sd[h + "self_attn.k_proj.weight"],
             "attn_q_norm.weight": sd[h + "self_attn.q_norm.weight"],
             "attn_k_norm.weight": sd[h + "self_attn.k_norm.weight"],
             "ffn_norm.weight": sd[h + "post_attention_layernorm.weight"],
             "ffn_gate_inp.weight": sd[h + "mlp.gate.weight"],
             "exp_probs_b.bias": sd[h + "mlp.e_score_correction_bias"],
             "ffn_gate_exps.weight": gu[:, :32], "ffn_up_exps.weight": gu[:, 32:],
             "ffn_down_exps.weight": sd[h + "mlp.experts.down_proj"]}
    for n, a in pairs.items():
        np.testing.assert_array_equal(file_array(tensors["blk.1." + n]), a, err_msg=n)
    bias = sd[h + "mlp.e_score_correction_bias"]
    assert 0.02 < np.abs(bias).mean() < 0.3  # of order 0.1: the selection bias matters

"""The tiny random ERNIE-4.5 MoE of moe_files: the transformers model routes as llama.cpp's
ernie4_5-moe graph does (softmax over all experts, the selection bias only for the choice, the
plain softmax values of the chosen normalised, no scale, shared experts added) and rotates
adjacent pairs (llama.cpp's "normal" RoPE), and its GGUF (float32 and Q8_0) holds llama.cpp's
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

A = "ernie4_5-moe"
KEYS = {"block_count": 3, "context_length": 4096, "embedding_length": 64,
        "feed_forward_length": 96, "attention.head_count": 4, "attention.head_count_kv": 2,
        "attention.key_length": 32, "attention.value_length": 32, "rope.freq_base": 10000.0,
        "expert_count": 8, "expert_used_count": 2, "interleave_moe_layer_step": 1,
        "leading_dense_block_count": 1, "expert_feed_forward_length": 32,
        "expert_shared_count": 1, "expert_shared_feed_forward_length": 32}
# GGUF name -> shape in torch order ([rows, cols], experts [E, rows, cols])
ATTN = {"attn_norm.weight": (64,), "attn_q.weight": (128, 64), "attn_k.weight": (64, 64),
        "attn_v.weight": (64, 64), "attn_output.weight": (64, 128), "ffn_norm.weight": (64,)}
DENSE = {"ffn_gate.weight": (96, 64), "ffn_up.weight": (96, 64), "ffn_down.weight": (64, 96)}
MOE = {"ffn_gate_inp.weight": (8, 64), "exp_probs_b.bias": (8,),
       "ffn_gate_exps.weight": (8, 32, 64), "ffn_up_exps.weight": (8, 32, 64),
       "ffn_down_exps.weight": (8, 64, 32), "ffn_gate_shexp.weight": (32, 64),
       "ffn_up_shexp.weight": (32, 64), "ffn_down_shexp.weight": (64, 32)}
GLOBAL = {"token_embd.weight": (N_VOCAB, 64), "output_norm.weight": (64,),
          "output.weight": (N_VOCAB, 64)}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ernie")
    return {q: write_pair(A, q, d / f"{A}-{q}.gguf") for q in ("f32", "q8_0")}


def test_hf_model_routes_and_rotates_as_llama_cpp() -> None:
    from transformers.models.ernie4_5_moe import modeling_ernie4_5_moe as mod

    m = hf_model(A)
    assert [type(x.mlp).__name__ for x in m.model.layers] == [
        "Ernie4_5_MoeMLP", "Ernie4_5_MoeSparseMoeBlock", "Ernie4_5_MoeSparseMoeBlock"]
    gate = m.model.layers[1].mlp.gate
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    with torch.no_grad():
        _, w, idx = gate(x)
        # llama.cpp: softmax(router) over all experts, + exp_probs_b for the choice, weights the
        # plain softmax values of the chosen, normalised (no scale)
        p = torch.softmax(x @ gate.weight.T, dim=-1)
    bias = gate.moe_statics.e_score_correction_bias.reshape(-1)
    want = torch.topk(p + bias, 2, dim=-1).indices
    assert torch.equal(idx.sort(-1).values, want.sort(-1).values)
    chosen = p.gather(1, idx)
    torch.testing.assert_close(w, chosen / chosen.sum(-1, keepdim=True))
    # the selection bias changes the choice on some tokens (its values are of order 0.1)
    plain = torch.topk(p, 2, dim=-1).indices.sort(-1).values
    changed = (plain != want.sort(-1).values).any(-1).sum().item()
    assert 0 < changed < 64
    # RoPE by adjacent pairs (dims 2i, 2i+1 share frequency i): llama.cpp's "normal" rope
    q = torch.randn(1, 1, 3, 32, generator=g)
    pos = torch.arange(3)[None]
    cos, sin = m.model.rotary_emb(q, pos)
    got, _ = mod.apply_rotary_pos_emb(q, q, cos, sin)
    inv = 1.0 / 10000.0 ** (torch.arange(0, 32, 2).float() / 32)
    ang = pos[0, :, None].float() * inv  # [3, 16]
    x0, x1 = q[..., 0::2], q[..., 1::2]
    ref = torch.stack((x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()), -1)
    torch.testing.assert_close(got, ref.flatten(-2))
    ids = torch.randint(3, 500, (1, 24), generator=g)
    with torch.inference_mode():
        ref_logits = m(ids).logits
        assert ref_logits.shape == (1, 24, N_VOCAB) and torch.isfinite(ref_logits).all()
        m.model.layers[2].mlp.shared_experts.down_proj.weight.zero_()  # shared experts count
        assert (m(ids).logits - ref_logits).abs().max() > 1e-3


@pytest.mark.parametrize("quant", ["f32", "q8_0"])
def test_file_keys_names_shapes_and_weights(files, quant: str) -> None:
    m, path = files[quant]
    want = dict(GLOBAL)
    for i in range(3):
        want |= {f"blk.{i}.{n}": s for n, s in (ATTN | (DENSE if i == 0 else MOE)).items()}
    fields, tensors = read_converter_file(path, A, KEYS, want, quant)
    assert f"{A}.rope.dimension_count" not in fields  # RoPE on whole heads
    for k in ("expert_gating_func", "expert_weights_scale", "expert_weights_norm"):
        assert f"{A}.{k}" not in fields, k  # the converter writes none of them
    # the transformers model holds what the file holds (Q8_0: the dequantized weights)
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    h = "model.layers.1."
    gu = sd[h + "mlp.experts.gate_up_proj"]  # [E, 2 n_ff, n_embd]: gate rows, then up
    bias = sd[h + "mlp.gate.moe_statics.e_score_correction_bias"]
    assert bias.shape == (1, 8)
    pairs = {"attn_q.weight": sd[h + "self_attn.q_proj.weight"],  # not permuted
             "attn_k.weight": sd[h + "self_attn.k_proj.weight"],
             "attn_v.weight": sd[h + "self_attn.v_proj.weight"],
             "attn_output.weight": sd[h + "self_attn.o_proj.weight"],
             "attn_norm.weight": sd[h + "input_layernorm.weight"],
             "ffn_norm.weight": sd[h + "post_attention_layernorm.weight"],
             "ffn_gate_inp.weight": sd[h + "mlp.gate.weight"],
             "exp_probs_b.bias": bias.reshape(-1),
             "ffn_gate_exps.weight": gu[:, :32], "ffn_up_exps.weight": gu[:, 32:],
             "ffn_down_exps.weight": sd[h + "mlp.experts.down_proj"],
             "ffn_gate_shexp.weight": sd[h + "mlp.shared_experts.gate_proj.weight"],
             "ffn_up_shexp.weight": sd[h + "mlp.shared_experts.up_proj.weight"],
             "ffn_down_shexp.weight": sd[h + "mlp.shared_experts.down_proj.weight"]}
    for n, a in pairs.items():
        np.testing.assert_array_equal(file_array(tensors["blk.1." + n]), a, err_msg=n)
    np.testing.assert_array_equal(file_array(tensors["blk.0.ffn_up.weight"]),
                                  sd["model.layers.0.mlp.up_proj.weight"])
    np.testing.assert_array_equal(file_array(tensors["output.weight"]), sd["lm_head.weight"])
    assert 0.02 < np.abs(bias).mean() < 0.3  # of order 0.1: the selection bias matters


def test_an_interleave_step_other_than_one_is_refused_at_open(tmp_path) -> None:
    # llama.cpp would route every second layer; the published files route every one
    from engine.gguf.hparams import HParams
    from engine.gguf.reader import GGUFModel
    from spec.errors import CarveError

    def step_two(meta, table):
        return [(k, t, 2 if k.endswith("interleave_moe_layer_step") else v)
                for k, t, v in meta], table

    _, path = write_pair(A, "f32", tmp_path / "step2.gguf", edit=step_two)
    with pytest.raises(CarveError, match="interleave_moe_layer_step is 2") as e:
        HParams.from_model(GGUFModel.open(path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)

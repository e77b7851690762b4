"""The tiny DeepSeek files of moe_files.py ("deepseek3": DeepseekV3ForCausalLM, "deepseek2":
V2-Lite-style DeepseekV2ForCausalLM; GGUF arch deepseek2) read back with gguf's own GGUFReader:
names, shapes, types and keys as llama.cpp's converter writes them in its "mla" and "legacy"
layouts; the transformers models run with YaRN and (V3) group-limited routing really in effect;
attn_k_b / attn_v_b decompress the latent as kv_b_proj does."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFReader, GGUFValueType
from gguf.quants import dequantize

sys.path.insert(0, str(Path(__file__).parent))
from moe_files import write_pair  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ARCHS = ("deepseek3", "deepseek2")
LAYOUTS = ("mla", "legacy")
N_HEAD, KV_LORA, NOPE, ROPE, V, N_EMBD, N_EXPERT = 4, 64, 32, 16, 32, 64, 8


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    cache: dict = {}

    def get(arch: str, quant: str, layout: str):
        key = arch, quant, layout
        if key not in cache:
            path = tmp_path_factory.mktemp("ds") / f"{arch}-{layout}-{quant}.gguf"
            m, p = write_pair(arch, quant, path, layout=layout)
            cache[key] = m, GGUFReader(p)
        return cache[key]

    return get


def _keys(r: GGUFReader) -> dict:
    return {k: f.contents() for k, f in r.fields.items() if k.startswith("deepseek2.")}


def _expected_keys(arch: str, layout: str) -> dict:
    v3, mla = arch == "deepseek3", layout == "mla"
    mscale_all = 1.0 if v3 else 0.707
    want = {
        "block_count": 3, "context_length": 256, "embedding_length": 64, "feed_forward_length": 96,
        "attention.head_count": 4, "attention.head_count_kv": 1 if mla else 4,
        "attention.layer_norm_rms_epsilon": 1e-6, "rope.freq_base": 10000.0,
        "rope.dimension_count": 16, "vocab_size": 512, "attention.kv_lora_rank": 64,
        "attention.key_length": 80 if mla else 48, "attention.value_length": 64 if mla else 32,
        "leading_dense_block_count": 1, "expert_feed_forward_length": 32, "expert_count": 8,
        "expert_used_count": 2, "expert_shared_count": 1 if v3 else 2,
        "expert_weights_scale": 2.5 if v3 else 1.0, "expert_gating_func": 2 if v3 else 1,
        # V2-Lite's config.json has n_group = topk_group = 1; the converter writes them as given
        "expert_group_count": 4 if v3 else 1, "expert_group_used_count": 2 if v3 else 1,
        "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 64, "rope.scaling.yarn_beta_fast": 32.0,
        "rope.scaling.yarn_beta_slow": 1.0, "rope.scaling.yarn_log_multiplier": 0.1 * mscale_all,
    }
    if v3:
        want["attention.q_lora_rank"] = 64
        want["expert_weights_norm"] = True  # the converter writes it only when true
    if mla:
        want["attention.key_length_mla"] = 48
        want["attention.value_length_mla"] = 32
    return want


def _expected_shapes(arch: str, layout: str) -> dict[str, tuple[int, ...]]:
    """GGUF name -> the array shape GGUFReader gives (torch order: reversed ne)."""
    v3 = arch == "deepseek3"
    qk = NOPE + ROPE
    want: dict[str, tuple[int, ...]] = {"token_embd.weight": (512, N_EMBD),
                                        "output_norm.weight": (N_EMBD,),
                                        "output.weight": (512, N_EMBD)}
    for i in range(3):
        b = f"blk.{i}."
        want |= {b + "attn_norm.weight": (N_EMBD,), b + "ffn_norm.weight": (N_EMBD,),
                 b + "attn_kv_a_mqa.weight": (KV_LORA + ROPE, N_EMBD),
                 b + "attn_kv_a_norm.weight": (KV_LORA,),
                 b + "attn_output.weight": (N_EMBD, N_HEAD * V)}
        if v3:
            want |= {b + "attn_q_a.weight": (64, N_EMBD), b + "attn_q_a_norm.weight": (64,),
                     b + "attn_q_b.weight": (N_HEAD * qk, 64)}
        else:
            want[b + "attn_q.weight"] = (N_HEAD * qk, N_EMBD)
        if layout == "mla":
            want |= {b + "attn_k_b.weight": (N_HEAD, KV_LORA, NOPE),
                     b + "attn_v_b.weight": (N_HEAD, V, KV_LORA)}
        else:
            want[b + "attn_kv_b.weight"] = (N_HEAD * (NOPE + V), KV_LORA)
        if i == 0:
            want |= {b + "ffn_gate.weight": (96, N_EMBD), b + "ffn_up.weight": (96, N_EMBD),
                     b + "ffn_down.weight": (N_EMBD, 96)}
            continue
        shexp = 32 if v3 else 64
        want |= {b + "ffn_gate_inp.weight": (N_EXPERT, N_EMBD),
                 b + "ffn_gate_exps.weight": (N_EXPERT, 32, N_EMBD),
                 b + "ffn_up_exps.weight": (N_EXPERT, 32, N_EMBD),
                 b + "ffn_down_exps.weight": (N_EXPERT, N_EMBD, 32),
                 b + "ffn_gate_shexp.weight": (shexp, N_EMBD),
                 b + "ffn_up_shexp.weight": (shexp, N_EMBD),
                 b + "ffn_down_shexp.weight": (N_EMBD, shexp)}
        if v3:
            want[b + "exp_probs_b.bias"] = (N_EXPERT,)
    return want


def _array(t) -> np.ndarray:
    """A tensor of the file as float32 in torch order (dequantized)."""
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type == Q.F32:
        return np.asarray(t.data, np.float32).reshape(shape)
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_keys_and_tensors_as_the_converter_writes(pairs, arch: str, layout: str) -> None:
    for quant in ("f32", "q8_0"):
        _, r = pairs(arch, quant, layout)
        got = _keys(r)
        want = {f"deepseek2.{k}": v for k, v in _expected_keys(arch, layout).items()}
        assert set(got) == set(want), (sorted(set(got) ^ set(want)))
        for k, v in want.items():
            assert got[k] == pytest.approx(v, rel=1e-6), k
        assert r.fields["general.architecture"].contents() == "deepseek2"
        types = {k: r.fields[k].types[0] for k in want}
        assert types["deepseek2.expert_gating_func"] == GGUFValueType.UINT32
        assert types["deepseek2.rope.scaling.yarn_log_multiplier"] == GGUFValueType.FLOAT32
        if "deepseek2.expert_weights_norm" in types:
            assert types["deepseek2.expert_weights_norm"] == GGUFValueType.BOOL
        assert "tokenizer.ggml.tokens" in r.fields

        shapes = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
        assert shapes == _expected_shapes(arch, layout)
        for t in r.tensors:
            f32 = (quant == "f32" or len(t.shape) == 1 or "ffn_gate_inp" in t.name
                   or t.name.endswith(".bias"))
            assert t.tensor_type == (Q.F32 if f32 else Q.Q8_0), t.name


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("arch", ARCHS)
def test_the_model_runs_the_files_weights(pairs, arch: str, layout: str) -> None:
    """The transformers model holds what the file holds (Q8_0: the dequantized values), the
    latent's up-projection split per head into k_b (transposed) and v_b."""
    for quant in ("f32", "q8_0"):
        m, r = pairs(arch, quant, layout)
        sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
        t = {x.name: _array(x) for x in r.tensors}
        np.testing.assert_array_equal(t["token_embd.weight"], sd["model.embed_tokens.weight"])
        for i in range(3):
            a, b = f"model.layers.{i}.self_attn.", f"blk.{i}."
            kv_b = sd[a + "kv_b_proj.weight"].reshape(N_HEAD, NOPE + V, KV_LORA)
            if layout == "legacy":
                np.testing.assert_array_equal(t[b + "attn_kv_b.weight"], sd[a + "kv_b_proj.weight"])
            else:
                for h in range(N_HEAD):
                    np.testing.assert_array_equal(t[b + "attn_k_b.weight"][h], kv_b[h, :NOPE].T)
                    np.testing.assert_array_equal(t[b + "attn_v_b.weight"][h], kv_b[h, NOPE:])
            np.testing.assert_array_equal(t[b + "attn_kv_a_mqa.weight"],
                                          sd[a + "kv_a_proj_with_mqa.weight"])
            if i:
                e = sd[f"model.layers.{i}.mlp.experts.gate_up_proj"]
                np.testing.assert_array_equal(t[b + "ffn_up_exps.weight"], e[:, 32:])
        ids = torch.randint(3, 500, (1, 90), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            logits = m(ids).logits
        assert torch.isfinite(logits).all() and logits.std() > 0.1


@pytest.mark.parametrize("arch", ARCHS)
def test_k_b_and_v_b_decompress_the_latent_as_kv_b_proj(pairs, arch: str) -> None:
    """Per head h, from the "mla" file: k_nope = latent @ k_b[h] (k_b[h] is [kv_lora, nope]) and
    v = latent @ v_b[h]^T (v_b[h] is [v, kv_lora]); transformers: kv_b_proj(latent). A k_b
    written untransposed, or heads / nope-v split the wrong way round, fails here."""
    m, r = pairs(arch, "f32", "mla")
    t = {x.name: _array(x) for x in r.tensors}
    latent = torch.randn(7, KV_LORA, generator=torch.Generator().manual_seed(2))
    for i in range(3):
        proj = m.model.layers[i].self_attn.kv_b_proj
        with torch.inference_mode():
            ref = proj(latent).view(7, N_HEAD, NOPE + V).numpy()
        k_b, v_b = t[f"blk.{i}.attn_k_b.weight"], t[f"blk.{i}.attn_v_b.weight"]
        x = latent.numpy()
        for h in range(N_HEAD):
            np.testing.assert_allclose(x @ k_b[h], ref[:, h, :NOPE], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(x @ v_b[h].T, ref[:, h, NOPE:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_yarn_is_active(pairs, arch: str) -> None:
    m, _ = pairs(arch, "f32", "mla")
    mscale_all = 1.0 if arch == "deepseek3" else 0.707
    mscale = 0.1 * mscale_all * math.log(4.0) + 1.0
    attn = m.model.layers[0].self_attn
    assert attn.scaling == pytest.approx((NOPE + ROPE) ** -0.5 * mscale * mscale, rel=1e-6)
    assert attn.scaling > 1.05 * (NOPE + ROPE) ** -0.5
    plain = 1.0 / 10000.0 ** (torch.arange(0, ROPE, 2).float() / ROPE)
    inv = m.model.rotary_emb.inv_freq
    assert inv.shape == plain.shape
    assert torch.allclose(inv[0], plain[0])  # the fastest pair keeps its frequency
    assert torch.allclose(inv[-1], plain[-1] / 4.0)  # the slowest is interpolated by the factor
    assert m.model.rotary_emb.attention_scaling == pytest.approx(1.0)  # mscale == mscale_all_dim


def test_group_limited_routing_limits_groups(pairs) -> None:
    """V3's router: sigmoid scores plus e_score_correction_bias choose the experts within the best
    topk_group of n_group groups; on some tokens the plain top-k lies outside them."""
    m, _ = pairs("deepseek3", "f32", "mla")
    seen = []
    gates = [layer.mlp.gate for layer in m.model.layers[1:]]
    hooks = [g.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp[0], out)))
             for g in gates]
    ids = torch.randint(3, 500, (1, 90), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        m(ids)
    for h in hooks:
        h.remove()
    assert len(seen) == 2
    limited = 0
    for gate, x, (logits, weights, idx) in seen:
        bias = gate.e_score_correction_bias
        assert 0.03 < bias.abs().mean() < 0.3
        choice = logits.sigmoid() + bias
        free = choice.topk(2, dim=-1).indices.sort(-1).values
        # 4 groups of 2 experts, a group scored by its best 2 (both); the experts of the best 2
        top = choice.view(-1, 4, 2).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices
        assert ((idx // 2)[:, :, None] == top[:, None, :]).any(-1).all()
        limited += (free != idx.sort(-1).values).any(-1).sum().item()
        w = logits.sigmoid().gather(1, idx)
        torch.testing.assert_close(weights, 2.5 * w / w.sum(-1, keepdim=True))
    assert limited > 0, "group-limited routing never changed a token's experts"

"""Mixture-of-experts HParams read as llama.cpp reads them, and broken MoE files refused at open
(or, for an MXFP4 scale, at load) with one sentence naming the file and the tensor or key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from spec.errors import CarveError

sys.path.insert(0, str(Path(__file__).parent))
from moe_files import write_pair  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def _hp(tmp_path: Path, arch: str, quant: str = "f32", edit=None) -> HParams:
    _, path = write_pair(arch, quant, tmp_path / f"{arch}.gguf", edit=edit)
    return HParams.from_model(GGUFModel.open(path))


def test_fields_match_the_transformers_configs(tmp_path) -> None:
    q = _hp(tmp_path, "qwen3moe")
    assert (q.n_expert, q.n_expert_used, q.n_ff_exp, q.n_ff) == (8, 2, 32, 96)
    assert q.expert_gating == "softmax" and q.expert_weights_norm and q.qk_norm
    assert q.n_layer_run == q.n_layer == 2 and q.rope_dim == q.head_dim == 32
    assert all(q.is_moe_layer(i) for i in range(2)) and q.swiglu_limit == 0 and not q.attn_sinks

    o = _hp(tmp_path, "gpt-oss")
    assert o.expert_gating == "softmax_topk" and o.swiglu_limit == 7.0 and o.attn_sinks
    assert o.swa_layers == (True, False) and o.sliding_window == 16
    assert o.kv_cells(0, 100) == 16 and o.kv_cells(1, 100) == 100
    assert o.rope_scaling == "yarn" and o.rope_scale == 32 and o.rope_scaling_orig_ctx == 4096
    assert not o.rope_yarn_truncate  # gpt-oss's config: truncate = false

    g = _hp(tmp_path, "glm4moe")
    assert g.n_layer == 4 and g.n_layer_run == 3  # one NextN layer declared, not run
    assert g.n_layer_dense_lead == 1 and not g.is_moe_layer(0) and g.is_moe_layer(2)
    assert g.expert_gating == "sigmoid" and g.expert_weights_norm and g.expert_weights_scale == 2.5
    assert (g.n_expert_shared, g.n_ff_shexp, g.rope_dim, g.head_dim) == (1, 32, 16, 32)
    assert not g.qk_norm

    m = _hp(tmp_path, "mixtral")  # a llama file with experts
    assert m.arch == "llama" and m.rope_style == "normal" and not m.qk_norm
    assert (m.n_expert, m.n_expert_used, m.n_ff_exp) == (8, 2, 32)  # the width from the tensors
    assert m.expert_gating == "softmax" and m.expert_weights_norm and m.expert_weights_scale == 1
    assert all(m.is_moe_layer(i) for i in range(2)) and m.n_expert_shared == 0


def _one_tensor_per_expert(meta, table):
    """Layer 1's gate experts as pre-2024 converters wrote them: blk.1.ffn_gate.E.weight."""
    out = []
    for name, dims, t in table:
        if name == "blk.1.ffn_gate_exps.weight":
            out += [(f"blk.1.ffn_gate.{e}.weight", dims[:2], t) for e in range(dims[2])]
        else:
            out.append((name, dims, t))
    return meta, out


def _set(key: str, value: int):
    def edit(meta, table):
        return [(k, t, value if k == key else v) for k, t, v in meta], table
    return edit


def _drop(name: str):
    def edit(meta, table):
        return meta, [row for row in table if row[0] != name]
    return edit


@pytest.mark.parametrize("arch,edit,words", [
    ("qwen3moe", _drop("blk.1.ffn_gate_inp.weight"),
     ["tensor blk.1.ffn_gate_inp.weight", "router", "missing"]),
    ("qwen3moe", _set("qwen3moe.expert_count", 6),
     ["blk.0.ffn_gate_inp.weight", "[64, 8]", "[64, 6]"]),
    ("qwen3moe", _set("qwen3moe.expert_used_count", 9),
     ["qwen3moe.expert_used_count is 9", "8 experts"]),
    ("gpt-oss", _set("gpt-oss.expert_used_count", 0), ["gpt-oss.expert_used_count is 0"]),
    ("glm4moe", _drop("blk.2.ffn_up_shexp.weight"), ["tensor blk.2.ffn_up_shexp.weight"]),
    ("mixtral", _one_tensor_per_expert,
     ["layer 1 stores each expert as a tensor of its own (blk.1.ffn_gate.0.weight...)",
      "re-convert"]),
    ("mixtral", _set("llama.expert_used_count", 9), ["llama.expert_used_count is 9", "8 experts"]),
])
def test_broken_moe_files_are_refused_in_one_sentence(tmp_path, arch, edit, words) -> None:
    with pytest.raises(CarveError) as err:
        _hp(tmp_path, arch, edit=edit)
    msg = str(err.value)
    assert msg.startswith(str(tmp_path / f"{arch}.gguf")) and "\n" not in msg
    for w in words:
        assert w in msg, msg


def test_expert_tensor_of_another_expert_count(tmp_path) -> None:
    def edit(meta, table):  # the experts of layer 0 hold 4 experts instead of 8 (same bytes)
        out = []
        for name, dims, t in table:
            if name == "blk.0.ffn_up_exps.weight":
                dims = (dims[0], dims[1] * 2, dims[2] // 2)
            out.append((name, dims, t))
        return meta, out

    with pytest.raises(CarveError, match=r"blk\.0\.ffn_up_exps\.weight holds 4 experts but "
                                         r"qwen3moe\.expert_count says 8"):
        _hp(tmp_path, "qwen3moe", edit=edit)


def test_mxfp4_block_with_a_nan_scale_is_refused_at_load(tmp_path) -> None:
    from engine.hardware.devices import DeviceSpec
    from engine.planning.plan import Plan
    from engine.runtime.session import Session

    _, path = write_pair("gpt-oss", "mxfp4", tmp_path / "oss.gguf")
    m = GGUFModel.open(path)
    info = m.tensor("blk.1.ffn_down_exps.weight")
    data = np.memmap(path, dtype=np.uint8, mode="r+")
    data[info.offset + 17 * 5] = 0xFF  # block 5's E8M0 scale: NaN
    data.flush()
    del data
    plan = Plan(model=str(path), devices=(DeviceSpec(index=-1, name="cpu", total=1 << 34,
                                                     free=1 << 34),),
                split=(0, 2), ctx=64, prefill_chunk=16, cache_reserve=1 << 34, logits_rows=16)
    with pytest.raises(CarveError, match=r"oss\.gguf: tensor blk\.1\.ffn_down_exps\.weight has a "
                                         r"non-finite MXFP4 block scale \(0xFF, block 5\)"):
        Session.load(plan)


def test_cli_exits_2_on_a_moe_file_without_a_router(tmp_path) -> None:
    _, path = write_pair("qwen3moe", "f32", tmp_path / "bad.gguf",
                         edit=_drop("blk.0.ffn_gate_inp.weight"))
    r = subprocess.run([sys.executable, "-m", "app", "plan", str(path), "--gpus", "cpu"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "blk.0.ffn_gate_inp.weight" in r.stderr and "Traceback" not in r.stderr

"""Every numeric metadata key a model's hyperparameters are read from, set to hostile values
(zero, huge, negative, NaN, infinities, beyond float32), one at a time, on each family's tiny
model: opening, planning, loading and a forward pass give finite logits or one CarveError
sentence naming the file, never another exception or NaN passed on. Keys the family reads only
in some configurations (YaRN's betas, GLM's routing) are planted too: a file may carry them."""

from __future__ import annotations

import math

import pytest
import torch

from engine.gguf.writer import F32, F64, I32, I64, U32, U64
from engine.synth.gen import write_model
from spec.errors import CarveError
from tests.engine.capped import address_space_capped

INTS = [(U32, 0), (U32, 2**32 - 1), (U64, 2**60), (I32, -1), (I64, -(2**62))]
FLOATS = [(F32, math.nan), (F32, math.inf), (F32, -1.0), (F32, 0.0), (F64, 1e300)]
NUMERIC = (U32, I32, F32, U64, I64, F64)
# read by hparams where present; the tiny files carry only some of them
OPTIONAL = [("attention.key_length", U32), ("attention.value_length", U32),
            ("rope.scaling.factor", F32), ("rope.scale_linear", F32),
            ("rope.scaling.original_context_length", U32),
            ("rope.scaling.yarn_beta_fast", F32), ("rope.scaling.yarn_beta_slow", F32),
            ("attention.scale", F32), ("attention.query_pre_attn_scalar", F32),
            ("attention.sliding_window", U32), ("expert_shared_count", U32),
            ("leading_dense_block_count", U32), ("nextn_predict_layers", U32),
            ("expert_weights_scale", F32), ("expert_gating_func", U32),
            ("attention.sliding_window_pattern", U32)]


def _keys(shape: str, tmp_path) -> list[tuple[str, int]]:
    seen: dict[str, list] = {}

    def grab(meta):
        seen["meta"] = list(meta)
        return meta

    write_model(tmp_path / "base.gguf", shape, "q8_0", edit=grab)
    meta = seen["meta"]
    arch = next(v for k, _, v in meta if k == "general.architecture")
    keys = [(k, t) for k, t, _ in meta if t in NUMERIC and k.startswith(arch + ".")]
    have = {k for k, _ in keys}
    return keys + [(f"{arch}.{k}", t) for k, t in OPTIONAL if f"{arch}.{k}" not in have]


@pytest.mark.parametrize("shape", ["llama-tiny", "gemma3-tiny", "qwen3moe-tiny", "gpt-oss-tiny",
                                   "glm4moe-tiny"])
def test_hostile_numbers_load_finite_or_are_one_sentence(shape, tmp_path):
    from app.cli_chat import build_plan
    from engine.runtime.session import Session

    wrong = []
    for key, kind in _keys(shape, tmp_path):
        for vtype, value in FLOATS if kind in (F32, F64) else INTS:
            path = write_model(tmp_path / "x.gguf", shape, "q8_0", edit=lambda m: [
                kv for kv in m if kv[0] != key] + [(key, vtype, value)])[0]
            try:
                with address_space_capped():
                    session = Session.load(build_plan(path, "cpu", 64, "f16"))
                    try:
                        logits = session.forward([1, 2, 3], 0, rows="all")
                    finally:
                        session.close()
                if not bool(torch.isfinite(logits).all()):
                    wrong.append(f"{key}={value!r}: non-finite logits")
            except CarveError as err:
                text = str(err)
                if "\n" in text or "x.gguf" not in text:
                    wrong.append(f"{key}={value!r}: {text!r}")
            except Exception as err:  # noqa: BLE001 - what this test exists to catch
                wrong.append(f"{key}={value!r}: {type(err).__name__}: {err}")
    assert not wrong, "\n".join(wrong)

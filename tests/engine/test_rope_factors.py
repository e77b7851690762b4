"""llama-3.1's RoPE: the per-pair frequency factors a GGUF carries as rope_freqs.weight.

The CPU engine against transformers (a tiny random LlamaForCausalLM whose config asks for the
"llama3" RoPE, written to GGUF as llama.cpp's converter writes it: q/k rows permuted for the
adjacent-pair rotation, the factors as rope_freqs.weight); the Triton runner against the CPU
engine on `carve gen`'s llama3.1-tiny (the rotated keys each writes into its cache, prefill and
decode, then logits and greedy ids); and the file's factors checked before they are used.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gpu_compare import against_cpu_engine, keys_alike, rel
from hf_compare import f32_kv
from moe_files import LLAMA3_ROPE as ROPE
from moe_files import hf_model, write_pair

from engine.gguf.hparams import HParams
from engine.gguf.reader import GGUFModel
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.sampling import SamplingParams
from engine.runtime.session import Session
from engine.synth.contents import llama3_factors
from engine.synth.gen import write_model
from spec.errors import CarveError

GIB = 1 << 30
CPU = DeviceSpec(index=-1, name="cpu", total=8 * GIB, free=8 * GIB)
ON_GPU = torch.cuda.is_available()
DEV = torch.device("cuda", 0) if ON_GPU else torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _session(path, chunk: int = 32) -> Session:
    hp = HParams.from_model(GGUFModel.open(path))
    plan = Plan(model=str(path), devices=(CPU,), split=(0, hp.n_layer), ctx=256,
                prefill_chunk=chunk, cache_reserve=16 * GIB, logits_rows=chunk)
    return f32_kv(Session.load(plan))  # a float32 cache: only the maths remains


def test_the_factors_are_transformers_llama3_frequencies() -> None:
    hf = hf_model("llama3")
    d = hf.config.head_dim
    plain = 1.0 / ROPE["rope_theta"] ** (torch.arange(0, d, 2).float() / d)
    f = torch.tensor(llama3_factors(d, ROPE["rope_theta"], ROPE["factor"], 1.0, 4.0, 64))
    torch.testing.assert_close(plain / f, hf.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert (f == 1).sum() == 2 and (f == 8).sum() == 11  # and 3 between: all three kinds


def test_the_cpu_engine_matches_transformers(tmp_path) -> None:
    hf, path = write_pair("llama3", "f32", tmp_path / "llama3.gguf")
    assert HParams.from_model(GGUFModel.open(path)).rope_factors
    ids = torch.randint(3, 500, (90,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(ids.unsqueeze(0)).logits[0]
    sess = _session(path)
    got = sess.logits(ids.tolist())
    err = rel(got, ref)
    # measured 3.9e-6; the same file read without its factors: 1.2
    assert err < 1e-4, f"logits differ by {err:.2e} of their range"
    prompt = ids[:12].tolist()
    with torch.inference_mode():
        want = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    out: list[int] = []
    sess.generate(prompt, SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=32),
                  set(), out.append)
    sess.close()
    assert out == want


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    (path,) = write_model(tmp_path_factory.mktemp("rope") / "llama3.1-tiny.gguf", "llama3.1-tiny",
                          "q4_k_m")
    return str(path)


def _plan(path: str) -> Plan:
    return Plan(model=path, devices=(CPU,), split=(0, 4), ctx=128, prefill_chunk=8,
                cache_reserve=1 << 50, logits_rows=8)


def _ids(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_the_triton_runner_rotates_as_the_cpu_engine(tiny) -> None:
    """The keys each engine rotated into its cache, prefill (40 positions in chunks of 8) and
    then decode: the synthetic model's attention is too flat for a wrong rotation to show much
    in its logits (measured 1.4e-3 with the factors left out), its keys are not (1.1). Then,
    as everywhere, the logits and the greedy ids as the CPU engine's; one load of each."""

    def keys_rotated_alike(g, c) -> None:  # after the prefill of 40 and 3 decode steps
        assert g.pipe.stages[0].buf["rope_freqs"].shape == (32,)
        keys_alike(g, c, 43, 5e-3)  # 2.5e-4 measured

    against_cpu_engine(_plan(tiny), DEV, _ids(40), _ids(3, 1), _ids(6, 3), 5e-3, tiny,
                       after=keys_rotated_alike)


def _with_factors(tmp_path, values: np.ndarray) -> str:
    (path,) = write_model(tmp_path / "f.gguf", "llama3.1-tiny", "q8_0")
    t = GGUFModel.open(path).tensor("rope_freqs.weight")
    with open(path, "r+b") as f:
        f.seek(t.offset)
        f.write(np.asarray(values, np.float32).tobytes())
    return str(path)


@pytest.mark.parametrize("bad", [0.0, -2.0, float("nan"), float("inf")])
def test_a_factor_that_is_not_finite_and_positive_is_named(tmp_path, bad) -> None:
    values = np.ones(32, np.float32)
    values[5] = bad
    path = _with_factors(tmp_path, values)
    with pytest.raises(CarveError) as e:
        Session.load(_plan(path)).close()
    msg = str(e.value)
    assert "rope_freqs.weight" in msg and "pair 5" in msg and "\n" not in msg


def test_factors_that_disagree_with_the_rotation_are_refused_at_open(tmp_path) -> None:
    def half_rotated(meta):  # the metadata rotates 32 dims a head (16 pairs), the file has 32
        return [(k, t, 32 if k == "llama.rope.dimension_count" else v) for k, t, v in meta]

    (path,) = write_model(tmp_path / "odd.gguf", "llama3.1-tiny", "q8_0", edit=half_rotated)
    with pytest.raises(CarveError) as e:
        HParams.from_model(GGUFModel.open(path))
    assert str(e.value) == (f"{path}: tensor rope_freqs.weight has shape [32] but a head rotates "
                            "16 pairs (llama.rope.dimension_count 32); the file is inconsistent")


def test_two_stages_rotate_as_one(tiny) -> None:
    """Each stage holds the factors and its own frequencies: a split between the layers gives
    one stage's prefill and decode logits to the bit (bf16 activations)."""
    from gpu_compare import chunk_and_decode_rows

    from engine.runtime.gpu.session import GpuSession

    sim = tuple(DeviceSpec(index=i, name="sim", total=8 * GIB, free=8 * GIB, simulated=True)
                for i in range(2))
    got = []
    for devices, split in ((sim[:1], (0, 4)), (sim, (0, 2, 4))):
        plan = Plan(model=tiny, devices=devices, split=split, ctx=128, prefill_chunk=8,
                    cache_reserve=1 << 50, logits_rows=1, act_dtype="bf16")
        g = GpuSession.load(plan, devices=[DEV] * len(devices), remember=False)
        assert all("rope_freqs" in st.buf for st in g.pipe.stages)
        got.append(chunk_and_decode_rows(g, _ids(12, 3)))
    assert torch.isfinite(got[0]).all() and torch.equal(got[0], got[1])


def test_f16_factors_load_on_both_runners(tmp_path, monkeypatch) -> None:
    """A converter may write the factors as F16: the file opens, and both engines read them as
    the F32 file's (the factors are small dyadic-ish numbers; f16 rounds them by <= 5e-4)."""
    import engine.synth.gen as gen
    from engine.runtime.gpu.session import GpuSession
    from spec.quant_types import F16

    types = gen.tensor_types
    with monkeypatch.context() as mp:
        mp.setattr(gen, "tensor_types", lambda *a, **k: {**types(*a, **k),
                                                           "rope_freqs.weight": F16})
        (path,) = write_model(tmp_path / "f16.gguf", "llama3.1-tiny", "q4_k_m")
    m = GGUFModel.open(path)
    assert m.tensor("rope_freqs.weight").ggml_type == F16 and HParams.from_model(m).rope_factors
    g = GpuSession.load(_plan(str(path)), devices=[DEV], remember=False)
    c = Session.load(_plan(str(path)))
    try:
        want = torch.tensor(llama3_factors(64, 1e4, 8.0, 1.0, 4.0, 64))
        plain = 1.0 / 1e4 ** (torch.arange(0, 64, 2).float() / 64)
        got = g.pipe.stages[0].buf["rope_freqs"].cpu()
        assert rel(got, plain / want) < 1e-3
        g.logits(_ids(20))
        c.logits(_ids(20))
        err = rel(g.pipe.stages[0].layers[0].attn.k_cache[:20], c.kv.layers[0].k[:20])
        assert err < 5e-3
    finally:
        g.close()
        c.close()

"""Decode's L2 prefetch of each layer's gate/up (CARVE_L2_PREFETCH, carve_kernels/l2.py): the
option's values, the prefetch's checks, and on a GPU the same logits and greedy ids with it as
without (a prefetch moves bytes into L2, never a value)."""

from __future__ import annotations

import pytest
import torch

from carve_kernels import l2
from engine.hardware.devices import DeviceSpec
from engine.planning.plan import Plan
from engine.runtime.gpu import matrices
from engine.runtime.gpu.session import GpuSession
from engine.runtime.options import RunnerOptions
from engine.runtime.sampling import SamplingParams
from engine.synth.gen import write_model
from engine.synth.shapes import Shape
from spec.errors import CarveError

# 256-wide rows: the FFN pair goes into the T layout (with T_MIN_BYTES lifted)
WIDE = Shape("qwen2", 2, 256, 4, 2, 512, 320, n_ctx=512)


@pytest.mark.parametrize("value,want", [("", 0), ("0", 0), ("24", 24), ("1024", 1024)])
def test_the_option_is_mib_a_layer(value, want) -> None:
    assert RunnerOptions.from_env({"CARVE_L2_PREFETCH": value}).l2_prefetch == want


@pytest.mark.parametrize("value", ["-1", "1.5", "1025", "lots"])
def test_a_bad_option_names_the_variable(value) -> None:
    with pytest.raises(CarveError, match=f"CARVE_L2_PREFETCH={value}: use a whole number"):
        RunnerOptions.from_env({"CARVE_L2_PREFETCH": value})


def test_prefetch_checks_its_ranges_and_does_nothing_on_the_cpu() -> None:
    t = torch.zeros(4096, dtype=torch.uint8)
    l2.prefetch(t, 4, 1024, 512)  # the CPU has no L2 to fill: returns
    l2.prefetch(t, 0, 1024, 512)
    with pytest.raises(ValueError, match="multiples of 16"):
        l2.prefetch(t, 4, 1024, 500)
    with pytest.raises(ValueError, match="passes the end of a tensor of 4096 bytes"):
        l2.prefetch(t, 4, 1024, 1040)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_decode_with_the_prefetch_gives_the_same_logits_and_ids(tmp_path,
                                                                     monkeypatch) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path))
    monkeypatch.setattr(matrices, "T_MIN_BYTES", 0)
    path = str(write_model(tmp_path / "wide.gguf", WIDE, "q4_k_m")[0])
    free, total = torch.cuda.mem_get_info(0)
    gpu = DeviceSpec(index=0, name=torch.cuda.get_device_name(0), total=total, free=free)
    pl = Plan(model=path, devices=(gpu,), split=(0, 2), ctx=64, prefill_chunk=16,
              cache_reserve=0, logits_rows=4)
    greedy = SamplingParams(temperature=0.0, repeat_penalty=1.0, max_tokens=12)
    prompt = [5, 17, 3, 99, 41, 7, 250, 12]
    got = []
    for mib in (0, 1):
        g = GpuSession.load(pl, remember=False, options=RunnerOptions(l2_prefetch=mib))
        try:
            st = g.pipe.stages[0]
            assert (st._l2_stream is not None) == bool(mib)  # the warm-up's step prefetched
            out: list[int] = []
            g.generate(prompt, greedy, set(), out.append)
            got.append((g.logits(prompt).clone(), out))
        finally:
            g.close()
    assert torch.equal(got[0][0], got[1][0]) and got[0][1] == got[1][1]
    assert len(got[0][1]) == greedy.max_tokens

"""A shortened soak (benchmarks/soak.py) on the tiny model on the CPU: the engine's resident
memory stays flat over generate/stop cycles, tokenize calls and load/unload cycles."""

from __future__ import annotations

import io

from benchmarks import soak


def test_engine_memory_stays_flat_over_generate_stop_and_tokenize(synth_model):
    out = io.StringIO()
    slopes = soak.run(synth_model("llama"), "cpu", 128, generate=30, loads=0, tokenize=100,
                      every=1, seed=1, out=out, max_tokens=6)
    assert set(slopes) == {"start", "generate", "tokenize"}, out.getvalue()
    # a leak of one 4 KiB page per cycle fails these; the allocator's noise does not (a sample
    # every cycle and the Theil-Sen slope: one sample caught 1 MiB high or low moves nothing)
    assert slopes["generate"] < 4, out.getvalue()
    assert slopes["tokenize"] < 4, out.getvalue()


def test_engine_memory_stays_flat_over_load_unload(synth_model):
    """Each load once left the previous model open and mapped (pricing's table of model
    indexes held the last 8 models): the engine holds the file once (the loaded model's
    descriptor; the file is never mapped) and RSS stays flat."""
    out = io.StringIO()
    model = synth_model("llama")
    slopes = soak.run(model, "cpu", 128, generate=0, loads=8, tokenize=0,
                      every=10, seed=1, out=out, mappings_of=model)
    assert slopes["load"] < 256, out.getvalue()  # the tiny model is ~1.6 MiB: a leaked load shows
    holds = [int(line.split("holds ")[1].split()[0]) for line in out.getvalue().splitlines()
             if " holds " in line]
    assert holds and max(holds) == 1, out.getvalue()  # the loaded model's one descriptor


def test_slope_sees_a_steady_leak_through_noise_and_ignores_one_odd_sample():
    # the samples of a CI run that a least-squares fit read as +6.6 KiB a cycle: a plateau with
    # one sample 1 MiB below it
    plateau = [(0, 334.4), (3, 334.9), (6, 335.4), (9, 334.9), (12, 335.0), (15, 336.0),
               (18, 334.5), (21, 335.5), (24, 335.5), (27, 335.5), (29, 335.5)]
    assert abs(soak.slope(plateau)) * 1024 < 1
    noise = [0.0, 0.5, -0.5, 0.0, 0.0, 1.0, 0.0, -1.0]
    leak = [(i, 300 + i * 8 / 1024 + noise[i % len(noise)]) for i in range(60)]
    assert abs(soak.slope(leak) * 1024 - 8) < 0.5
    assert soak.slope([(0, 1.0)]) == 0.0

"""A shortened soak (benchmarks/soak.py) on the tiny model on the CPU: the engine's resident
memory stays flat over generate/stop cycles, tokenize calls and load/unload cycles."""

from __future__ import annotations

import io

import pytest

from benchmarks import soak


def test_engine_memory_stays_flat_over_generate_stop_and_tokenize(synth_model):
    out = io.StringIO()
    slopes = soak.run(synth_model("llama"), "cpu", 128, generate=30, loads=0, tokenize=100,
                      every=3, seed=1, out=out, max_tokens=6)
    assert set(slopes) == {"start", "generate", "tokenize"}, out.getvalue()
    # a leak of one 4 KiB page per cycle fails these; the allocator's noise does not
    assert slopes["generate"] < 4, out.getvalue()
    assert slopes["tokenize"] < 4, out.getvalue()


@pytest.mark.xfail(strict=True, reason="each load leaves the previous model's file mapped (one "
                   "more GGUFModel mapping in /proc/self/maps per load after Session.close): "
                   "RSS grows by about the touched header per load; not fixed yet")
def test_engine_memory_stays_flat_over_load_unload(synth_model):
    out = io.StringIO()
    slopes = soak.run(synth_model("llama"), "cpu", 128, generate=0, loads=8, tokenize=0,
                      every=10, seed=1, out=out)
    assert slopes["load"] < 256, out.getvalue()  # the tiny model is ~1.6 MiB: a leaked load shows

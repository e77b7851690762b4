"""RunnerOptions: the runner and the GPU runner's kernel switches, read from the environment once
at engine start; a bad value is one line naming the variable and what it accepts, and the engine
process exits 2 with that line before it serves anything."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.runtime.options import TRIALS, RunnerOptions
from spec import quant_types as qt
from spec.errors import CarveError

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_when_nothing_is_set() -> None:
    assert RunnerOptions.from_env({}) == RunnerOptions() == RunnerOptions(
        runner="auto", q8x=True, expert_q8=True, attn_q8=True, t_layout=True, pdl=True,
        prefill_graph=True, trials=frozenset())
    empty = {"CARVE_RUNNER": "", "CARVE_Q8X": " ", "CARVE_T_LAYOUT": "", "CARVE_PDL": ""}
    assert RunnerOptions.from_env(empty) == RunnerOptions()


@pytest.mark.parametrize(("env", "want"), [
    ({"CARVE_RUNNER": "torch"}, RunnerOptions(runner="torch")),
    ({"CARVE_RUNNER": "auto"}, RunnerOptions()),
    ({"CARVE_Q8X": "0"}, RunnerOptions(q8x=False)),
    ({"CARVE_EXPERT_Q8": "0"}, RunnerOptions(expert_q8=False)),
    ({"CARVE_ATTN_Q8": "0"}, RunnerOptions(attn_q8=False)),
    ({"CARVE_T_LAYOUT": "0"}, RunnerOptions(t_layout=False)),
    ({"CARVE_PDL": "0"}, RunnerOptions(pdl=False)),
    ({"CARVE_PREFILL_GRAPH": "0"}, RunnerOptions(prefill_graph=False)),
    ({"CARVE_Q8X": "1", "CARVE_T_LAYOUT": "1", "CARVE_PDL": "1"}, RunnerOptions()),
    ({"CARVE_Q8X": "0", "CARVE_PDL": "0", "OTHER": "x"}, RunnerOptions(q8x=False, pdl=False)),
    ({"CARVE_TRIAL": "q2k_rows"}, RunnerOptions(trials=frozenset({"q2k_rows"}))),
    ({"CARVE_TRIAL": " q2k_rows, "}, RunnerOptions(trials=frozenset({"q2k_rows"}))),
    ({"CARVE_TRIAL": "all"}, RunnerOptions(trials=frozenset(TRIALS))),
    ({"CARVE_TRIAL": ""}, RunnerOptions()),
    ({"CARVE_EXPERT_TILES": "Q4_K/glu=32,4,8; Q6_K/down=16,1,2;"},
     RunnerOptions(expert_tiles=((qt.Q4_K, "glu", (32, 4, 8)), (qt.Q6_K, "down", (16, 1, 2))))),
    ({"CARVE_EXPERT_TILES": " "}, RunnerOptions()),
    ({"CARVE_T_TILES": "qkv=4,1056; glu=8,2112;"},
     RunnerOptions(t_tiles=(("qkv", (4, 1056, 0)), ("glu", (8, 2112, 0))))),
    ({"CARVE_T_TILES": "attn=2,2112,128;one=4,1056,256"},
     RunnerOptions(t_tiles=(("attn", (2, 2112, 128)), ("one", (4, 1056, 256))))),
    ({"CARVE_T_TILES": ""}, RunnerOptions()),
])
def test_each_variable_sets_its_option(env, want) -> None:
    assert RunnerOptions.from_env(env) == want


@pytest.mark.parametrize(("env", "message"), [
    ({"CARVE_RUNNER": "triton"}, "CARVE_RUNNER=triton: use auto or torch"),
    ({"CARVE_Q8X": "off"}, "CARVE_Q8X=off: use 1 (on, the default) or 0 (off)"),
    ({"CARVE_T_LAYOUT": "false"}, "CARVE_T_LAYOUT=false: use 1 (on, the default) or 0 (off)"),
    ({"CARVE_PDL": "2"}, "CARVE_PDL=2: use 1 (on, the default) or 0 (off)"),
    ({"CARVE_EXPERT_Q8": "no"}, "CARVE_EXPERT_Q8=no: use 1 (on, the default) or 0 (off)"),
    ({"CARVE_ATTN_Q8": "on"}, "CARVE_ATTN_Q8=on: use 1 (on, the default) or 0 (off)"),
    ({"CARVE_PREFILL_GRAPH": "yes"},
     "CARVE_PREFILL_GRAPH=yes: use 1 (on, the default) or 0 (off)"),
    ({"CARVE_TRIAL": "q2k_rows,down_norm"},
     "CARVE_TRIAL=q2k_rows,down_norm: use all or a comma-separated list of q2k_rows, "
     "q8_0_rows, l2_last, iq4nl_experts"),
    ({"CARVE_EXPERT_TILES": "Q4_K/glu=16,4,8"},
     "CARVE_EXPERT_TILES entry 'Q4_K/glu=16,4,8': use TYPE/PART=ROWS,BLOCKS,WARPS with TYPE "
     "one of Q4_K, Q6_K, MXFP4, Q3_K, Q5_0, IQ4_NL, Q8_0, PART glu or down, powers of two (warps at most "
     "16, rows at "
     "least 32 for glu and 16 for down)"),
])
def test_a_bad_value_names_the_variable_and_the_accepted_values(env, message) -> None:
    with pytest.raises(CarveError) as e:
        RunnerOptions.from_env(env)
    assert str(e.value) == message


def test_the_trials_switch_the_kernels_tables_for_the_process(monkeypatch) -> None:
    from carve_kernels import moe_decode_q8, quant_matmul

    base, tiles = quant_matmul.ROW_BODY_TYPES, moe_decode_q8.EXPERT_Q8_CONFIG
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES", base)
    monkeypatch.setattr(moe_decode_q8, "EXPERT_Q8_CONFIG", tiles)
    monkeypatch.setattr(moe_decode_q8, "Q8_ON_TRIAL", frozenset())
    RunnerOptions().apply()
    assert quant_matmul.ROW_BODY_TYPES == base and moe_decode_q8.EXPERT_Q8_CONFIG == tiles
    RunnerOptions(trials=frozenset({"q2k_rows"})).apply()
    assert quant_matmul.ROW_BODY_TYPES == base | {qt.Q2_K} > base
    monkeypatch.setattr(quant_matmul, "ROW_BODY_TYPES", base)
    assert all(moe_decode_q8.q8_able(t, 256) for t in (qt.Q3_K, qt.Q8_0))
    assert not any(moe_decode_q8.q8_able(t, 256) for t in (qt.IQ4_NL, qt.Q4_0, qt.Q4_1, qt.Q5_1))
    RunnerOptions(trials=frozenset(TRIALS)).apply()
    assert quant_matmul.ROW_BODY_TYPES == base | quant_matmul.ROW_BODY_TRIAL > base
    assert moe_decode_q8.EXPERT_Q8_CONFIG == tiles
    assert all(moe_decode_q8.q8_able(t, 256) for t in (qt.Q3_K, qt.IQ4_NL, qt.Q8_0))
    assert not any(moe_decode_q8.q8_able(t, 256) for t in (qt.Q4_0, qt.Q4_1, qt.Q5_1))


@pytest.mark.parametrize("entry", ["Q5_1/glu=32,4,4", "Q4_K/gate=32,4,4", "Q4_K/glu=32,3,4",
                                   "Q4_K/glu=32,4,32", "Q6_K/down=8,1,2", "Q4_K/glu=32,4",
                                   "Q4_K/glu", "Q4_K/down=a,b,c", "MXFP4/down=16,0,4"])
def test_a_bad_expert_tile_is_refused(entry) -> None:
    with pytest.raises(CarveError, match="CARVE_EXPERT_TILES entry"):
        RunnerOptions.from_env({"CARVE_EXPERT_TILES": f"Q4_K/glu=32,4,4;{entry}"})


@pytest.mark.parametrize("entry", ["down=4,1056", "qkv=3,1056", "qkv=32,1056", "one=4,4224",
                                   "one=4,0", "glu=4", "glu", "qkv=a,b", "attn=2,2112,64",
                                   "attn=2,2112,512", "one=4,1056,128,1", "qkv=4,1056,256"])
def test_a_bad_t_tile_is_refused(entry) -> None:
    with pytest.raises(CarveError) as e:
        RunnerOptions.from_env({"CARVE_T_TILES": f"qkv=4,1056;{entry}"})
    assert str(e.value).startswith(f"CARVE_T_TILES entry {entry!r}: use "
                                   "PART=WARPS,PROGRAMS[,ROWS] with PART one of qkv, one, attn, "
                                   "glu")
    assert "2112" in str(e.value) and "ROWS 128 or 256 (qkv 128)" in str(e.value)


def test_t_tiles_set_the_t_launches_table_for_the_process(monkeypatch) -> None:
    from carve_kernels import gemv_t

    monkeypatch.setattr(gemv_t, "T_TUNE", {})
    RunnerOptions.from_env({"CARVE_T_TILES": "one=8,1056"}).apply()
    assert gemv_t.T_TUNE == {"one": (8, 1056, 0)}
    # the default config keeps its rows a program; a caller's own config is left as it is;
    # attn_output's launch takes one's tuning unless attn has its own
    assert gemv_t._tuned(None, (128, 4, 2112), "one") == (128, 8, 1056)
    assert gemv_t._tuned(None, (128, 4, 2112), "attn", "one") == (128, 8, 1056)
    assert gemv_t._tuned(None, (256, 4, 2112), "qkv") == (256, 4, 2112)
    assert gemv_t._tuned((64, 1, 1), (128, 4, 2112), "one") == (64, 1, 1)
    RunnerOptions.from_env({"CARVE_T_TILES": "attn=2,2112,128"}).apply()
    assert gemv_t._tuned(None, (256, 4, 2112), "attn", "one") == (128, 2, 2112)
    assert gemv_t._tuned(None, (256, 4, 2112), "one") == (256, 8, 1056)


def test_expert_tiles_set_the_expert_gemvs_table_for_the_process(monkeypatch) -> None:
    from carve_kernels import moe_decode_q8

    tiles = dict(moe_decode_q8.EXPERT_Q8_CONFIG)
    monkeypatch.setattr(moe_decode_q8, "EXPERT_Q8_CONFIG", tiles)
    RunnerOptions.from_env({"CARVE_EXPERT_TILES": "Q4_K/glu=64,2,8"}).apply()
    assert moe_decode_q8.EXPERT_Q8_CONFIG == {**tiles, (qt.Q4_K, "glu"): (64, 2, 8)}
    assert tiles[(qt.Q4_K, "glu")] != (64, 2, 8)  # the module's own table is not changed


def test_options_are_frozen_and_checked() -> None:
    with pytest.raises(AttributeError):
        RunnerOptions().pdl = False  # type: ignore[misc]
    with pytest.raises(CarveError, match="runner 'cuda'"):
        RunnerOptions(runner="cuda")
    with pytest.raises(CarveError, match="trial fast"):
        RunnerOptions(trials=frozenset({"fast"}))


def test_the_engine_process_exits_2_with_one_line_on_a_bad_value() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CARVE_Q8X": "yes"}
    res = subprocess.run([sys.executable, "-m", "engine.runtime.server"], cwd=ROOT, env=env,
                         stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60,
                         check=False)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip().splitlines() == [
        "carve-engine: CARVE_Q8X=yes: use 1 (on, the default) or 0 (off)"]

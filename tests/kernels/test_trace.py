"""The decode step's stamps (carve_kernels/trace.py, `carve bench --trace`): which launches get
rows and which do not, what the stamps are read back as, and that the stamps compile into the
kernels for sm_90 (Triton's compiler and the ptxas of its wheel, in a process of its own: the
interpreter runs no inline assembly) and out of them when off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from carve_kernels import trace
from engine.runtime import step_trace


def test_launches_outside_a_recording_are_not_traced_and_the_interpreter_stamps_order():
    y = torch.zeros(4)
    off = trace.args("gemv", (3, 2), y)
    assert off == {"trace_ptr": y, "TRACE": False}
    with trace.recording(torch.device("cpu"), 16) as rec:
        # the interpreter's tensors: the points' numbers, not times (TRACE 2)
        got = trace.args("gemv", (3, 2), y)
        assert got["TRACE"] == 2 and got["trace_ptr"].data_ptr() == rec.buf.data_ptr()
        assert rec.used == 6 and rec.launches == [("gemv", 0, 6)]
    assert trace.args("gemv", (3, 2), y)["TRACE"] is False  # the recording is over


def test_a_recording_hands_each_launch_its_own_rows_and_refuses_past_its_buffer():
    rec = trace.Recorder(torch.zeros(10, trace.ROW, dtype=torch.int64))
    a = rec.take("norm", 3)
    b = rec.take("glu", 6)
    assert rec.launches == [("norm", 0, 3), ("glu", 3, 6)] and rec.used == 9
    assert a.data_ptr() == rec.buf.data_ptr()
    assert b.data_ptr() == rec.buf[3].data_ptr()
    with pytest.raises(ValueError, match="holds 10 programs; down needs 2 more after 9"):
        rec.take("down", 2)


def _stamps(rows: list[tuple[int, ...]]) -> torch.Tensor:
    # (timer x4, sm[, cycles x4]): without cycles, two a nanosecond from 5,000
    t = torch.zeros(len(rows), trace.ROW, dtype=torch.int64)
    for i, r in enumerate(rows):
        t[i, :5] = torch.tensor(r[:5])
        clk = r[5:] or tuple(5000 + 2 * (v - r[0]) for v in r[:4])
        t[i, trace.CLOCK:trace.CLOCK + 4] = torch.tensor(clk)
    return t


def test_the_timeline_reads_exposed_time_gaps_phases_and_sms_from_the_stamps():
    base = 1_000_000_000  # the global timer, nanoseconds
    rec = trace.Recorder(torch.zeros(8, trace.ROW, dtype=torch.int64))
    # launch 1: two programs on SMs 0 and 1, from base to base + 5 us
    rec.take("norm", 2)[:2] = _stamps([(base, base + 1000, base + 4000, base + 5000, 0),
                                       (base + 200, base + 1200, base + 3200, base + 4200, 1)])
    # launch 2 (PDL): starts 1 us before launch 1 ended, ends 3 us after it
    rec.take("glu", 2)[:2] = _stamps([(base + 4000, base + 5000, base + 7000, base + 8000, 1),
                                      (base + 4000, base + 5000, base + 6000, base + 7000, 1)])
    # launch 3: one program that never stamped its end (returned early): out of the timeline
    rec.take("down", 1)[:1] = _stamps([(base + 9000, base + 9000, base + 9500, 0, 2, 1, 1, 1, 0)])
    # launch 4: the same kernel as launch 1, 2 us after launch 2 ended
    rec.take("norm", 1)[:1] = _stamps([(base + 10000, base + 10500, base + 11000, base + 12000,
                                        3)])
    tl = trace.launches(rec)
    assert [la.name for la in tl] == ["norm", "glu", "down", "norm"]
    n1, g, d, n2 = tl
    assert (n1.programs, n1.sms, n1.first_start, n1.last_start, n1.last_done) == (
        2, 2, 0.0, 0.2, 5.0)
    assert n1.phases == pytest.approx({"wait": 1.0, "compute": 2.5, "end": 1.0})
    assert (n1.exposed, n1.gap) == (5.0, 0.0)
    assert (g.sms, g.exposed, g.gap) == (1, 3.0, -1.0)
    assert g.phases == pytest.approx({"wait": 1.0, "compute": 1.5, "end": 1.0})
    assert d.programs == -1  # no place in the timeline: the next launch counts from glu's end
    assert (n2.exposed, n2.gap) == (4.0, 2.0)
    rows = {r["name"]: r for r in trace.summary(tl)}
    assert set(rows) == {"norm", "glu"}
    assert rows["norm"]["calls"] == 2 and rows["norm"]["exposed_us"] == pytest.approx(9.0)
    assert rows["norm"]["exposed_per_call_us"] == pytest.approx(4.5)
    assert rows["norm"]["programs"] == 2  # round(3 / 2)
    assert rows["norm"]["gap_us"] == pytest.approx(1.0)
    assert rows["norm"]["span_us"] == pytest.approx((5.0 + 2.0) / 2)
    assert [r["name"] for r in trace.summary(tl)] == ["norm", "glu"]  # most exposed first


def test_phases_come_from_the_cycles_at_the_rate_the_timer_gives_them():
    # one program's timer ticks coarsely (1 us); its cycles (2 a nanosecond overall) say where
    # inside its 4 us the phases fell
    base = 7_000_000
    rec = trace.Recorder(torch.zeros(2, trace.ROW, dtype=torch.int64))
    rec.take("glu", 2)[:2] = _stamps([
        (base, base, base + 1000, base + 4000, 5, 0, 600, 6600, 8000),
        (base, base + 1000, base + 3000, base + 4000, 6, 0, 2000, 6000, 8000)])
    glu, = trace.launches(rec)
    assert glu.phases == pytest.approx({"wait": 0.65, "compute": 2.5, "end": 0.85})


def test_a_recording_nothing_stamped_reads_as_unstamped_launches():
    rec = trace.Recorder(torch.zeros(4, trace.ROW, dtype=torch.int64))
    rec.take("gemv_t", 4)
    tl = trace.launches(rec)
    assert [(la.name, la.programs) for la in tl] == [("gemv_t", -1)]
    assert trace.summary(tl) == []


def test_the_step_trace_says_why_a_stage_is_not_traced():
    class Stage:
        def __init__(self, cuda, pieces):
            self.on_cuda, self.device, self._pieces = cuda, torch.device("cpu"), pieces

        def eager_hosts(self):
            return self._pieces

    class Pipe:
        stages = [Stage(True, True)]

    out = step_trace.trace_step(Pipe())
    assert out == [{"stage": "cpu", "skipped": "its host layers' experts run between graphs "
                    "(decode in pieces)"}]


_COMPILE = """
import json
from benchmarks import ptx_count
from spec import quant_types as qt
out = {}
for traced in (False, True):
    for name, k in (
            ("glu", lambda: ptx_count.compile_expert(qt.Q4_K, "glu", (32, 4, 4), traced)),
            ("down", lambda: ptx_count.compile_expert(qt.Q6_K, "down", (16, 1, 2), traced)),
            ("gemv_t", lambda: ptx_count.compile_t(qt.Q4_K, 128, 4, "int8", traced))):
        ptx = k().asm["ptx"]
        out[f"{name} {traced}"] = [ptx.count(r) for r in ("%globaltimer", "%clock64", "%smid")]
print(json.dumps(out))
"""


def test_the_stamps_compile_into_the_kernels_for_sm90_and_out_of_them_when_off():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True,
                         env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("glu", "down", "gemv_t"):
        assert got[f"{name} False"] == [0, 0, 0], name
        # the timer and the cycles read at each of the four stamps, the SM once
        assert got[f"{name} True"] == [4, 4, 1], name


def test_the_bench_prints_the_table_and_a_stretch_from_the_middle_of_the_step(capsys):
    tl = [[f"k{i}", 4, 2, float(i), i + 0.2, i + 1.5, 0.1, 0.5, 0.2] for i in range(40)]
    tl[20][1] = -1  # a launch that did not stamp: not in the stretch
    assert [r[0] for r in step_trace.middle(tl, 4)] == ["k17", "k18", "k19", "k21"]
    kernels = [{"name": "expert_glu_q8", "calls": 48, "programs": 192, "sms": 132,
                "exposed_us": 480.0, "exposed_per_call_us": 10.0, "gap_us": -1.5,
                "span_us": 11.0, "start_spread_us": 2.0, "wait_us": 1.0, "compute_us": 6.0,
                "end_us": 0.5}]
    step_trace.print_trace([
        {"stage": "cuda:0", "step_us": 2370.0, "launches": 40, "traced_span_us": 2300.0,
         "unstamped": ["k20"], "kernels": kernels, "timeline": tl},
        {"stage": "cuda:1", "skipped": "its host layers' experts run between graphs"}])
    out = capsys.readouterr().out.splitlines()
    assert "2370.0 us a step by replay" in out[0] and "every program: k20" in out[0]
    assert out[2].split() == ["trace", "expert_glu_q8", "48", "192", "132", "480.0", "10.00",
                              "-1.50", "11.00", "1.00", "6.00", "0.50"]
    assert "16 launches from the middle" in out[3]
    assert out[4].split()[1:] == ["k11", "4", "2", "0.00", "0.20", "1.50"]
    assert out[-1] == ("   trace cuda:1: not traced (its host layers' experts run between "
                       "graphs)")

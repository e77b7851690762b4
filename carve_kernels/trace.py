"""Timestamps from inside the decode step's kernels: when each program started, got past its
wait on the kernel before (PDL), finished its main loop and ended, and on which SM.

The profiler serializes a CUDA graph's kernels, so it cannot say what a kernel costs in the
step, where launches overlap under PDL (carve_kernels/NOTES.md, "What a launch is worth"). These
stamps are taken in the step itself: `recording` hands every instrumented launch made inside it
(a decode step being captured, say) rows of one int64 buffer, a row per program; a replay fills
them. `carve bench --trace` prints what they say (`summary`).

A row: ``[t_start, t_waited, t_computed, t_done, sm, c_start, c_waited, c_computed, c_done]``:
the times from the GPU's global nanosecond timer (common to all SMs; its ticks may be coarser
than a nanosecond), the SM, and the SM's cycle counter at the same four points. The timeline
(starts, ends, gaps) comes from the timer; a program's phases from its cycles, in nanoseconds
at the rate the whole recording's programs ran (timer over cycles, start to end).

A kernel takes ``trace_ptr`` and the constexpr ``TRACE`` (`args`) and calls
``stamp(trace_ptr, AT, TRACE)`` at AT = START, WAITED, COMPUTED, DONE (``wait`` stamps the
first two around the kernel's PDL wait); with TRACE off (every
launch outside a recording) the stamps compile to nothing. A recording on the CPU (the
interpreter, which has no timers) stamps each point's number instead (TRACE 2): no times, but
which launches, how many programs, and that every program reached every stamp.
The timer reads are not pure, so the compiler keeps each one and their order, but it may move
other instructions across them (a main loop's last sums past COMPUTED, say): the boundaries
between a program's phases are approximate to the width of what moved, its first and last
stamps (START, DONE) much less so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from carve_kernels import pdl

ROW = 16  # int64 a program (9 used)
_ROW = tl.constexpr(ROW)
START, WAITED, COMPUTED, DONE, SM, CLOCK = 0, 1, 2, 3, 4, 5  # a row's columns (CLOCK + AT)
PHASES = ("wait", "compute", "end")  # WAITED - START, COMPUTED - WAITED, DONE - COMPUTED
_SM = tl.constexpr(SM)
_CLOCK = tl.constexpr(CLOCK)


@dataclass
class Recorder:
    """The stamps' buffer on one device and the launches that took rows of it, in order:
    (kernel name, first row, programs)."""

    buf: torch.Tensor
    used: int = 0
    launches: list[tuple[str, int, int]] = field(default_factory=list)

    def take(self, name: str, programs: int) -> torch.Tensor:
        if self.used + programs > self.buf.shape[0]:
            raise ValueError(f"the trace buffer holds {self.buf.shape[0]} programs; "
                             f"{name} needs {programs} more after {self.used}")
        row = self.used
        self.launches.append((name, row, programs))
        self.used += programs
        return self.buf[row:]


_ACTIVE: list[Recorder] = []


@contextlib.contextmanager
def recording(device: torch.device, programs: int = 1 << 20) -> Iterator[Recorder]:
    """Launches of instrumented kernels on ``device`` inside this block are traced, each into
    rows of one buffer of ``programs`` rows (zeros until a run fills them)."""
    rec = Recorder(torch.zeros(programs, ROW, dtype=torch.int64, device=device))
    _ACTIVE.append(rec)
    try:
        yield rec
    finally:
        _ACTIVE.remove(rec)


def args(name: str, grid: tuple[int, ...], like: torch.Tensor,
         parts: tuple[tuple[str, int], ...] = ()) -> dict:
    """The ``trace_ptr`` and ``TRACE`` arguments of a launch of kernel ``name`` over ``grid``
    that writes ``like``: rows of the recording's buffer inside `recording` (on that device),
    else TRACE off (``like`` stands in for the pointer, never read). ``parts``: a kernel whose
    programs do different work in runs of program ids, each run recorded as a launch of its
    own name (the runs' programs in order, adding up to the grid's)."""
    for rec in _ACTIVE:
        if rec.buf.device == like.device:
            programs = 1
            for g in grid:
                programs *= int(g)
            mode = 1 if like.is_cuda else 2  # the GPU's timers, or the interpreter's order
            if not parts:
                return {"trace_ptr": rec.take(name, programs), "TRACE": mode}
            if sum(n for _, n in parts) != programs:
                raise ValueError(f"{name}: the parts' programs do not add up to {programs}")
            views = [rec.take(part, n) for part, n in parts]
            return {"trace_ptr": views[0], "TRACE": mode}
    return {"trace_ptr": like, "TRACE": False}


@triton.jit
def stamp(trace_ptr, AT: tl.constexpr, TRACE: tl.constexpr):
    if TRACE:
        pid = ((tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0)
               + tl.program_id(0))
        row = trace_ptr + pid.to(tl.int64) * _ROW
        if TRACE == 2:  # the interpreter: the point's number, as time and cycles (SM 0)
            tl.store(row + AT, tl.full([], AT + 1, tl.int64))
            tl.store(row + _CLOCK + AT, tl.full([], AT + 1, tl.int64))
        else:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [],
                                            dtype=tl.int64, is_pure=False, pack=1)
            clk = tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l", [], dtype=tl.int64,
                                            is_pure=False, pack=1)
            tl.store(row + AT, now)
            tl.store(row + _CLOCK + AT, clk)
            if AT == 0:
                sm = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                               is_pure=True, pack=1)
                tl.store(row + _SM, sm.to(tl.int64))


@triton.jit
def wait(trace_ptr, PDL: tl.constexpr, TRACE: tl.constexpr, LATE: tl.constexpr = False):
    # a kernel's start: stamp START, wait for the kernel before (carve_kernels/pdl.py), stamp
    # WAITED (where PDL is off, the two stamps are one moment). LATE: the kernel releases the
    # next one itself later (pdl.release), not here
    stamp(trace_ptr, 0, TRACE)
    if LATE:
        pdl.wait(PDL)
    else:
        pdl.start(PDL)
    stamp(trace_ptr, 1, TRACE)


@dataclass
class Launch:
    """One traced launch's programs, times in microseconds from the traced run's first stamp."""

    name: str
    programs: int
    sms: int  # distinct SMs its programs ran on
    first_start: float
    last_start: float
    last_done: float
    phases: dict[str, float]  # mean microseconds of each phase (PHASES) over its programs
    exposed: float = 0.0  # last_done minus the launch before's last_done (the first: from 0)
    gap: float = 0.0  # first_start minus the launch before's last_done (< 0: overlapped it)


def launches(rec: Recorder) -> list[Launch]:
    """The recording's launches as their last run stamped them, in launch order. A launch
    whose programs did not all stamp (a kernel that returned early, or never ran) has
    programs -1 and no place in the timeline."""
    rows = rec.buf[:rec.used].cpu()
    # each launch's rows, None where a program missed a stamp
    stamped = [(name, None if bool((r[:, :4] == 0).any()) else r)
               for name, r in ((name, rows[row:row + n]) for name, row, n in rec.launches)]
    whole = [r for _, r in stamped if r is not None]
    if not whole:
        return [Launch(name, -1, 0, 0.0, 0.0, 0.0, {}) for name, _ in stamped]
    t0 = min(int(r[:, START].min()) for r in whole)
    # nanoseconds a cycle: the programs' timer spans over their cycle spans, all together
    ns = sum(float((r[:, DONE] - r[:, START]).sum()) for r in whole)
    cycles = sum(float((r[:, CLOCK + DONE] - r[:, CLOCK + START]).sum()) for r in whole)
    per_cycle = ns / cycles if cycles > 0 else 0.0
    out: list[Launch] = []
    prev: Launch | None = None
    for name, r in stamped:
        if r is None:
            out.append(Launch(name, -1, 0, 0.0, 0.0, 0.0, {}))
            continue
        us = (r[:, :4] - t0).double() / 1e3
        c = r[:, CLOCK:CLOCK + 4].double()
        d = ((c[:, 1:4] - c[:, 0:3]) * per_cycle / 1e3 if per_cycle
             else us[:, 1:4] - us[:, 0:3])
        la = Launch(name, r.shape[0], int(r[:, SM].unique().numel()), float(us[:, START].min()),
                    float(us[:, START].max()), float(us[:, DONE].max()),
                    {p: float(d[:, i].mean()) for i, p in enumerate(PHASES)})
        base = prev.last_done if prev is not None else la.first_start
        la.exposed, la.gap = la.last_done - base, la.first_start - base
        out.append(la)
        prev = la
    return out


def summary(timeline: list[Launch]) -> list[dict]:
    """Per kernel name, over a traced step: calls, programs a call, SMs, and the means per call
    of its exposed time (what the step's end moved by), its gap to the launch before, its
    span (first start to last done) and phases; largest exposed total first."""
    by: dict[str, list[Launch]] = {}
    for la in timeline:
        if la.programs > 0:
            by.setdefault(la.name, []).append(la)
    rows = []
    for name, ls in by.items():
        n = len(ls)
        rows.append({
            "name": name, "calls": n, "programs": round(sum(la.programs for la in ls) / n),
            "sms": round(sum(la.sms for la in ls) / n),
            "exposed_us": sum(la.exposed for la in ls),
            "exposed_per_call_us": sum(la.exposed for la in ls) / n,
            "gap_us": sum(la.gap for la in ls) / n,
            "span_us": sum(la.last_done - la.first_start for la in ls) / n,
            "start_spread_us": sum(la.last_start - la.first_start for la in ls) / n,
            **{f"{p}_us": sum(la.phases[p] for la in ls) / n for p in PHASES},
        })
    rows.sort(key=lambda r: -r["exposed_us"])
    return rows

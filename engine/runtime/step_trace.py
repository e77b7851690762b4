"""`carve bench --trace`: one decode step's kernels timed from inside, as the step's CUDA graph
runs them (carve_kernels/trace.py), where the profiler (`--kernels`) serializes the graph and
so cannot say what each launch costs under PDL.

Each stage whose decode step is one graph is captured once more with the instrumented kernels
stamping (a separate graph: the bench's own is left as it was), replayed, and its last replay's
stamps are read back. Per kernel name the table gives the launches a token, the programs and
SMs a launch, and the means per launch of its exposed time (how far it moved the end of the
step: its last program's end minus the launch before's), its gap (its first program's start
minus the launch before's end: negative where PDL let it start early, positive where
something waited: the launch latency, or kernels without stamps in between, such as the
embedding, the sampler and torch's own ops), its span and its programs' phases (waiting on the
kernel before, the main loop, the epilogue and any cross-program sum)."""

from __future__ import annotations

import time
from typing import Any

import torch

REPLAYS = 8
STRETCH = 16  # launches of the timeline printed one by one


def trace_step(pipe: Any, position: int = 64) -> list[dict]:
    """Per stage of ``pipe`` (a GpuPipeline, after the bench): its traced decode step, as a
    dict of the step's time by replay, the traced span, the per-kernel summary and the
    timeline of launches; or why the stage was not traced. A CPU stage (the interpreter) is
    recorded eagerly: its launches and programs, no times."""
    from carve_kernels import trace

    out = []
    for st in pipe.stages:
        if st.eager_hosts():
            out.append({"stage": str(st.device), "skipped": "its host layers' experts run "
                        "between graphs (decode in pieces)"})
            continue
        dev = st.device
        pipe.set_position(position, 1)
        # an eager step first: on a GPU the traced variants compile outside the capture; under
        # the interpreter (no graphs, no timers) it is the recording read below
        with trace.recording(dev) as rec:
            t0 = time.perf_counter()
            st.decode_step()
            _sync(dev)
            step_us = (time.perf_counter() - t0) * 1e6
        if st.on_cuda:
            g = torch.cuda.CUDAGraph()
            with trace.recording(dev) as rec, torch.cuda.graph(g, stream=torch.cuda.Stream(dev)):
                st.decode_step()
            # host layers split between CPU and GPU wait for the host's answers each replay
            pipe.set_position(position, 1)
            g.replay()
            st.answer_split()
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(REPLAYS):
                g.replay()
                st.answer_split()
            _sync(dev)
            step_us = (time.perf_counter() - t0) / REPLAYS * 1e6
            del g
        timeline = trace.launches(rec)
        done = [la for la in timeline if la.programs > 0]
        out.append({
            "stage": str(dev), "step_us": step_us, "launches": len(timeline),
            "traced_span_us": (max(la.last_done for la in done) - min(la.first_start for la in done)
                               if done else 0.0),
            "unstamped": sorted({la.name for la in timeline if la.programs < 0}),
            "kernels": trace.summary(timeline),
            "timeline": [[la.name, la.programs, la.sms, round(la.first_start, 3),
                          round(la.last_start, 3), round(la.last_done, 3),
                          *(round(la.phases.get(p, 0.0), 3) for p in trace.PHASES)]
                         for la in timeline],
        })
        pipe.set_position(position, 1)
    return out


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def print_trace(stages: list[dict]) -> None:
    for s in stages:
        if "skipped" in s:
            print(f"   trace {s['stage']}: not traced ({s['skipped']})")
            continue
        print(f"   trace {s['stage']}: a decode step of {s['launches']} stamped launches, "
              f"{s['step_us']:.1f} us a step by replay, first stamp to last "
              f"{s['traced_span_us']:.1f} us" + (f"; launches that did not stamp every "
                                                 f"program: {', '.join(s['unstamped'])}"
                                                 if s["unstamped"] else ""))
        print("   trace kernel            calls progs  SMs exposed/token  /call    gap   "
              "span   wait compute    end (us)")
        for k in s["kernels"]:
            print(f"   trace {k['name']:<17} {k['calls']:5d} {k['programs']:5d} {k['sms']:4d} "
                  f"{k['exposed_us']:13.1f} {k['exposed_per_call_us']:6.2f} {k['gap_us']:6.2f} "
                  f"{k['span_us']:6.2f} {k['wait_us']:6.2f} {k['compute_us']:7.2f} "
                  f"{k['end_us']:6.2f}")
        stretch = middle(s["timeline"])
        if stretch:
            t0 = stretch[0][3]
            print(f"   trace {len(stretch)} launches from the middle of the step (us from the "
                  "first's start): kernel, programs, SMs, first start, last start, last end")
            for name, progs, sms, first, last, done, *_ in stretch:
                print(f"   trace   {name:<17} {progs:5d} {sms:4d} {first - t0:8.2f} "
                      f"{last - t0:8.2f} {done - t0:8.2f}")


def middle(timeline: list[list], n: int = STRETCH) -> list[list]:
    """``n`` stamped launches from the middle of a step's timeline (about a layer's worth):
    where the launches overlap or wait on each other, launch by launch."""
    done = [la for la in timeline if la[1] > 0]
    mid = max(0, len(done) // 2 - n // 2)
    return done[mid:mid + n]

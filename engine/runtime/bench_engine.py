"""`carve bench --engine`: the speed users get, measured through the engine process exactly as
the window and `carve chat` drive it (start `carve-engine`, send the plan, generate chat replies,
read the events), printed beside the pipeline figure of the same file.

Prints launch -> loaded split by load stage, each reply's time to first token, prompt t/s (the
engine's Done event) and decode t/s both as the engine reports it and as the client sees the
tokens arrive, for greedy replies and for replies with the default sampling settings.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from engine.process import protocol as p
from engine.process.client import EngineProcess
from spec.errors import CarveError

# about 51 tokens with the Qwen2 chat template; the system line differs per reply so that a
# reply reuses only a few cached tokens of the one before
USER = ("Write a short Python function that returns the n-th Fibonacci number iteratively, "
        "and explain in one sentence why the loop is faster than the recursion.")


def _messages(i: int) -> list[dict]:
    return [{"role": "system", "content": f"Reply {i}: you are a terse assistant."},
            {"role": "user", "content": USER}]


def _followup(i: int) -> list[dict]:
    """Reply i's conversation one short turn on: what the engine has cached of it up to the
    assistant's answer is reused, so about 20 tokens are new (a chat's usual next turn)."""
    return _messages(i) + [{"role": "assistant", "content": "Done."},
                           {"role": "user", "content": "Now in one line, please."}]


def _load(engine: EngineProcess, plan: Any, timeout: float) -> dict:
    """Send the plan; seconds per load stage (first to last progress event) and in all."""
    t0 = time.perf_counter()
    engine.send(p.Load(plan.to_json()))
    stages: dict[str, list[float]] = {}
    while True:
        ev = engine.wait_for(p.Progress, p.Loaded, p.Unloaded, timeout=timeout)
        now = time.perf_counter() - t0
        if isinstance(ev, p.Progress):
            span = stages.setdefault(ev.stage, [now, now])
            span[1] = now
        elif isinstance(ev, p.Unloaded):
            raise CarveError("the engine unloaded the model during the load")
        else:
            return {"loaded_s": now, "devices": ev.devices, "timeline": ev.timeline,
                    "stages": {k: v[1] - v[0] for k, v in stages.items()}}


def _reply(engine: EngineProcess, i: int, sampling: dict, max_tokens: int,
           timeout: float, messages: list[dict] | None = None) -> dict:
    t0 = time.perf_counter()
    engine.send(p.Generate(messages or _messages(i), id=f"bench{i}", sampling=sampling,
                           max_tokens=max_tokens))
    arrivals: list[float] = []
    while True:
        ev = engine.wait_for(p.Token, p.Done, timeout=timeout)
        if isinstance(ev, p.Token):
            arrivals.append(time.perf_counter() - t0)
            continue
        seen = (len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 2 else 0.0
        return {"ttft_s": arrivals[0] if arrivals else None, "prompt_tokens": ev.prompt_tokens,
                "tokens": ev.completion_tokens, "reason": ev.reason,
                "prefill_tps": ev.prefill_tps, "decode_tps": ev.decode_tps,
                "client_decode_tps": seen}


def run(plan: Any, replies: int = 10, sampled: int = 3, max_tokens: int = 128,
        timeout: float = 600.0, prestarted: bool = False, followups: int = 0) -> dict:
    """Launch the engine, load ``plan``, then ``replies`` greedy replies and ``sampled`` with
    the default sampling settings, then ``followups`` short next turns, each after a fresh
    conversation's first reply (`_followup`: their time to first token is what a chat's
    next turn waits); the engine process is ended whatever happens.
    ``prestarted``: as the window does, start the engine first and let it import its modules
    (answered by an Unload, which waits for them), then time Launch from the Load request."""
    t0 = time.perf_counter()
    with EngineProcess() as engine:
        engine.wait_for(p.Ready, timeout=timeout)
        out: dict = {"ready_s": time.perf_counter() - t0, "prestarted": prestarted}
        if prestarted:
            engine.send(p.Unload())
            engine.wait_for(p.Unloaded, timeout=timeout)
            out["preloaded_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
        load = _load(engine, plan, timeout)
        out.update(load, launch_to_loaded_s=time.perf_counter() - t0)
        greedy = {"temperature": 0.0, "seed": 1}
        out["greedy"] = [_reply(engine, i, greedy, max_tokens, timeout) for i in range(replies)]
        out["sampled"] = [_reply(engine, replies + i, {"seed": 7 + i}, max_tokens, timeout)
                          for i in range(sampled)]
        out["followup"] = []
        for i in range(replies + sampled, replies + sampled + followups):
            _reply(engine, i, greedy, 16, timeout)
            out["followup"].append(_reply(engine, i, greedy, 16, timeout, _followup(i)))
    return out


def summary(out: dict) -> dict:
    g, s = out["greedy"], out["sampled"]
    later = g[1:] or g
    return {
        "launch_to_loaded_s": out["launch_to_loaded_s"],
        "first_prompt_tps": g[0]["prefill_tps"],
        "tenth_prompt_tps": g[-1]["prefill_tps"],
        "first_ttft_s": g[0]["ttft_s"],
        "tenth_ttft_s": g[-1]["ttft_s"],
        "greedy_decode_tps": statistics.median(r["decode_tps"] for r in later),
        "greedy_client_tps": statistics.median(r["client_decode_tps"] for r in later),
        "sampled_decode_tps": statistics.median(r["decode_tps"] for r in s) if s else 0.0,
        "sampled_client_tps": statistics.median(r["client_decode_tps"] for r in s) if s else 0.0,
        "followup_ttft_s": statistics.median(r["ttft_s"] for r in out["followup"])
        if out.get("followup") else None,
    }


def print_timeline(out: dict) -> None:
    """The engine's load marks: seconds since the load request, and each step's share."""
    marks = out.get("timeline") or []
    if not marks:
        return
    steps, prev_t, prev_b = [], 0.0, None
    for m in marks:
        k, v = m[0], m[1]
        b = m[2] if len(m) > 2 else None
        mem = ""
        if b is not None and prev_b is not None and b != prev_b:
            mem = f", GPU {(b - prev_b) / 2**20:+.0f} MiB"
        steps.append(f"{k} {v:.2f} (+{v - prev_t:.2f}{mem})")
        prev_t, prev_b = v, (b if b is not None else prev_b)
    print("   load timeline (s since the load request, +step): " + ", ".join(steps), flush=True)


def print_report(out: dict, pipeline_tps: float | None) -> None:
    sm = summary(out)
    stages = ", ".join(f"{k} {v:.2f} s" for k, v in out["stages"].items())
    print(f"engine process: ready {out['ready_s']:.2f} s, launch -> loaded "
          f"{sm['launch_to_loaded_s']:.2f} s ({stages})", flush=True)
    print_timeline(out)
    for d in out.get("devices", []):
        if d.get("overhead_measured") is not None:
            print(f"   cuda:{d['index']}: priced {d['priced']} B, reserved {d['allocated']} B; "
                  f"overhead priced {d.get('overhead_priced', 0)} B, measured "
                  f"{d['overhead_measured']} B (measured - priced "
                  f"{(d['overhead_measured'] - d.get('overhead_priced', 0)) / 2**20:+.1f} MiB); "
                  f"NVML {d.get('nvml_before')} -> {d.get('nvml_used')} B", flush=True)
    for kind in ("greedy", "sampled", "followup"):
        for i, r in enumerate(out.get(kind, [])):
            ttft = f"{r['ttft_s'] * 1e3:7.1f} ms" if r["ttft_s"] is not None else "     -"
            print(f"   {kind:7s} reply {i + 1:2d}: ttft {ttft}, prompt {r['prompt_tokens']} "
                  f"tokens {r['prefill_tps']:9.0f} t/s, {r['tokens']:3d} tokens ({r['reason']}) "
                  f"decode {r['decode_tps']:7.1f} t/s (client {r['client_decode_tps']:7.1f})")
    ratio = ""
    if pipeline_tps:
        ratio = (f"; engine / pipeline: greedy {sm['greedy_decode_tps'] / pipeline_tps:.3f}, "
                 f"sampled {sm['sampled_decode_tps'] / pipeline_tps:.3f}")
    print(f"decode t/s: pipeline {pipeline_tps or 0:.1f}, engine greedy "
          f"{sm['greedy_decode_tps']:.1f} (client {sm['greedy_client_tps']:.1f}), engine "
          f"sampled {sm['sampled_decode_tps']:.1f} (client {sm['sampled_client_tps']:.1f})"
          f"{ratio}", flush=True)
    first, last = sm["first_prompt_tps"], sm["tenth_prompt_tps"]
    print(f"prompt t/s: first reply {first:.0f}, last reply {last:.0f} "
          f"(first / last {first / max(last, 1e-9):.2f})", flush=True)
    if sm["followup_ttft_s"] is not None:
        print(f"a chat's next short turn (the conversation before it cached): time to first "
              f"token {sm['followup_ttft_s'] * 1e3:.1f} ms (median of {len(out['followup'])})",
              flush=True)


def measure(path: str, ctx: int, kv_type: str, pipeline_tps: float | None,
            placed: Any = None) -> dict:
    """The same file through `carve-engine` on the GPUs here, with the window's default plan;
    ``placed``: the plan of a placement (--vram, --experts-resident, ...) instead, launched
    once (its speed, not the launch times)."""
    from engine.gguf.reader import GGUFModel
    from engine.hardware.rigs import parse_rig
    from engine.planning.defaults import default_plan

    if placed is not None:
        res = run(placed, replies=5, sampled=2, followups=3)
        print_report(res, pipeline_tps)
        return dict(res, summary=summary(res))
    model = GGUFModel.open(path)
    plan = default_plan(model, parse_rig("auto"), ctx=ctx, kv_type=kv_type, model_path=path)
    res = run(plan, followups=3)
    print_report(res, pipeline_tps)
    again = run(plan, replies=1, sampled=0)  # a second launch: kernel cache warm
    print(f"engine process, second launch: launch -> loaded {again['launch_to_loaded_s']:.2f} s "
          f"({', '.join(f'{k} {v:.2f} s' for k, v in again['stages'].items())})", flush=True)
    print_timeline(again)
    # the window starts the engine when a model opens: Launch then pays only for the load
    pre = run(plan, replies=1, sampled=0, prestarted=True)
    print(f"engine process pre-started (as the window does; modules imported in "
          f"{pre['preloaded_s']:.2f} s): Launch -> loaded {pre['launch_to_loaded_s']:.2f} s "
          f"({', '.join(f'{k} {v:.2f} s' for k, v in pre['stages'].items())})", flush=True)
    print_timeline(pre)
    sm = dict(summary(res), warm_launch_to_loaded_s=again["launch_to_loaded_s"],
              prestarted_launch_to_loaded_s=pre["launch_to_loaded_s"])
    return dict(res, summary=sm, second_launch=again, prestarted_launch=pre)

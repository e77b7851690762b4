"""Faults of the engine process as the CLIs' client (EngineProcess) meets them: killed with
SIGKILL mid-load and mid-reply, stopped with SIGSTOP (hung), fed hostile protocol bytes. Each
case ends in one sentence, no process left behind, and a fresh engine that works."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.process import protocol as p
from engine.process.client import EngineExited, EngineProcess
from engine.runtime import server
from spec.errors import CarveError

ROOT = Path(__file__).resolve().parents[2]
FAKE = [sys.executable, str(ROOT / "tests" / "fake_engine.py")]
USER = [{"role": "user", "content": "tell me a long story"}]


def gone(pid: int, within: float = 10.0) -> bool:
    """The process has ended (a zombie not yet reaped counts as ended)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def family(pid: int) -> list[int]:
    return [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]


@pytest.fixture(scope="module")
def tiny_plan(synth_model):
    from app.cli_chat import build_plan

    return build_plan(synth_model("llama"), "cpu", 256, "f16").to_json()


def loaded_engine(plan: dict, **kw) -> EngineProcess:
    engine = EngineProcess(**kw).start()
    engine.wait_for(p.Ready, timeout=60)
    engine.send(p.Load(plan))
    engine.wait_for(p.Loaded, timeout=120)
    return engine


def test_killed_mid_reply_then_a_fresh_engine_answers_survives_hostile_bytes_and_is_stopped(
        tiny_plan, seed):
    # one relaunched engine takes every later blow: fewer engine starts keep CI time down
    engine = loaded_engine(tiny_plan)
    try:
        engine.send(p.Generate(USER, "g1", {"temperature": 1.0, "seed": 1}, 200))
        engine.wait_for(p.Token, timeout=60)
        pids = family(engine.pid)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineExited, match=r"^the engine process exited \(status -9\)"):
            while True:  # the tokens already written come first, then the end
                assert not isinstance(engine.wait_for(p.Token, p.Done, timeout=30), p.Done)
        assert all(gone(pid) for pid in pids)
    finally:
        engine.close()
    with loaded_engine(tiny_plan, silence_limit=3.0) as again:  # a relaunch of the plan works
        again.send(p.Generate(USER, "g2", {"seed": 1}, 3))
        assert again.wait_for(p.Done, timeout=120).completion_tokens >= 1
        hostile_bytes_get_errors_and_the_engine_serves_on(again, random.Random(seed))
        a_bad_plan_gets_a_sentence(again, tiny_plan)
        a_stopped_engine_is_noticed_killed_and_named(again)


@pytest.mark.demo
def test_killed_mid_load_says_so_and_leaves_nothing(demo_model_path):
    # the demo model's load takes seconds of progress events: a kill after the second one
    # lands inside the load (the tiny model loads faster than a kill can be aimed)
    from app.cli_chat import build_plan

    plan = build_plan(Path(demo_model_path), "cpu", 256, "f16").to_json()
    with EngineProcess() as engine:
        engine.wait_for(p.Ready, timeout=60)
        engine.send(p.Load(plan))
        engine.wait_for(p.Progress, timeout=120)
        engine.wait_for(p.Progress, timeout=120)
        pids = family(engine.pid)
        os.kill(engine.pid, signal.SIGKILL)
        with pytest.raises(EngineExited, match=r"exited \(status -9\)"):
            while True:
                assert not isinstance(engine.wait_for(p.Progress, p.Loaded, timeout=30), p.Loaded)
    assert all(gone(pid) for pid in pids)


def a_stopped_engine_is_noticed_killed_and_named(engine: EngineProcess) -> None:
    engine.send(p.Generate(USER, "g", {"temperature": 1.0}, 200))
    engine.wait_for(p.Token, timeout=60)
    os.kill(engine.pid, signal.SIGSTOP)  # frozen: no tokens, no heartbeat, no exit
    t = time.monotonic()
    with pytest.raises(EngineExited, match=r"stopped answering \(nothing for \d+ s"):
        while True:
            engine.wait_for(p.Token, p.Done, timeout=60)
    assert time.monotonic() - t < engine.silence_limit + 5  # the limit, the watcher's step, slack
    assert gone(engine.pid)


def test_a_stopped_engine_is_noticed_while_idle_at_the_next_request():
    with EngineProcess(FAKE + ["normal"], silence_limit=1.0) as engine:
        engine.wait_for(p.Ready, timeout=30)
        os.kill(engine.pid, signal.SIGSTOP)
        time.sleep(2.0)  # idle: nobody waits, so silence is no sign of anything
        assert engine.alive()
        engine.send(p.Tokenize("hi"))
        with pytest.raises(EngineExited, match="stopped answering"):
            engine.wait_for(p.Tokens, timeout=30)
        assert gone(engine.pid)


def test_alive_events_keep_a_long_silent_step_from_being_taken_for_a_hang():
    env = {**os.environ, "CARVE_FAKE_SLOW": "3"}
    with EngineProcess(FAKE + ["slow-load"], env=env, silence_limit=1.0) as engine:
        engine.wait_for(p.Ready, timeout=30)
        engine.send(p.Load({}))
        loaded = engine.wait_for(p.Loaded, p.Progress, timeout=30)
        assert engine.alive()  # 3 s with only alive events (kept from the caller) passed
        assert isinstance(loaded, p.Progress)


def test_the_engine_heartbeat_speaks_only_while_a_request_runs():
    r, w = os.pipe()
    engine = server.Engine(os.fdopen(w, "wb"))
    beat = __import__("threading").Thread(target=engine.heartbeat, args=(0.05,), daemon=True)
    beat.start()
    time.sleep(0.3)
    engine._busy = True
    time.sleep(0.4)
    engine._busy = False
    time.sleep(0.2)  # a beat decided before the flag dropped may still go out
    engine.request_exit("test")
    engine._served.set()
    beat.join(2)
    os.set_blocking(r, False)
    events = p.LineDecoder(p.EVENTS).feed(os.read(r, 1 << 16))
    os.close(r)
    assert 3 <= len(events) <= 10 and all(isinstance(e, p.Alive) for e in events)


# ------------------------------------------------------------------ hostile protocol input


def _random_lines(rng: random.Random) -> list[bytes]:
    """Random bytes, partial and huge lines, valid JSON of the wrong shape."""
    wrong = [
        {"v": 1, "type": "generate", "messages": "not a list"},
        {"v": 1, "type": "generate", "messages": [{"role": 3, "content": None}], "id": 7},
        {"v": 1, "type": "load", "plan": [1, 2]},
        {"v": 1, "type": "load", "plan": {"model": 5, "devices": "x"}},
        {"v": 1, "type": "tokenize", "text": {"a": 1}},
        {"v": 1, "type": "tokenize", "text": "x", "model": "/nonexistent/m.gguf"},
        {"v": 1, "type": "perplexity", "text": "x", "ctx": -5},
        {"v": 1, "type": "generate", "messages": [], "sampling": {"temperature": "hot"}},
        {"v": True, "type": "stop"}, {"v": 1, "type": None}, [1, 2, 3], "text", 1e308, None,
        {"v": 1, "type": "generate", "messages": [{"role": "user", "content": "x"}],
         "sampling": {"top_k": -1, "nonsense": 1}, "max_tokens": -3},
    ]
    import json

    lines = [json.dumps(x).encode() for x in wrong]
    for _ in range(40):
        lines.append(bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200))).replace(b"\n", b""))
    lines.append(b"{" * 100_000)  # deep nesting
    lines.append(b'{"v": 1, "type": "tokenize", "text": "' + b"a" * (p.MAX_LINE + 10) + b'"}')
    rng.shuffle(lines)
    return lines


def hostile_bytes_get_errors_and_the_engine_serves_on(engine: EngineProcess,
                                                     rng: random.Random) -> None:
    lines = _random_lines(rng)
    blob = b"\n".join(lines) + b"\n"
    with engine._write_lock:  # raw bytes, cut at random places, as a broken writer sends
        at = 0
        while at < len(blob):
            n = rng.choice([1, 7, 4096, 1 << 20])
            engine.proc.stdin.write(blob[at:at + n])
            engine.proc.stdin.flush()
            at += n
    engine.send(p.Tokenize("still here", model="/nonexistent/still-here.gguf"))
    errors = []
    while True:
        ev = engine.next_event(timeout=120)
        assert ev is not None, "the engine stopped answering"
        assert isinstance(ev, p.Error), ev
        assert "\n" not in ev.message and not ev.fatal
        errors.append(ev.message)
        if "still-here.gguf" in ev.message:
            break
    assert len(errors) >= len([x for x in lines if x.strip()]) // 2
    assert not any("internal error" in m for m in errors), errors
    assert engine.alive()
    assert psutil.Process(engine.pid).memory_info().rss < 1 << 30  # a 32 MiB line is not kept


def a_bad_plan_gets_a_sentence(engine: EngineProcess, plan: dict) -> None:
    engine.send(p.Load(dict(plan, model="/nonexistent/model.gguf")))
    with pytest.raises(CarveError, match="nonexistent/model.gguf: no such file"):
        engine.wait_for(p.Loaded, timeout=120)
    # a load frees the model before it reads the new plan (one model at a time): load again
    engine.send(p.Load(plan))
    engine.wait_for(p.Loaded, timeout=120)
    engine.send(p.Generate(USER, "after", {"seed": 1}, 2))
    assert engine.wait_for(p.Done, timeout=120).request == "after"

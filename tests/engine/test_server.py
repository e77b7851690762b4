"""carve-engine: bad lines answered and survived, EOF / shutdown / parent death end it, stdout
carries only protocol lines, stop and unload cancel exactly what they should, and (with the demo
model) a real load + streamed reply over the pipe."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from engine.process import protocol as p
from engine.process.client import EngineProcess
from engine.runtime import replies, server
from spec.errors import CarveError

ROOT = Path(__file__).resolve().parents[2]
ENGINE = [sys.executable, "-m", "engine.runtime.server"]


def _spawn(**kw) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(ENGINE, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)  # fmt: skip


def _events(raw: bytes) -> list:
    items = p.LineDecoder(p.EVENTS).feed(raw)
    assert not any(isinstance(i, p.ProtocolError) for i in items), items
    return items


# ------------------------------------------------------------------ the real process, no model


def test_bad_lines_get_errors_then_shutdown():
    proc = _spawn()
    good_then_bad = (
        b"not json\n"
        b'{"v": 1, "type": "explode"}\n{"v": 9, "type": "stop"}\n'  # two in one write
        b"\xff\xfe\n"
        b'{"v": 1, "type": "load"}\n'
        b'{"v": 1, "type": "tokenize", "text": "hi"}\n'  # valid, but nothing is loaded
        b'{"v": 1, "type": "gene'  # half a message ...
    )
    proc.stdin.write(good_then_bad)
    proc.stdin.flush()
    time.sleep(0.2)
    proc.stdin.write(b'rate", "messages": [{"role": "user", "content": "x"}], "id": "g7"}\n')
    proc.stdin.write(p.encode(p.Unload()) + p.encode(p.Shutdown()))
    proc.stdin.flush()
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err.decode()
    events = _events(out)
    assert isinstance(events[0], p.Ready) and events[0].pid == proc.pid
    errors = [e for e in events if isinstance(e, p.Error)]
    assert [e.message.split(":")[0] for e in errors[:5]] == ["bad request"] * 5
    assert "unknown message type 'explode'" in errors[1].message
    assert "protocol version 9" in errors[2].message
    assert "UTF-8" in errors[3].message
    assert "needs field 'plan'" in errors[4].message
    assert errors[5].message.startswith("tokenize: no model is loaded")
    assert (
        errors[6].message.startswith("generate: no model is loaded") and errors[6].request == "g7"
    )
    assert not any(e.fatal for e in errors)
    assert isinstance(events[-1], p.Unloaded)  # still serving after all of that
    assert all("\n" not in e.message for e in errors)
    assert b"Traceback" not in err  # user errors are not crashes


def test_eof_on_stdin_ends_the_engine():
    proc = _spawn()
    assert p.decode_line(proc.stdout.readline().strip(), p.EVENTS) == p.Ready(pid=proc.pid)
    proc.stdin.close()
    assert proc.wait(timeout=15) == 0
    assert b"stdin closed" in proc.stderr.read()


def test_parent_death_ends_the_engine(tmp_path):
    # The engine's stdin stays open (this test holds the pipe): only the getppid watchdog can
    # notice that the process which started it is gone.
    r, w = os.pipe()
    middle = (
        "import subprocess, sys\n"
        f"e = subprocess.Popen({ENGINE!r}, stdin={r}, stdout=subprocess.DEVNULL,"
        f" stderr=open({str(tmp_path / 'log')!r}, 'wb'), cwd={str(ROOT)!r})\n"
        "print(e.pid, flush=True)\n"
        "import time; time.sleep(2)\n"  # the engine is up and watching by now
    )
    out = subprocess.run([sys.executable, "-c", middle], pass_fds=(r,), capture_output=True, check=False,
                         text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    os.close(r)
    pid = int(out.stdout.split()[0])
    try:
        deadline = time.monotonic() + 20
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), "engine outlived its parent"
        assert "parent process" in (tmp_path / "log").read_text()
    finally:
        os.close(w)
        if _alive(pid):
            os.kill(pid, 9)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_stdout_carries_only_protocol_lines():
    code = (
        "import os, sys\n"
        "from engine.runtime.server import take_stdout\n"
        "out = take_stdout()\n"
        "print('a stray print')\n"
        "os.write(1, b'a C library writing to fd 1\\n')\n"
        "out.write(b'PROTOCOL\\n'); out.flush()\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, cwd=ROOT, timeout=60,
                         check=False)  # fmt: skip
    assert res.stdout == b"PROTOCOL\n"
    assert b"a stray print" in res.stderr and b"C library" in res.stderr


def test_engine_sets_pci_bus_order_before_torch():
    code = "import engine.runtime.server, os, sys; print(os.environ['CUDA_DEVICE_ORDER'], 'torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False,
                         env={k: v for k, v in os.environ.items() if k != "CUDA_DEVICE_ORDER"})  # fmt: skip
    assert res.stdout.split() == ["PCI_BUS_ID", "False"]


def test_one_line():
    assert replies.one_line(CarveError("model.gguf:  bad\n  thing")) == "model.gguf: bad thing"
    assert replies.one_line(RuntimeError("x\ny")) == "internal error: RuntimeError: x y"
    assert len(replies.one_line(ValueError("z" * 5000))) < 330
    assert replies.safe_text("ok \ud800 end") == "ok ? end"
    assert replies.is_fatal(RuntimeError("CUDA error: an illegal memory access was encountered"))
    assert not replies.is_fatal(RuntimeError("CUDA error: out of memory"))
    assert not replies.is_fatal(CarveError("GPU 0: does not fit"))


# ------------------------------------------------------------------ the worker, with a fake session


@dataclass
class Stats:
    prompt_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    reason: str


class FakeTokenizer:
    bos_id, eos_id, eot_ids, add_bos = 1, 2, {3}, True

    def encode(self, text, add_bos=None, parse_special=True):
        return [1, 1] + list(text.encode())  # the template wrote BOS and so did add_bos

    def stream_decoder(self):
        pieces = iter(["h", "é", "\ud83d", "llo"])  # one piece is a lone surrogate
        return types.SimpleNamespace(push=lambda _id: next(pieces, "x"))


class FakeSession:
    """Generates token 100, 101, ... with a short sleep; raises on a prompt containing 'boom'."""

    instances: ClassVar[list] = []

    def __init__(self) -> None:
        self.model = object()
        self.layout = types.SimpleNamespace(plan=types.SimpleNamespace(ctx=200))
        self.closed = False
        self.prompts: list[list[int]] = []
        self.options = None  # the RunnerOptions the engine loaded it with
        FakeSession.instances.append(self)

    @classmethod
    def load(cls, plan, on_progress=None, cancelled=None, options=None):
        for i in range(50):
            if cancelled():
                raise CarveError("load cancelled")
            on_progress("weights", i + 1, 50, 1e6)
            time.sleep(0.01)
        sess = cls()
        sess.options = options
        return sess

    def memory_report(self):
        return [{"index": -1, "name": "CPU", "priced": 10, "allocated": 10, "nvml_used": 0}]

    def generate(self, ids, params, stop_ids, on_token):
        self.prompts.append(ids)
        if b"boom" in bytes(i for i in ids if i < 256):
            raise RuntimeError("boom\nsecond line")
        n = 0
        for i in range(params.max_tokens):
            time.sleep(0.005)
            n += 1
            if not on_token(100 + i):
                return Stats(len(ids), n, 0.1, 0.2, "cancelled")
        return Stats(len(ids), n, 0.1, 0.2, "length")

    def close(self) -> None:
        self.closed = True


class Harness:
    """An Engine in this process, fed and read through real pipes."""

    def __init__(self, monkeypatch) -> None:
        fake_template = types.ModuleType("engine.text.chat_template")
        fake_template.render_chat = lambda model, messages: (messages[-1]["content"], "no template")
        fake_runtime = types.ModuleType("engine.runtime.session")
        fake_runtime.Session = FakeSession
        monkeypatch.setitem(sys.modules, "engine.text.chat_template", fake_template)
        monkeypatch.setitem(sys.modules, "engine.runtime.session", fake_runtime)
        monkeypatch.setattr(server.Engine, "_tokenizer", lambda self, s: FakeTokenizer())
        monkeypatch.setattr(server, "EXIT_GRACE", 30.0)
        in_r, self.in_w = os.pipe()
        out_r, out_w = os.pipe()
        self.engine = server.Engine(os.fdopen(out_w, "wb"))
        self.out = os.fdopen(out_r, "rb")
        self.decoder = p.LineDecoder(p.EVENTS)
        self.pending: list = []
        threading.Thread(target=self.engine.read_requests, args=(in_r,), daemon=True).start()
        self.worker = threading.Thread(target=self.engine.serve, daemon=True)
        self.worker.start()

    def send(self, *msgs: p.Request) -> None:
        os.write(self.in_w, b"".join(p.encode(m) for m in msgs))

    def next(self):
        while not self.pending:
            chunk = self.out.read1(65536)
            assert chunk, "engine closed its output"
            self.pending += self.decoder.feed(chunk)
        return self.pending.pop(0)

    def until(self, kind):
        seen = []
        while not isinstance(ev := self.next(), kind):
            seen.append(ev)
        return ev, seen

    def close(self) -> None:
        os.close(self.in_w)  # EOF
        self.worker.join(10)
        assert not self.worker.is_alive()


@pytest.fixture
def harness(monkeypatch):
    FakeSession.instances.clear()
    h = Harness(monkeypatch)
    yield h
    h.close()


def _plan_json() -> dict:
    from engine.hardware.devices import DeviceSpec
    from engine.planning.plan import Plan

    cpu = DeviceSpec(index=-1, name="CPU", total=1 << 34, free=1 << 33)
    return Plan(model="m.gguf", devices=(cpu,), split=(0, 2), ctx=200).to_json()


def test_load_reports_progress_then_loaded(harness):
    harness.send(p.Load(_plan_json()))
    loaded, seen = harness.until(p.Loaded)
    assert loaded.devices[0]["allocated"] == 10
    assert seen and all(isinstance(e, p.Progress) for e in seen)
    # the tokenizer is built at load, as the last stage: its start and its end go out
    assert [(e.stage, e.done, e.total) for e in seen[-2:]] == [(p.TOKENIZER, 0, 1),
                                                              (p.TOKENIZER, 1, 1)]
    loading = seen[:-2]
    assert loading[-1].done == loading[-1].total == 50  # the last one goes, however throttled
    assert len(loading) < 50  # throttled: not one event per callback
    assert harness.engine.session is FakeSession.instances[-1]
    assert harness.engine.session.options is harness.engine.options  # read once, passed down


def test_unload_during_load_cancels_and_frees(harness):
    harness.send(p.Load(_plan_json()))
    assert isinstance(harness.next(), p.Progress)
    harness.send(p.Unload())
    _, seen = harness.until(p.Unloaded)
    assert not any(isinstance(e, (p.Loaded, p.Error)) for e in seen)
    assert harness.engine.session is None
    assert not FakeSession.instances  # load raised before building a session


def test_a_new_load_supersedes_one_in_progress(harness):
    harness.send(p.Load(_plan_json()), p.Load(_plan_json()))
    _, before = harness.until(p.Unloaded)  # the first one, cancelled
    assert not any(isinstance(e, p.Loaded) for e in before)
    harness.until(p.Loaded)
    assert len(FakeSession.instances) == 1 and harness.engine.session is FakeSession.instances[0]


def test_generate_streams_valid_text_then_done(harness):
    harness.engine.session = FakeSession()
    msgs = [{"role": "user", "content": "hi"}]
    harness.send(p.Generate(msgs, "g1", {"temperature": 0.0}, 4))
    note = harness.next()
    assert note == p.Note("no template")
    done, tokens = harness.until(p.Done)
    assert [t.text for t in tokens] == ["h", "é", "?", "llo"]  # the lone surrogate replaced
    assert [t.id for t in tokens] == [100, 101, 102, 103]
    assert (done.reason, done.completion_tokens, done.request) == ("length", 4, "g1")
    assert done.decode_tps == pytest.approx(4 / 0.2)
    assert harness.engine.session.prompts[0][:2] == [1, ord("h")]  # the doubled BOS is dropped


def test_profile_hooks_write_the_load_and_only_the_first_reply(harness, monkeypatch, tmp_path):
    # CARVE_PROFILE_LOAD / CARVE_PROFILE_REPLY: a cProfile of the load and of the first reply
    # (what it pays that later replies do not), each written where the variable points
    import pstats

    load_prof, reply_prof = tmp_path / "load.prof", tmp_path / "reply.prof"
    monkeypatch.setenv("CARVE_PROFILE_LOAD", str(load_prof))
    monkeypatch.setenv("CARVE_PROFILE_REPLY", str(reply_prof))

    def settled() -> None:  # requests run in order: a later one's answer means it is written
        harness.send(p.Tokenize("x"))
        harness.until(p.Tokens)

    harness.send(p.Load(_plan_json()))
    harness.until(p.Loaded)
    settled()
    assert load_prof.exists() and not reply_prof.exists()
    msgs = [{"role": "user", "content": "hi"}]
    for i in range(2):
        harness.send(p.Generate(msgs, f"g{i}", {"temperature": 0.0}, 4))
        harness.until(p.Done)
        settled()
        if i == 0:
            funcs = {f[2] for f in pstats.Stats(str(reply_prof)).stats}
            assert "generate" in funcs  # the reply itself was profiled
            reply_prof.unlink()
    assert not reply_prof.exists()  # the second reply is not


def test_stop_ends_generation_within_one_token(harness):
    harness.engine.session = FakeSession()
    harness.send(p.Generate([{"role": "user", "content": "hi"}], "long", {}, 100_000))
    harness.until(p.Token)
    harness.send(p.Stop())
    sent_stop = time.monotonic()
    done, _ = harness.until(p.Done)
    assert done.reason == "cancelled" and done.request == "long"
    assert time.monotonic() - sent_stop < 2
    assert done.completion_tokens < 100_000


def test_stop_right_after_generate_cancels_it_but_not_the_next(harness):
    harness.engine.session = FakeSession()
    gen = p.Generate([{"role": "user", "content": "hi"}], "a", {}, 50)
    harness.send(gen, p.Stop(), p.Generate(gen.messages, "b", {}, 5))  # one write
    first, _ = harness.until(p.Done)
    second, _ = harness.until(p.Done)
    assert (first.request, first.reason, first.completion_tokens) == ("a", "cancelled", 1)
    assert (second.request, second.reason, second.completion_tokens) == ("b", "length", 5)


def test_request_errors_are_one_line_and_the_engine_serves_on(harness):
    harness.engine.session = FakeSession()
    user = {"role": "user", "content": "boom"}
    harness.send(
        p.Generate([user], "x"),  # the session raises
        p.Generate([user], "y", {"temperature": -1}),  # out of range
        p.Generate([user], "z", {"nucleus": 1}),  # unknown setting
        p.Generate([{"role": "user", "content": "  "}], "w"),  # empty prompt
        p.Generate([{"role": "user", "content": "a" * 300}], "v"),  # longer than ctx 200
        p.Generate([{"role": "user", "content": "fine"}], "ok", {}, 2),
    )
    errs = [harness.until(p.Error)[0] for _ in range(5)]
    assert errs[0].message == "internal error: RuntimeError: boom second line"
    assert "temperature" in errs[1].message
    assert "nucleus" in errs[2].message
    assert "empty" in errs[3].message
    assert "301 tokens but the context holds 200" in errs[4].message
    assert [e.request for e in errs] == ["x", "y", "z", "w", "v"]
    done, _ = harness.until(p.Done)
    assert done.request == "ok" and done.completion_tokens == 2


def test_max_tokens_is_clamped_to_the_context(harness):
    harness.engine.session = FakeSession()
    harness.send(p.Generate([{"role": "user", "content": "x" * 190}], "c", {}, 1000))
    done, _ = harness.until(p.Done)
    assert done.completion_tokens == 200 - 191 and done.ctx_used == 200


# ------------------------------------------------------------------ the client, against tests/fake_engine.py

FAKE = [sys.executable, str(ROOT / "tests" / "fake_engine.py")]


def test_client_kills_an_engine_that_ignores_shutdown_eof_and_sigterm():
    engine = EngineProcess([*FAKE, "hang"]).start()
    assert isinstance(engine.next_event(30), p.Ready)
    t = time.monotonic()
    assert engine.close(timeout=0.5) == -9  # shutdown, EOF, SIGTERM all ignored: SIGKILL
    assert time.monotonic() - t < 5
    assert not engine.alive()


def test_client_streams_a_token_flood_and_stops_it():
    with EngineProcess([*FAKE, "flood"]) as engine:
        engine.wait_for(p.Ready, timeout=30)
        engine.send(p.Load({}))
        engine.wait_for(p.Loaded, timeout=30)
        engine.send(p.Generate([{"role": "user", "content": "go"}], "f", {}, 100_000))
        n = 0
        while n < 200:
            n += isinstance(engine.next_event(10), p.Token)
        engine.send(p.Stop())
        t = time.monotonic()
        done = engine.wait_for(p.Done, timeout=10)
        assert time.monotonic() - t < 2
        assert done.reason == "cancelled" and done.completion_tokens >= 200
        assert done.decode_tps > 250  # scripted at 500 t/s
    assert engine.proc.returncode == 0


def test_client_raises_when_the_engine_dies_and_names_its_last_words():
    with EngineProcess([*FAKE, "crash-load"]) as engine:
        engine.send(p.Load({}))
        with pytest.raises(CarveError, match=r"exited \(status 3\).*crashing mid-load"):
            engine.wait_for(p.Loaded, timeout=30)
        with pytest.raises(CarveError):  # and again: the end stays the end
            engine.next_event(1)
        with pytest.raises(CarveError, match="exited"):
            engine.send(p.Stop())


# ------------------------------------------------------------------ end to end, the demo model


@pytest.mark.demo
@pytest.mark.slow
def test_demo_model_load_and_stream_a_reply(demo_model_path):
    pytest.importorskip("engine.runtime.session", reason="engine/runtime/session.py not landed")
    from app.cli_chat import build_plan

    plan = build_plan(Path(demo_model_path), "cpu", 256, "f16")
    with EngineProcess() as engine:
        engine.wait_for(p.Ready, timeout=120)
        # unload during a load cancels it: no loaded event, and the engine serves on
        engine.send(p.Load(plan.to_json()))
        first = engine.wait_for(p.Progress, timeout=300)
        assert 0 < first.total and first.done <= first.total
        engine.send(p.Unload())
        while not isinstance(ev := engine.wait_for(p.Progress, p.Unloaded, p.Loaded), p.Unloaded):
            assert isinstance(ev, p.Progress), "the cancelled load finished anyway"
        engine.send(p.Load(plan.to_json()))
        loaded = engine.wait_for(p.Loaded, timeout=300)
        assert loaded.devices and loaded.devices[0]["allocated"] > 300_000_000
        msgs = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
        engine.send(p.Generate(msgs, "e2e", {"temperature": 0.0}, 16))
        tokens: list[p.Token] = []
        while not isinstance(ev := engine.wait_for(p.Token, p.Done, timeout=300), p.Done):
            tokens.append(ev)
        assert ev.request == "e2e" and ev.reason in ("stop", "length")
        assert 1 <= ev.completion_tokens <= 16 and len(tokens) <= ev.completion_tokens
        reply = "".join(t.text for t in tokens)
        assert reply.strip(), "empty reply"
        reply.encode("utf-8")  # valid text
        assert ev.prompt_tokens > 10 and ev.decode_tps > 0
        # stop within one token: a long generation stopped after its first token
        engine.send(p.Generate(msgs, "stop-me", {"temperature": 0.0}, 200))
        engine.wait_for(p.Token, timeout=300)
        engine.send(p.Stop())
        done = engine.wait_for(p.Done, timeout=300)
        assert done.reason == "cancelled" and done.completion_tokens <= 3
        engine.send(p.Unload())
        engine.wait_for(p.Unloaded, timeout=60)
    assert engine.proc.returncode == 0


# ------------------------------------------------------------------ perplexity arithmetic


class LogitsSession:
    """Deterministic pseudo-random logits per window; records what it was asked."""

    def __init__(self, vocab: int = 50) -> None:
        self.plan = types.SimpleNamespace(ctx=64)
        self.layout = types.SimpleNamespace(plan=self.plan)
        self.vocab = vocab
        self.windows: list[list[int]] = []

    def logits(self, ids):
        import torch

        self.windows.append(list(ids))
        g = torch.Generator().manual_seed(len(self.windows))
        return torch.randn(len(ids), self.vocab, generator=g) * 3


def run_perplexity(session, tok, text, n_ctx, cancelled=lambda: False):
    """The engine's perplexity request on `session`; returns the events it emitted."""
    out = io.BytesIO()
    engine = server.Engine(out)
    engine.session, engine._tok = session, (session, tok)
    try:
        engine.perplexity(p.Perplexity(text, n_ctx), cancelled)
    finally:
        events = p.LineDecoder(p.EVENTS).feed(out.getvalue())
    return events


def test_perplexity_follows_llama_perplexity():
    import numpy as np
    import torch

    tok = types.SimpleNamespace(add_bos=True, bos_id=49,
                                encode=lambda text, parse_special: [ord(c) % 40 for c in text])  # fmt: skip
    text = "the quick brown fox jumps over the lazy dog " * 3  # 132 tokens: 4 windows of 32
    session = LogitsSession()
    results = run_perplexity(session, tok, text, 32)
    assert [(r.chunks, r.total) for r in results] == [(1, 4), (2, 4), (3, 4), (4, 4)]
    ids = tok.encode(text, False)
    nll = []
    for i, window in enumerate(session.windows):
        assert window[0] == 49 and window[1:] == ids[i * 32 + 1 : (i + 1) * 32]  # BOS first
        g = torch.Generator().manual_seed(i + 1)
        logits = torch.randn(32, 50, generator=g) * 3
        target = torch.tensor(ids[i * 32 + 17 : (i + 1) * 32])  # the second half is scored
        nll += torch.nn.functional.cross_entropy(logits[16:31], target, reduction="none").tolist()
    nll = np.array(nll)
    ppl = float(np.exp(nll.mean()))
    assert results[-1].value == pytest.approx(ppl, rel=1e-5)
    assert results[-1].stderr == pytest.approx(ppl * np.sqrt(nll.var() / (len(nll) - 1)), rel=1e-4)
    assert results[0].value == pytest.approx(float(np.exp(nll[:15].mean())), rel=1e-5)


def test_perplexity_needs_two_windows_and_a_context_that_fits():
    tok = types.SimpleNamespace(add_bos=False, bos_id=1, encode=lambda t, parse_special: [5] * 40)
    with pytest.raises(CarveError, match="the text is 40 tokens; perplexity at --ctx 32 needs at least 64"):
        run_perplexity(LogitsSession(), tok, "x", 32)
    with pytest.raises(CarveError, match="--ctx: 128 is larger than the loaded context 64"):
        run_perplexity(LogitsSession(), tok, "x", 128)


def test_perplexity_stops_when_cancelled_after_a_chunk():
    tok = types.SimpleNamespace(add_bos=False, bos_id=1, encode=lambda t, parse_special: [5] * 200)
    session = LogitsSession()
    with pytest.raises(CarveError, match="stopped after 1 of 6 chunks"):
        run_perplexity(session, tok, "x", 32, cancelled=lambda: True)
    assert len(session.windows) == 1

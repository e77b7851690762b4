"""A scripted fake `carve-engine` speaking engine/process/protocol.py, for client and GUI tests.

No torch, no model: it starts in well under a second. Run it as a script:

    python tests/fake_engine.py [SCENARIO]          # or CARVE_FAKE_SCENARIO=SCENARIO

Scenarios (default "normal"):
    normal      ready; load -> 5 progress events (100 MiB total) then loaded (one device);
                generate -> the reply "Hello from the fake engine. You said: <last user text>"
                one word per token (CARVE_FAKE_TOKEN_DELAY seconds apart, default 0.01), then
                done; stop ends it within one token (done reason "cancelled"); tokenize -> the
                text's UTF-8 bytes as ids (+ [1] first when add_bos is not false); perplexity ->
                three perplexity events (value 10, 9, 8); unload -> unloaded; shutdown or EOF
                on stdin -> exit 0; a bad line -> error event, keeps serving.
    load-error  like normal, but load -> error {message: "fake: model does not fit ...",
                fatal: false} and nothing is loaded.
    crash-load  like normal, but load -> two progress events, then the process exits with
                status 3 and no further output (an engine killed mid-load).
    hang        ready, then never answers and never exits by itself: ignores requests, EOF and
                SIGTERM (only SIGKILL or the parent's death end it). For terminate -> kill paths.
    flood       like normal, but generate streams tokens at 500 tokens/s ("tok0 ", "tok1 ", ...)
                until max_tokens (default 2000) or stop. For GUI throttling tests.
    slow-load   like normal, but a load first spends CARVE_FAKE_SLOW seconds (default 2) with
                no progress, sending only alive events (every 0.2 s), as a long compile does.

Every scenario exits when its parent process disappears, so a crashed test leaves no orphan.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.process import protocol as p

SCENARIOS = ("normal", "load-error", "crash-load", "hang", "flood", "slow-load")
FAKE_DEVICE = {"index": 0, "name": "Fake GPU", "priced": 104857600, "allocated": 104857600,
               "nvml_used": 104857600 + (620 << 20)}  # fmt: skip


class FakeEngine:
    def __init__(self, scenario: str) -> None:
        self.scenario = scenario
        self.out = sys.stdout.buffer
        self.lock = threading.Lock()
        self.requests: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.loaded = False

    def emit(self, msg: p.Message) -> None:
        with self.lock:
            self.out.write(p.encode(msg))
            self.out.flush()

    def read_stdin(self) -> None:
        decoder = p.LineDecoder(p.REQUESTS)
        while chunk := os.read(0, 65536):
            for item in decoder.feed(chunk):
                if isinstance(item, (p.Stop, p.Unload, p.Shutdown)):
                    self.stop.set()  # cancels whatever runs now, as the real engine does
                self.requests.put(item)
        self.requests.put(None)  # EOF

    def run(self) -> int:
        self.emit(p.Ready(pid=os.getpid()))
        if self.scenario == "hang":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:
                time.sleep(3600)
        threading.Thread(target=self.read_stdin, daemon=True).start()
        while True:
            item = self.requests.get()
            if item is None or isinstance(item, p.Shutdown):
                return 0
            if isinstance(item, p.ProtocolError):
                self.emit(p.Error(f"bad request: {item.message}"))
            elif isinstance(item, p.Stop):
                self.stop.clear()
            elif isinstance(item, p.Unload):
                self.stop.clear()
                self.loaded = False
                self.emit(p.Unloaded())
            elif isinstance(item, p.Load):
                self.load()  # a stop sent after this load (set by the reader) cancels it
            elif isinstance(item, p.Generate):
                self.generate(item)
            elif isinstance(item, p.Tokenize):
                bos = [] if item.add_bos is False else [1]
                self.emit(p.Tokens(bos + list(item.text.encode("utf-8"))))
            elif isinstance(item, p.Perplexity):
                for i, value in enumerate((10.0, 9.0, 8.0)):
                    self.emit(p.PerplexityResult(value, 0.5, i + 1, 3))

    def load(self) -> None:
        total = 100 << 20
        if self.scenario == "slow-load":
            end = time.monotonic() + float(os.environ.get("CARVE_FAKE_SLOW", "2"))
            while time.monotonic() < end:
                time.sleep(0.2)
                self.emit(p.Alive())
        steps = 2 if self.scenario == "crash-load" else 5
        for i in range(1, steps + 1):
            if self.stop.is_set():
                self.emit(p.Unloaded())
                return
            time.sleep(0.02)
            self.emit(p.Progress("weights", total * i // 5, total, 1e9))
        if self.scenario == "crash-load":
            print("fake engine: crashing mid-load", file=sys.stderr, flush=True)
            os._exit(3)
        if self.scenario == "load-error":
            self.emit(p.Error("fake: model does not fit on GPU 0 (Fake GPU): lower the context"))
            return
        self.loaded = True
        self.emit(p.Loaded([FAKE_DEVICE]))

    def generate(self, req: p.Generate) -> None:
        if not self.loaded:
            self.emit(p.Error("no model loaded: send load first", request=req.id))
            return
        max_tokens = req.max_tokens or (2000 if self.scenario == "flood" else 512)
        if self.scenario == "flood":
            words = (f"tok{i} " for i in range(max_tokens))
            delay = 1 / 500
        else:
            last = next((m.get("content", "") for m in reversed(req.messages)
                         if m.get("role") == "user"), "")  # fmt: skip
            text = f"Hello from the fake engine. You said: {last}"
            words = iter([w + " " for w in text.split(" ")][:max_tokens])
            delay = float(os.environ.get("CARVE_FAKE_TOKEN_DELAY", "0.01"))
        n, reason, start = 0, "stop", time.perf_counter()
        for i, word in enumerate(words):
            if self.stop.is_set():
                reason = "cancelled"
                break
            # a schedule, not a fixed sleep: the rate holds even when sleeps overshoot
            time.sleep(max(0.0, start + (i + 1) * delay - time.perf_counter()))
            self.emit(p.Token(1000 + i, word))
            n += 1
        else:
            reason = "length" if n >= max_tokens and self.scenario == "flood" else "stop"
        elapsed = max(time.perf_counter() - start, 1e-9)
        prompt = sum(len(str(m.get("content", ""))) for m in req.messages)
        self.emit(p.Done(reason, prompt, n, 1000.0, n / elapsed, prompt + n, req.id))


def watch_parent() -> None:
    parent = os.getppid()
    while True:
        time.sleep(0.5)
        if os.getppid() != parent:
            os._exit(1)


def main(argv: list[str]) -> int:
    scenario = argv[1] if len(argv) > 1 else os.environ.get("CARVE_FAKE_SCENARIO", "normal")
    if scenario not in SCENARIOS:
        print(f"fake_engine: unknown scenario {scenario!r}; one of {SCENARIOS}", file=sys.stderr)
        return 2
    threading.Thread(target=watch_parent, daemon=True).start()
    return FakeEngine(scenario).run()


if __name__ == "__main__":
    sys.exit(main(sys.argv))

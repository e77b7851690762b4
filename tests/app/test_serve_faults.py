"""`carve serve` under load and faults, the real command on the tiny model on the CPU engine:
32 concurrent streaming clients (a quarter leave mid-stream) all finish or leave cleanly and the
server's and engine's memory stays flat over them after a warm-up burst of 16; an engine that hangs (SIGSTOP)
mid-stream is noticed within the silence limit (CARVE_SILENCE_LIMIT, here 3 s), killed, and every
request, the streaming one, the queued ones and the next ones, gets a 503 sentence saying so."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.app.test_serve import KEY, Served

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow
SILENCE = 3.0
HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def served(synth_model):
    server = Served(synth_model("qwen3"), CARVE_SILENCE_LIMIT=str(SILENCE))
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


def _stream(served, i: int, leave_after: int | None = None, **body) -> list[str]:
    """One streaming chat; the SSE data lines it got (fewer when it left after ``leave_after``)."""
    body = {"messages": [{"role": "user", "content": f"client {i}"}], "stream": True, "seed": i,
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0, **body}  # fmt: skip
    got = []
    with httpx.stream("POST", served.url + "/chat/completions", json=body, timeout=120,
                      headers=HEADERS) as res:  # fmt: skip
        assert res.status_code == 200, res.read()
        for line in res.iter_lines():
            if line.startswith("data: "):
                got.append(line[6:])
                if leave_after is not None and len(got) >= leave_after:
                    break  # the client leaves: the connection closes mid-stream
    return got


def _rss(served) -> tuple[float, float]:
    (engine,) = served.engine_pids()
    mib = 1 << 20
    return (psutil.Process(served.proc.pid).memory_info().rss / mib,
            psutil.Process(engine).memory_info().rss / mib)


def _burst(served, n: int) -> None:
    def one(i: int) -> None:
        leave = 2 if i % 4 == 3 else None  # these ask for a long reply and leave in it
        got = _stream(served, i, leave, max_tokens=64 if leave else 1)
        if leave:
            assert len(got) == leave
        else:
            assert got[-1] == "[DONE]", got
            finish = [json.loads(g)["choices"][0]["finish_reason"] for g in got[:-1]]
            assert finish[-1] in ("stop", "length"), got

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(one, range(n)))


def test_32_streaming_clients_finish_or_leave_and_memory_stays_flat(served):
    _burst(served, 16)  # warm-up: buffers, the allocator's pools, uvicorn's connection objects
    before = _rss(served)
    _burst(served, 32)
    after = _rss(served)
    assert after[0] - before[0] < 16 and after[1] - before[1] < 16, (before, after)
    # the engine serves on at once: nothing left running for the clients that left
    start = time.monotonic()
    assert _stream(served, 99, max_tokens=3)[-1] == "[DONE]"
    assert time.monotonic() - start < 20


def test_a_hung_engine_is_killed_within_the_silence_limit_and_requests_get_503(served):
    (engine,) = served.engine_pids()
    stream_lines: list[str] = []
    first = threading.Event()

    def long_stream() -> None:
        # greedy: the synthetic model repeats one token that is not its end, so the reply is
        # still running when the engine is stopped (a sampled one could end on its own first)
        body = {"messages": [{"role": "user", "content": "a long one"}], "stream": True,
                "temperature": 0}
        with httpx.stream("POST", served.url + "/chat/completions", json=body, timeout=120,
                          headers=HEADERS) as res:  # fmt: skip
            for line in res.iter_lines():
                if line.startswith("data: "):
                    stream_lines.append(line[6:])
                    first.set()

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    assert first.wait(60)
    os.kill(engine, signal.SIGSTOP)  # hung: alive and holding memory, answering nothing
    stopped = time.monotonic()
    with ThreadPoolExecutor(3) as pool:  # queued behind the hung reply
        queued = list(pool.map(lambda i: served.post(
            "/chat/completions", {"messages": [{"role": "user", "content": f"q{i}"}]},
            timeout=60), range(3)))
    waited = time.monotonic() - stopped
    streaming.join(60)
    assert waited < SILENCE + 6, waited  # the limit, the watch's poll, the kill
    for res in queued:
        assert res.status_code == 503, res.text
        msg = res.json()["error"]["message"]
        assert "the engine stopped answering (nothing for" in msg and "\n" not in msg, msg
    assert stream_lines[-1] == "[DONE]"
    inline = json.loads(stream_lines[-2])["error"]  # the stream says why it ended
    assert inline["code"] == "engine_unavailable" and "stopped answering" in inline["message"]
    assert any("stopped answering" in line and "requests now get 503" in line
               for line in served.err), "".join(served.err)
    assert not served.engine_pids() or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
    later = served.post("/chat/completions", {"messages": [{"role": "user", "content": "x"}]})
    assert later.status_code == 503
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 143

"""`carve serve` as a client sees it: the real command on a tiny synthetic model on the CPU engine,
driven by the official `openai` client (streaming and not, usage, stop strings, max_tokens,
concurrent clients, a client that leaves) and by raw HTTP for the bad requests. One server (and
one engine) for the module; the last test ends it with SIGTERM and checks no engine is left.

The synthetic model's greedy reply repeats one token, so the replies compared here are drawn
with a seed (temperature 1, no top-k/top-p/min-p): the engine's draw is reproducible from the
seed, so a request gives the same text whenever, and with whatever else, it runs.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

from app import cli_serve  # noqa: E402

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-test-carve"
CTX = 512
DRAW = {"temperature": 1.0, "top_p": 1.0, "extra_body": {"top_k": 0, "min_p": 0}}


class Served:
    """`carve serve` in a subprocess: its URL, model id, pid and stderr."""

    def __init__(self, model: Path, **env: str) -> None:
        cmd = [sys.executable, "-m", "app", "serve", str(model), "--gpus", "cpu", "--ctx",
               str(CTX), "--port", "0", "--api-key", KEY]  # fmt: skip
        env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        deadline = time.monotonic() + 120
        for line in self.proc.stderr:
            self.err.append(line)
            if m := re.search(r"serving (\S+) \(ctx \d+\) at (http://\S+/v1)", line):
                self.model, self.url = m.group(1), m.group(2)
                break
            assert time.monotonic() < deadline, "".join(self.err)
        else:
            raise AssertionError("carve serve ended before serving:\n" + "".join(self.err))
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.err.append(line)

    def engine_pids(self) -> list[int]:
        """Processes whose parent is the server (the engine)."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                except OSError:
                    continue
                if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    pids.append(int(entry))
        return pids

    def post(self, path: str, body: object, key: str | None = KEY, **kw: object) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.post(self.url + path, content=data, headers=headers, **{"timeout": 60, **kw})


@pytest.fixture(scope="module")
def model(synth_model) -> Path:
    return synth_model("qwen3")


@pytest.fixture(scope="module")
def served(model):
    server = Served(model)
    yield server
    if server.proc.poll() is None:
        server.proc.kill()
        server.proc.wait()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url, api_key=KEY, max_retries=0, timeout=120)


def chat(client, served, content: str, seed: int, **kw):
    return client.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": content}], seed=seed,
        **{**DRAW, **kw})  # fmt: skip


def streamed(stream) -> tuple[str, list]:
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks


def test_models_lists_the_loaded_model(client, served, model):
    assert [m.id for m in client.models.list().data] == [model.stem] == [served.model]
    assert client.models.retrieve(model.stem).id == model.stem


def test_chat_whole_and_streamed_give_the_same_reply_and_usage(client, served):
    whole = chat(client, served, "Tell me a story", 7, max_tokens=12)
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert whole.usage.completion_tokens == 12 and whole.usage.prompt_tokens > 5
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + 12
    assert choice.message.content  # synthetic tokens print as <|synth_N|> or bytes
    text, chunks = streamed(chat(client, served, "Tell me a story", 7, max_tokens=12, stream=True,
                                 stream_options={"include_usage": True}))  # fmt: skip
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks[-2:-1]] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1
    text2, chunks2 = streamed(chat(client, served, "Tell me a story", 7, max_tokens=12,
                                   stream=True))  # fmt: skip
    assert text2 == text and all(c.choices for c in chunks2)  # no usage chunk unless asked


def test_raw_completion_of_the_rendered_template_continues_as_chat_does(client, served, model):
    from engine.gguf.reader import GGUFModel
    from engine.text.chat_template import render_chat

    messages = [{"role": "user", "content": "hello there"}]
    prompt, _ = render_chat(GGUFModel.open(model), messages)
    reply = client.chat.completions.create(model=served.model, messages=messages, seed=3,
                                           max_tokens=10, **DRAW)  # fmt: skip
    raw = client.completions.create(model=served.model, prompt=prompt, seed=3, max_tokens=10,
                                    **DRAW)  # fmt: skip
    assert raw.object == "text_completion" and raw.choices[0].finish_reason == "length"
    assert raw.choices[0].text == reply.choices[0].message.content
    assert raw.usage.prompt_tokens == reply.usage.prompt_tokens
    pieces = client.completions.create(model=served.model, prompt=prompt, seed=3, max_tokens=10,
                                       stream=True, **DRAW)  # fmt: skip
    assert "".join(c.choices[0].text for c in pieces) == raw.choices[0].text


def test_stop_strings_end_the_reply_and_are_cut_from_it(client, served):
    full = chat(client, served, "abc", 11, max_tokens=16).choices[0].message.content
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    cut = full[: full.find(stop)]
    assert len(cut) < len(full) - 4
    for stops in (stop, ["never-in-it", stop]):
        whole = chat(client, served, "abc", 11, max_tokens=16, stop=stops)
        assert whole.choices[0].message.content == cut
        assert whole.choices[0].finish_reason == "stop"
        assert whole.usage.completion_tokens < 16
        text, chunks = streamed(chat(client, served, "abc", 11, max_tokens=16, stop=stops,
                                     stream=True))  # fmt: skip
        assert text == cut and chunks[-1].choices[0].finish_reason == "stop"
    missed = chat(client, served, "abc", 11, max_tokens=16, stop=["never-in-it"])
    assert missed.choices[0].message.content == full
    assert missed.choices[0].finish_reason == "length"


def test_concurrent_clients_queue_and_get_what_they_get_alone(client, served):
    def one(i: int) -> str:
        if i % 3 == 2:
            return client.completions.create(model=served.model, prompt=f"once {i}", seed=i,
                                             max_tokens=8, **DRAW).choices[0].text  # fmt: skip
        if i % 2:
            return streamed(chat(client, served, f"q{i}", i, max_tokens=8, stream=True))[0]
        return chat(client, served, f"q{i}", i, max_tokens=8).choices[0].message.content

    alone = [one(i) for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(one, range(4)))
    assert together == alone
    assert len(set(alone)) == 4


def _quick(served) -> float:
    start = time.monotonic()
    res = served.post("/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                            "max_tokens": 3, "temperature": 0})  # fmt: skip
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] <= 3
    return time.monotonic() - start


def test_a_client_that_leaves_stops_its_generation(served):
    alone = _quick(served)
    # no max_tokens: left alone, this reply would run to the end of the 512-token context
    body = {"messages": [{"role": "user", "content": "go on"}], "stream": True, "seed": 1,
            "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0}  # fmt: skip
    with httpx.stream("POST", served.url + "/chat/completions", json=body, timeout=60,
                      headers={"Authorization": f"Bearer {KEY}"}) as res:  # fmt: skip
        assert res.status_code == 200
        got = []
        for line in res.iter_lines():
            if line.startswith("data: "):
                got.append(line)
            if len(got) == 4:
                break
    assert len(got) == 4
    # the engine was stopped: the next request does not wait for ~480 tokens
    assert _quick(served) < alone + 5
    # a non-streaming client that gives up while its reply is written
    with pytest.raises(httpx.ReadTimeout):
        served.post("/chat/completions", {**body, "stream": False}, timeout=0.5)
    assert _quick(served) < alone + 5


def test_requests_without_the_key_get_401(served):
    bad = openai.OpenAI(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    res = httpx.get(served.url + "/models")
    assert res.status_code == 401
    assert res.json()["error"]["code"] == "invalid_api_key"
    assert "Authorization: Bearer" in res.json()["error"]["message"]


MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ("bad json", "/chat/completions", b'{"messages": [', 400, None, None, "not valid JSON"),
    ("not an object", "/chat/completions", [1, 2], 400, None, None, "JSON object"),
    ("unknown model", "/chat/completions", {"model": "gpt-4o", "messages": MSG}, 404, "model",
     "model_not_found", "'gpt-4o' does not exist"),
    ("no messages", "/chat/completions", {"temperature": 0.5}, 400, "messages", None, "missing"),
    ("empty messages", "/chat/completions", {"messages": []}, 400, "messages", None, "non-empty"),
    ("bad role", "/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     "messages[0].role", None, "'robot'"),
    ("image part", "/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages[0].content", None,
     "text parts only"),
    ("negative temperature", "/chat/completions", {"messages": MSG, "temperature": -1}, 400,
     "temperature", None, "temperature=-1"),
    ("text temperature", "/chat/completions", {"messages": MSG, "temperature": "hot"}, 400,
     "temperature", None, "temperature='hot'"),
    ("top_p 0", "/chat/completions", {"messages": MSG, "top_p": 0}, 400, "top_p", None, "top_p"),
    ("max_tokens 0", "/chat/completions", {"messages": MSG, "max_tokens": 0}, 400, "max_tokens",
     None, "max_tokens=0"),
    ("n 2", "/chat/completions", {"messages": MSG, "n": 2}, 400, "n", None, "n=1"),
    ("stop list of numbers", "/chat/completions", {"messages": MSG, "stop": [1]}, 400, "stop",
     None, "stop"),
    ("prompt ids", "/completions", {"prompt": [1, 2, 3]}, 400, "prompt", None, "one string"),
    ("max_tokens past ctx", "/chat/completions", {"messages": MSG, "max_tokens": CTX}, 400,
     "max_tokens", "context_length_exceeded", f"max_tokens is {CTX}"),
    ("prompt past ctx", "/completions", {"prompt": "a b " * CTX}, 400, "prompt",
     "context_length_exceeded", f"the context holds {CTX}"),
    ("huge body", "/chat/completions", b" " * (9 << 20), 413, None, "request_too_large", "MiB"),
]  # fmt: skip


@pytest.mark.parametrize("path, body, status, param, code, says", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])  # fmt: skip
def test_bad_requests_get_openai_errors_and_the_engine_serves_on(served, path, body, status,
                                                                 param, code, says):  # fmt: skip
    res = served.post(path, body)
    assert res.status_code == status, res.text
    error = res.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code
    assert says in error["message"], error["message"]
    if code == "context_length_exceeded":  # the engine refused it: it must serve on
        assert _quick(served) < 30


def test_unknown_routes_and_methods_are_openai_errors(served):
    headers = {"Authorization": f"Bearer {KEY}"}
    res = httpx.get(served.url + "/engines", headers=headers)
    assert res.status_code == 404 and "POST /v1/chat/completions" in res.json()["error"]["message"]
    res = httpx.get(served.url + "/chat/completions", headers=headers)
    assert res.status_code == 405 and res.json()["error"]["type"] == "invalid_request_error"
    assert _quick(served) < 30  # after every bad request above, the engine still answers


def test_a_taken_port_or_a_planning_rig_is_one_line_before_any_engine(model, capsys):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        port = sock.getsockname()[1]
        assert cli_serve.main(["serve", str(model), "--gpus", "cpu", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"carve: cannot listen on 127.0.0.1:{port}") and "\n" not in err
    assert cli_serve.main(["serve", str(model), "--gpus", "2x24GiB"]) == 2
    assert "is a rig to plan for" in capsys.readouterr().err
    assert cli_serve.main(["serve", str(model), "--port", "70000"]) == 2
    assert "--port 70000" in capsys.readouterr().err


def test_sigterm_stops_the_server_and_its_engine(served):
    engines = served.engine_pids()
    assert len(engines) == 1
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 143
    for pid in engines:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()


def test_a_dead_engine_is_503_and_the_server_says_so(model):
    fake = f"{sys.executable} {ROOT / 'tests' / 'fake_engine.py'}"
    served = Served(model, CARVE_ENGINE_CMD=fake, CARVE_FAKE_TOKEN_DELAY="0")
    try:
        res = served.post("/chat/completions", {"messages": MSG})
        assert res.json()["choices"][0]["message"]["content"] == (
            "Hello from the fake engine. You said: hi ")
        (engine,) = served.engine_pids()
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while not any("requests now get 503" in line for line in served.err):
            assert time.monotonic() < deadline, "".join(served.err)
            time.sleep(0.05)
        res = served.post("/chat/completions", {"messages": MSG})
        assert res.status_code == 503 and res.json()["error"]["code"] == "engine_unavailable"
        assert "the engine process exited" in res.json()["error"]["message"]
        assert served.post("/completions", {"prompt": "x", "stream": True}).status_code == 503
        assert httpx.get(served.url + "/models", headers={"Authorization": f"Bearer {KEY}"},
                         timeout=10).status_code == 200  # fmt: skip
        served.proc.send_signal(signal.SIGTERM)
        assert served.proc.wait(timeout=30) == 143
    finally:
        if served.proc.poll() is None:
            served.proc.kill()
            served.proc.wait()

"""The server's pure parts: stop strings over streamed pieces, request bodies -> Job or an
OpenAI-shaped error, and the turns requests take on one engine (an asyncio loop and a recorded
`send`, no process)."""

from __future__ import annotations

import asyncio
import random

import pytest

from app.serve.engine_turns import EngineGone, EngineTurns
from app.serve.openai_api import ApiError, model_id, parse_job
from app.serve.stop_text import StopText
from engine.process import protocol as p

TEXT = "The answer is 42.\n\nUser: and then?"
STOPS = [
    ([], TEXT, False),
    (["\n\nUser:"], "The answer is 42.", True),
    (["42", "answer"], "The ", True),  # the first to appear wins, not the first listed
    (["zzz"], TEXT, False),
    (["?"], "The answer is 42.\n\nUser: and then", True),
    (["The"], "", True),
    (["then?!"], TEXT, False),  # a prefix held back at the end is text after all
]


@pytest.mark.parametrize("stops, expected, stopped", STOPS)
def test_stop_text_over_any_split_of_the_stream(stops, expected, stopped, seed):
    rng = random.Random(seed)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(TEXT)), rng.randint(0, 12)))
        pieces = [TEXT[a:b] for a, b in zip([0, *cuts], [*cuts, len(TEXT)], strict=True)]
        scan = StopText(stops)
        out = "".join(scan.push(piece) for piece in pieces) + scan.flush()
        assert (out, scan.stopped) == (expected, stopped), pieces


def test_stop_text_holds_back_only_what_could_still_become_a_stop():
    scan = StopText(["</end>"])
    assert scan.push("a</e") == "a"
    assert scan.push("x") == "</ex"
    assert scan.push("</") == ""
    assert scan.push("end> tail") == "" and scan.stopped


def test_a_stop_string_makes_the_reply_stop_even_when_the_engine_ran_to_its_limit():
    # the engine may reach max_tokens before the stop request reaches it: the reply still says
    # "stop" and counts the tokens up to the stop string; without a stop, the engine's reason
    from app.serve.http import _completion_tokens, _finish

    scan = StopText(["</end>"])
    for piece in ("a", "b", "</e", "nd>", "c", "d"):  # 6 tokens, the stop ends in the fourth
        scan.push(piece)
    ran_on = p.Done(reason="length", prompt_tokens=5, completion_tokens=6)
    assert scan.stopped and scan.tokens == 4
    assert (_finish(scan, ran_on), _completion_tokens(scan, ran_on)) == ("stop", 4)
    heard = p.Done(reason="cancelled", prompt_tokens=5, completion_tokens=4)
    assert (_finish(scan, heard), _completion_tokens(scan, heard)) == ("stop", 4)
    plain = StopText(["zzz"])
    plain.push("abc")
    assert (_finish(plain, ran_on), _completion_tokens(plain, ran_on)) == ("length", 6)


MSG = [{"role": "user", "content": "hi"}]


def test_a_full_chat_body_becomes_a_job():
    job = parse_job({"model": "m", "messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "he"}, {"type": "text", "text": "y"}]},
        {"role": "assistant", "content": None}],
        "temperature": 0, "top_p": 0.5, "top_k": 7, "min_p": 0.1, "repeat_penalty": 1.2,
        "seed": 9, "max_completion_tokens": 33, "stop": "x", "stream": True,
        "stream_options": {"include_usage": True}, "presence_penalty": 0, "user": "u"}, "m",
        chat=True)  # fmt: skip
    assert job.messages == [{"role": "system", "content": "be brief"},
                            {"role": "user", "content": "hey"},
                            {"role": "assistant", "content": ""}]  # fmt: skip
    assert job.sampling["temperature"] == 0 and job.sampling["top_k"] == 7
    assert job.sampling["seed"] == 9 and job.sampling["repeat_penalty"] == 1.2
    assert (job.max_tokens, job.stop, job.stream, job.include_usage) == (33, ("x",), True, True)
    defaults = parse_job({"messages": MSG}, "m", chat=True)  # no model named: the one served
    assert defaults.max_tokens is None and not defaults.stream and defaults.sampling["top_k"] == 40
    assert not parse_job({"messages": MSG, "stream_options": {"include_usage": True}}, "m",
                         chat=True).include_usage  # fmt: skip


@pytest.mark.parametrize("body, status, param", [
    ({"messages": MSG, "model": "other"}, 404, "model"),
    ({"messages": MSG, "seed": -1}, 400, "seed"),
    ({"messages": MSG, "seed": 1.5}, 400, "seed"),
    ({"messages": MSG, "top_k": -1}, 400, "top_k"),
    ({"messages": MSG, "min_p": 1}, 400, "min_p"),
    ({"messages": MSG, "repeat_penalty": 0}, 400, "repeat_penalty"),
    ({"messages": MSG, "max_tokens": True}, 400, "max_tokens"),
    ({"messages": MSG, "stream": "yes"}, 400, "stream"),
    ({"messages": MSG, "stop": ["a"] * 17}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "messages"),
    ({"messages": ["hi"]}, 400, "messages[0]"),
])  # fmt: skip
def test_bad_bodies_name_the_field(body, status, param):
    with pytest.raises(ApiError) as caught:
        parse_job(body, "m", chat=True)
    assert (caught.value.status, caught.value.param) == (status, param)
    assert set(caught.value.body()["error"]) == {"message", "type", "param", "code"}


def test_model_ids_drop_the_extension_and_the_shard_part():
    assert model_id("Qwen2.5-7B-Q4_K_M.gguf") == "Qwen2.5-7B-Q4_K_M"
    assert model_id("big-Q4_K_M-00001-of-00003.gguf") == "big-Q4_K_M"


class Recorder:
    def __init__(self) -> None:
        self.sent: list[p.Request] = []

    def __call__(self, request: p.Request) -> None:
        self.sent.append(request)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_turns_send_one_generate_at_a_time_and_route_its_events():
    async def main():
        rec = Recorder()
        turns = EngineTurns(rec)
        turns.bind(asyncio.get_running_loop())
        a = await turns.begin(p.Generate(MSG))
        b = await turns.begin(p.Generate(MSG))
        assert [r.id for r in rec.sent] == [a.request.id]  # b waits for a's done
        turns.feed(p.Token(5, "x"))
        turns.feed(p.Done("stop", 3, 1, request="window-1"))  # not the server's: ignored
        turns.feed(p.Done("stop", 3, 1, request=a.request.id))
        assert (await a.next_event()).text == "x"
        assert isinstance(await a.next_event(), p.Done)
        assert [r.id for r in rec.sent] == [a.request.id, b.request.id]
        turns.abandon(b)  # its client left: stop, and drop what still comes
        assert isinstance(rec.sent[-1], p.Stop)
        turns.feed(p.Token(6, "y"))
        c = await turns.begin(p.Generate(MSG))
        assert len(rec.sent) == 3  # c waits for b's done even though b's client is gone
        turns.feed(p.Done("cancelled", 3, 1, request=b.request.id))
        await asyncio.sleep(0)
        assert rec.sent[-1].id == c.request.id and b.events.empty()
        assert turns.served == 1 and turns.waiting == 1
        turns.engine_gone("the engine process exited (status 9)")
        with pytest.raises(EngineGone, match="status 9"):
            await c.next_event()
        with pytest.raises(EngineGone):
            await turns.begin(p.Generate(MSG))

    _run(main())


def test_a_request_abandoned_before_its_turn_never_reaches_the_engine():
    async def main():
        rec = Recorder()
        turns = EngineTurns(rec)
        turns.bind(asyncio.get_running_loop())
        a = await turns.begin(p.Generate(MSG))
        b = await turns.begin(p.Generate(MSG))
        turns.abandon(b)
        turns.feed(p.Error("bad template", request=a.request.id))
        assert isinstance(await a.next_event(), p.Error)
        assert rec.sent == [a.request] and turns.waiting == 0

    _run(main())


@pytest.mark.parametrize("host, key, warned", [
    ("127.0.0.1", None, False), ("localhost", None, False), ("::1", None, False),
    ("127.0.0.2", None, False), ("0.0.0.0", None, True), ("192.168.1.5", None, True),
    ("0.0.0.0", "k", False), ("::", None, True),
])  # fmt: skip
def test_a_server_open_to_other_machines_without_a_key_is_warned_about(host, key, warned):
    from app.cli_serve import exposure_warning

    line = exposure_warning(host, key)
    assert (line is not None) == warned
    assert line is None or (host in line and "--api-key" in line)

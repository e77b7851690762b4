"""engine/process/protocol.py: every message round-trips; bad input becomes ProtocolError items, never an
exception (table of bad lines, partial lines, two messages in one write, invalid UTF-8, huge lines)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from engine.process import protocol as p

ROUND_TRIP = [
    p.Load({"model": "/m.gguf", "ctx": 4096}),
    p.Generate([{"role": "user", "content": "héllo 世界 🙂"}], "g1", {"temperature": 0.0}, 16),
    p.Stop(),
    p.Unload(),
    p.Shutdown(),
    p.Tokenize("a\nb", add_bos=False, parse_special=False, model="/x.gguf"),
    p.Perplexity("text", 512),
    p.Ready(pid=12),
    p.Progress("weights", 10, 100, 5.5),
    p.Loaded([{"index": 0, "priced": 1, "allocated": 1, "nvml_used": 2}]),
    p.Unloaded(),
    p.Note("no chat template: using ChatML"),
    p.Token(42, '\u00e9\n"quoted"\t'),
    p.Done("stop", 3, 4, 100.0, 20.0, 7, "g1"),
    p.Error("model.gguf: bad", fatal=True, request="g1"),
    p.Tokens([1, 2, 3]),
    p.PerplexityResult(8.5, 0.1, 2, 4),
]


@pytest.mark.parametrize("msg", ROUND_TRIP, ids=lambda m: m.TYPE)
def test_round_trip_is_one_ascii_line(msg):
    line = p.encode(msg)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    line.decode("ascii")  # non-ASCII travels escaped
    accept = p.REQUESTS if type(msg) in p.REQUESTS.values() else p.EVENTS
    assert p.decode_line(line[:-1], accept) == msg
    assert json.loads(line)["v"] == p.VERSION


def test_directions_are_separate():
    # "perplexity" is both a request and an event: the decoder's direction picks the class
    req = p.decode_line(p.encode(p.Perplexity("t", 8)).strip(), p.REQUESTS)
    ev = p.decode_line(p.encode(p.PerplexityResult(1.0, 0.0, 1, 1)).strip(), p.EVENTS)
    assert isinstance(req, p.Perplexity) and isinstance(ev, p.PerplexityResult)
    # an event sent to the engine is unknown there
    err = p.decode_line(p.encode(p.Token(1, "x")).strip(), p.REQUESTS)
    assert isinstance(err, p.ProtocolError) and "unknown message type 'token'" in err.message


BAD_LINES = [
    (b"not json", "not JSON"),
    (b"{", "not JSON"),
    (b"[1, 2]", "not a JSON object"),
    (b'"load"', "not a JSON object"),
    (b"null", "not a JSON object"),
    (b'{"type": "stop"}', "no protocol version"),
    (b'{"v": 2, "type": "stop"}', "protocol version 2"),
    (b'{"v": "1", "type": "stop"}', "protocol version '1'"),
    (b'{"v": 1}', "unknown message type None"),
    (b'{"v": 1, "type": 5}', "unknown message type 5"),
    (b'{"v": 1, "type": "explode"}', "unknown message type 'explode'"),
    (b'{"v": 1, "type": "load"}', "needs field 'plan'"),
    (b'{"v": 1, "type": "load", "plan": [1]}', "'plan' must be dict"),
    (b'{"v": 1, "type": "generate", "messages": "hi"}', "'messages' must be list"),
    (b'{"v": 1, "type": "generate", "messages": ["hi"]}', "'messages' must be list"),
    (b'{"v": 1, "type": "generate", "messages": [], "max_tokens": 1.5}', "'max_tokens'"),
    (b'{"v": 1, "type": "tokenize", "text": "x", "add_bos": 1}', "'add_bos' must be"),
    (b'{"v": 1, "type": "perplexity", "text": "x", "ctx": true}', "'ctx' must be int"),
    (b"\xff\xfe{}", "not valid UTF-8 (byte 0)"),
    (b'{"v": 1, "type": "tokenize", "text": "\xc3"}', "not valid UTF-8"),
    (b"[" * 100000 + b"]" * 100000, "not JSON"),  # deep nesting: RecursionError, caught
]


@pytest.mark.parametrize("line, expected", BAD_LINES, ids=[repr(b[:30]) for b, _ in BAD_LINES])
def test_bad_line_is_an_item_not_an_exception(line, expected):
    item = p.decode_line(line, p.REQUESTS)
    assert isinstance(item, p.ProtocolError)
    assert expected in item.message
    assert "\n" not in item.message and len(item.excerpt) < 100


def test_extra_fields_ignored_and_ints_accepted_as_floats():
    item = p.decode_line(
        b'{"v":1,"type":"progress","stage":"w","done":1,"total":2,"rate":3,"extra":0}', p.EVENTS
    )
    assert item == p.Progress("w", 1, 2, 3.0) and isinstance(item.rate, float)


def test_partial_lines_and_two_messages_in_one_write():
    a, b = p.encode(p.Token(1, "a")), p.encode(p.Token(2, "b"))
    dec = p.LineDecoder(p.EVENTS)
    assert dec.feed(a[:5]) == []
    assert dec.feed(a[5:-1]) == []
    assert dec.feed(a[-1:] + b + b[:3]) == [p.Token(1, "a"), p.Token(2, "b")]
    assert dec.feed(b[3:]) == [p.Token(2, "b")]


def test_byte_at_a_time_with_multibyte_text_and_crlf():
    data = (
        p.encode(p.Note("ä")).replace(b"\n", b"\r\n")
        + '{"v":1,"type":"note","message":"世"}\n'.encode()
    )
    dec = p.LineDecoder(p.EVENTS)
    out = [item for i in range(len(data)) for item in dec.feed(data[i : i + 1])]
    assert out == [p.Note("ä"), p.Note("世")]


def test_bad_line_between_good_ones_and_blank_lines_skipped():
    data = p.encode(p.Stop()) + b"\n   \n\xff garbage\n" + p.encode(p.Shutdown())
    out = p.LineDecoder(p.REQUESTS).feed(data)
    assert out[0] == p.Stop() and out[2] == p.Shutdown()
    assert isinstance(out[1], p.ProtocolError) and "UTF-8" in out[1].message
    assert len(out) == 3


def test_huge_line_reported_once_then_decoder_recovers():
    dec = p.LineDecoder(p.REQUESTS, max_line=1000)
    out = []
    for _ in range(50):  # 50 kB without a newline, in chunks
        out += dec.feed(b"x" * 1000)
    out += dec.feed(b"yyy\n" + p.encode(p.Stop()))
    assert len(out) == 2
    assert isinstance(out[0], p.ProtocolError) and "longer than 1000 bytes" in out[0].message
    assert out[1] == p.Stop()


def test_huge_line_in_one_chunk_with_its_newline():
    dec = p.LineDecoder(p.REQUESTS, max_line=100)
    out = dec.feed(b"z" * 500 + b"\n" + p.encode(p.Unload()))
    assert [type(i) for i in out] == [p.ProtocolError, p.Unload]


def test_text_longer_than_a_pipe_buffer_round_trips():
    text = "lorem ipsum ∑ " * 100_000  # ~1.4 MB: a perplexity file
    line = p.encode(p.Perplexity(text, 512))
    dec = p.LineDecoder(p.REQUESTS)
    out = [i for k in range(0, len(line), 65536) for i in dec.feed(line[k : k + 65536])]
    assert out == [p.Perplexity(text, 512)]


def test_finish_takes_a_last_line_without_newline():
    dec = p.LineDecoder(p.REQUESTS)
    assert dec.feed(p.encode(p.Stop()).strip()) == []
    assert dec.finish() == [p.Stop()]
    assert dec.finish() == []


def test_protocol_module_imports_neither_torch_nor_qt():
    code = "import sys, engine.process.protocol; print([m for m in ('torch', 'PySide6', 'numpy') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

"""ChatHistory and SamplingSettings without a window."""

from __future__ import annotations

import pytest

from app.models.chat_model import ChatHistory, ReplyMeter, SamplingSettings
from app.models.load_progress import LoadProgress, format_seconds
from spec.errors import CarveError


def test_a_turn_streams_into_the_history():
    h = ChatHistory()
    h.system_prompt = "Be brief."
    texts, finished = [], []
    h.events.text.connect(texts.append)
    h.events.finished.connect(finished.append)
    h.add_user("  hello  ")
    h.begin_reply()
    assert h.request_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
    ]  # the reply being written is not part of the prompt
    for piece in ("Hi", " there", "", "!"):
        h.append(piece)
    assert texts == ["Hi", " there", "!"]
    h.finish({"reason": "stop", "prompt_tokens": 12, "completion_tokens": 3})
    assert h.messages[-1].content == "Hi there!" and not h.streaming
    assert h.context_used == 15 and finished[0].stats["reason"] == "stop"
    h.append("late")  # after done: ignored
    assert h.messages[-1].content == "Hi there!"


def test_one_reply_at_a_time_and_no_empty_messages():
    h = ChatHistory()
    with pytest.raises(CarveError, match="empty"):
        h.add_user("   ")
    h.add_user("a")
    h.begin_reply()
    with pytest.raises(CarveError, match="Stop"):
        h.add_user("b")
    with pytest.raises(CarveError, match="Stop"):
        h.drop_last_reply()


def test_regenerate_drops_only_the_last_reply():
    h = ChatHistory()
    h.add_user("q1")
    h.begin_reply()
    h.append("a1")
    h.finish({})
    h.add_user("q2")
    h.begin_reply()
    h.append("a2")
    h.finish({})
    assert h.can_regenerate()
    h.drop_last_reply()
    assert [m.content for m in h.messages] == ["q1", "a1", "q2"]
    h.new_chat()
    assert h.messages == [] and h.context_used == 0 and not h.can_regenerate()


@pytest.mark.parametrize("field, value", [
    ("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("min_p", -1.0),
    ("top_k", -1), ("repeat_penalty", 0.0), ("max_tokens", 0), ("seed", -5),
])
def test_sampling_values_out_of_range_name_the_setting(field, value):
    with pytest.raises(CarveError, match=field):
        SamplingSettings(**{field: value})


def test_sampling_settings_match_the_engine_fields():
    # the protocol sends these names to the engine, which validates them again
    s = SamplingSettings(temperature=0.0, seed=7).to_dict()
    assert s["temperature"] == 0.0 and s["seed"] == 7
    assert set(s) == {"temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                      "seed", "max_tokens"}


def test_load_progress_text():
    p = LoadProgress()
    p.update("weights", 2_000_000_000, 10_000_000_000, 4e9)
    assert p.fraction == pytest.approx(0.2)
    assert p.seconds_left == pytest.approx(2.0)
    assert p.text() == "weights: 2.00 of 10.00 GB · 4.00 GB/s · 2 s left"
    assert format_seconds(125) == "2 min 05 s" and format_seconds(7300) == "2 h 01 min"
    p.update("weights", 0, 0, 0.0)
    assert p.seconds_left is None and p.fraction == 0.0
    # the GPU runner's step stages count steps; the CPU loader's dequant cache counts bytes
    p.update("dequant cache", 1, 3, 0.0)
    assert p.text() == "dequant cache: step 2 of 3"
    p.update("compiling kernels", 5, 28, 0.0)  # a cold kernel cache: the compile pool
    assert p.text() == "compiling kernels: step 6 of 28"
    p.update("dequant cache", 704_643_073, 987_922_432, 5e8)
    assert p.text().startswith("dequant cache: 0.70 of 0.99 GB")


def test_reply_meter_counts_tokens_and_rate_while_streaming():
    now = [10.0]
    meter = ReplyMeter(clock=lambda: now[0])
    meter.begin()
    assert meter.token()  # the first token is shown at once
    shown = 0
    for _ in range(100):
        now[0] += 0.01  # 100 tokens/s
        shown += meter.token()
    assert meter.tokens == 101 and abs(meter.rate - 100.0) < 1e-6
    assert 5 <= shown <= 11  # about ten refreshes a second, not one per token
    text = meter.text(context_before=200, ctx_limit=4096)
    assert "101 tokens" in text and "100.0 tokens/s" in text and "301 / 4,096" in text
    meter.begin()
    assert meter.tokens == 0 and meter.rate == 0.0

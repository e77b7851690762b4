"""engine/text/tokenizer.py on the real demo model (Qwen2.5-Coder, byte-level BPE, pre "qwen2") and on
Gemma 3 270M (SentencePiece, byte fallback, no space prefix): ids held equal to the tokenizer
`transformers` builds from the same GGUF (an outside reference), on CPU and offline.

transformers reads a GGUF tokenizer in ~10-15 s, so each reference is built once per module,
and the demo model's chat template is checked against apply_chat_template here too.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.gguf.reader import GGUFModel
from engine.text import tokenizer as tokenizer_mod
from engine.text.chat_template import render_chat
from engine.text.tokenizer import Tokenizer

TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog. It's 3.14159, isn't it? They'll've gone.",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    '#include <stdio.h>\nint main(void) {\n\tprintf("%d\\n", 42);\n\treturn 0;\n}\n',
    "a  b   c    d\n\n\n  \t\t x   \n \n",
    "   leading and trailing   ",
    "\n\n\n\n\n",
    " ",
    "你好，世界！这是一个测试。日本語のテキストです。한국어 텍스트도 있습니다.",
    "emoji 😀🤖👍🏽 🦩 family 👨‍👩‍👧‍👦 flag 🇫🇷 🫠",
    "Ünïcödé àçcénts — “quotes” … ½ ∑ ∞ ≠ Ω",
    "1234567890 1,000,000 0x1F 1e-9",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "<bos>text after a literal bos <eos>",
    "x<|im_end|>y<end_of_turn>z",
    "",
]

SPLIT_EMOJI = "🦩"
CONVERSATION = [
    {"role": "system", "content": "You are terse. Ünïcode stays: 你好 😀"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Write fib in Python.\n  Keep   the spacing."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Météo for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]  # two tokens in Qwen, four byte tokens in Gemma


@pytest.fixture(scope="module", params=["demo", "gemma"])
def pair(request, tmp_path_factory):
    """(ours, transformers') for one model, our tokenizer cache in a fresh directory."""
    path: Path = request.getfixturevalue(f"{request.param}_model_path")
    cache = tmp_path_factory.mktemp(f"tok-{request.param}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(tokenizer_mod, "tokenizer_cache_dir", lambda: cache)
        ours = Tokenizer.from_model(GGUFModel.open(path))
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        transformers = pytest.importorskip("transformers")
        ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        yield request.param, ours, ref, path, cache


@pytest.mark.demo
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_equal_transformers_without_bos(pair, text):
    _, ours, ref, _, _ = pair
    assert ours.encode(text, add_bos=False) == ref.encode(text, add_special_tokens=False)


@pytest.mark.demo
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_ids_equal_transformers_with_the_files_bos_rule(pair, text):
    _, ours, ref, _, _ = pair
    assert ours.encode(text) == ref.encode(text)


@pytest.mark.demo
@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_decode_round_trips_and_equals_transformers(pair, text):
    _, ours, ref, _, _ = pair
    ids = ours.encode(text, add_bos=False)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == ref.decode(ids)


@pytest.mark.demo
def test_special_tokens_whole_only_when_parsing_specials(pair):
    name, ours, ref, _, _ = pair
    marker = "<|im_start|>" if name == "demo" else "<start_of_turn>"
    special_id = ref.convert_tokens_to_ids(marker)
    text = f"{marker}user\nhi"
    assert ours.encode(text, add_bos=False)[0] == special_id
    plain = ours.encode(text, add_bos=False, parse_special=False)
    assert special_id not in plain
    assert ours.decode(plain) == text


@pytest.mark.demo
def test_file_rules_bos_and_end_of_turn(pair):
    name, ours, ref, _, _ = pair
    im_end = ref.convert_tokens_to_ids("<|im_end|>" if name == "demo" else "<end_of_turn>")
    assert im_end in ours.eot_ids
    assert ours.eos_id in ours.eot_ids
    if name == "demo":  # tokenizer.ggml.add_bos_token = false in the file
        assert ours.add_bos is False and ours.encode("hi") == ref.encode("hi") == [6023]
    else:  # gemma: BOS 2 first, add_space_prefix false (no leading ▁)
        assert ours.add_bos is True and ours.encode("hi")[0] == ours.bos_id == 2
        assert ours.add_space_prefix is False
        assert ours.encode("", add_bos=None) == [2]


@pytest.mark.demo
def test_stream_decoder_holds_back_a_split_emoji(pair):
    _, ours, _, _, _ = pair
    text = f"a{SPLIT_EMOJI}b 你好"
    ids = ours.encode(text, add_bos=False)
    partial = [i for i in ids if _invalid_utf8(ours.piece(i))]
    assert partial, "the emoji must really be split across tokens for this test to mean anything"
    dec = ours.stream_decoder()
    pieces = [dec.push(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    assert "\ufffd" not in "".join(pieces)
    assert "" in pieces  # the leading bytes of the emoji were held, not emitted broken


@pytest.mark.demo
def test_second_open_reuses_the_cache(pair, monkeypatch):
    name, _, _, path, cache = pair
    model = GGUFModel.open(path)
    monkeypatch.setattr(tokenizer_mod, "tokenizer_cache_dir", lambda: cache)
    if name == "gemma":
        assert list(cache.glob("*.spm-merges.npy"))

        def fail(*a):
            raise AssertionError("derived the merges again despite the cache")

        monkeypatch.setattr(tokenizer_mod, "spm_merge_ids", fail)
    again = Tokenizer.from_model(model)
    assert again.encode("Hello world, 你好") == pair[1].encode("Hello world, 你好")


def _invalid_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@pytest.mark.demo
@pytest.mark.parametrize(
    ("messages", "add_generation_prompt", "tools"),
    [
        (CONVERSATION, True, None),
        (CONVERSATION, False, None),
        (CONVERSATION[1:], True, None),  # no system prompt: the template inserts its own
        (CONVERSATION, True, TOOLS),  # tools go through tojson
    ],
    ids=["system+gen", "system-no-gen", "no-system", "tools"],
)
def test_demo_chat_template_equals_apply_chat_template(pair, messages, add_generation_prompt, tools):
    name, _, ref, path, _ = pair
    if name != "demo":
        pytest.skip("Gemma 3 270M is a base model without a template (test_chat_template.py)")
    text, note = render_chat(GGUFModel.open(path), messages, add_generation_prompt, tools=tools)
    expected = ref.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, tools=tools
    )
    assert text == expected
    assert note is None
    turns = len(messages) + (messages[0]["role"] != "system") + add_generation_prompt
    assert text.count("<|im_start|>") == turns

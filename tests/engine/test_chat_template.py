"""engine/text/chat_template.py: the ChatML fallback, transformers' template dialect, the sandbox.

The demo model's own template against transformers' apply_chat_template lives in
test_tokenizer_parity.py, which loads transformers' GGUF tokenizer once for both checks."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from engine.gguf.reader import GGUFModel
from engine.text.chat_template import CHATML, render_chat
from spec.errors import CarveError

CONVERSATION = [
    {"role": "system", "content": "You are terse. Ünïcode stays: 你好 😀"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "Hello! How can I help?"},
    {"role": "user", "content": "Write fib in Python.\n  Keep   the spacing."},
]


@dataclass
class FakeModel:
    metadata: dict[str, Any]
    paths: tuple[Path, ...] = field(default_factory=lambda: (Path("tiny.gguf"),))


def with_template(template: str | None, **meta) -> FakeModel:
    metadata = {
        "tokenizer.ggml.tokens": ["<unk>", "<s>", "</s>"],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        **meta,
    }
    if template is not None:
        metadata["tokenizer.chat_template"] = template
    return FakeModel(metadata)


@pytest.mark.demo
def test_base_model_without_template_gets_chatml_and_a_note(gemma_model_path):
    model = GGUFModel.open(gemma_model_path)
    assert "tokenizer.chat_template" not in model.metadata
    text, note = render_chat(model, CONVERSATION[1:2])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert note and "ChatML" in note and gemma_model_path.name in note


def test_chatml_fallback_without_generation_prompt():
    text, note = render_chat(with_template(None), CONVERSATION[:2], add_generation_prompt=False)
    assert text == "<|im_start|>system\n" + CONVERSATION[0]["content"] + "<|im_end|>\n" \
        "<|im_start|>user\nhi<|im_end|>\n"  # fmt: skip
    assert note is not None
    assert render_chat(with_template(CHATML), CONVERSATION[:2])[1] is None


def test_raise_exception_becomes_a_carve_error_with_the_templates_words():
    template = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}"
    )
    with pytest.raises(CarveError) as err:
        render_chat(with_template(template), CONVERSATION)
    assert "Conversation roles must alternate user/assistant" in str(err.value)
    assert "tiny.gguf" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "template",
    [
        "{{ messages.__class__.__mro__[1].__subclasses__() }}",
        "{{ raise_exception.__globals__ }}",
        "{{ ''.__class__.__base__ }}",
        "{{ messages.append({'role': 'user', 'content': 'injected'}) }}",
        "{{ messages[0].update({'content': 'changed'}) }}",
    ],
)
def test_sandbox_refuses_internals_and_mutation(template):
    messages = [dict(m) for m in CONVERSATION]
    with pytest.raises(CarveError, match="sandbox forbids|unsafe"):
        render_chat(with_template(template), messages)
    assert messages == CONVERSATION


def test_syntax_error_names_the_line():
    with pytest.raises(CarveError, match=r"does not parse \(line 2"):
        render_chat(with_template("ok\n{% for m in messages %}"), CONVERSATION)


def test_helpers_and_variables_match_transformers_semantics():
    template = (
        "{{ bos_token }}|{{ eos_token }}|{{ messages[0] | tojson }}|"
        "{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2, sort_keys=True) }}|"
        "{{ strftime_now('%Y') }}|{{ pad_token }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.role }}{% endgeneration %}{% endfor %}"
    )
    text, _ = render_chat(with_template(template), CONVERSATION)
    parts = text.split("|")
    assert parts[0:2] == ["<s>", "</s>"]
    assert parts[2] == json.dumps(CONVERSATION[0], ensure_ascii=False)  # not HTML-escaped
    assert text.split("|", 3)[3].startswith(json.dumps({"a": [1, 2], "b": 1}, indent=2))
    assert str(datetime.datetime.now().year) in text
    assert text.endswith("||system")  # pad_token undefined -> empty; loop broke after one


def test_trim_and_lstrip_blocks_as_transformers():
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    text, _ = render_chat(with_template(template), CONVERSATION)
    assert text == "hi\nWrite fib in Python.\n  Keep   the spacing.\n"


def test_bad_messages():
    with pytest.raises(CarveError, match="role"):
        render_chat(with_template(CHATML), [{"content": "no role"}])

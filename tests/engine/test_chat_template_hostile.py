"""Chat templates from files are untrusted code: sandbox escapes, endless loops and huge strings
are refused with a sentence within a time and size bound, and nothing runs outside the sandbox."""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from engine.text import chat_template
from engine.text.chat_template import render_chat
from spec.errors import CarveError

MESSAGES = [{"role": "user", "content": "hi"}]
SENTINEL = Path("/tmp/carve-template-escape-sentinel")
TOUCH = f"'touch {SENTINEL}'"


def model(template: str) -> SimpleNamespace:
    return SimpleNamespace(metadata={"tokenizer.chat_template": template,
                                     "tokenizer.ggml.tokens": ["<s>", "</s>"],
                                     "tokenizer.ggml.bos_token_id": 0},
                           paths=(Path("hostile.gguf"),))


ESCAPES = [
    "{{ messages.__class__ }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__['sys'].modules['os'].system(" + TOUCH + ") }}",
    "{{ cycler.__init__.__globals__.os.system(" + TOUCH + ") }}",
    "{{ joiner.__init__.__globals__['os'].popen(" + TOUCH + ").read() }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ (messages|attr('__class__')).__base__ }}",
    "{{ messages|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ '{0.__globals__[os]}'.format(raise_exception) }}",
    "{{ '{0.__init__.__globals__}'.format(cycler) }}",
    "{{ '{m.__class__}'.format_map({'m': messages}) }}",
    "{{ messages.append({'role': 'user', 'content': 'x'}) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{% set x = messages.pop() %}{{ x }}",
    "{{ lipsum.__globals__ }}",
    "{{ tojson.__globals__ }}",
    "{{ ''.join.__self__.__class__ }}",
    "{{ [].__class__.__base__.__subclasses__() }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_sandbox_escapes_are_refused_with_a_sentence(template):
    SENTINEL.unlink(missing_ok=True)
    with pytest.raises(CarveError) as err:
        render_chat(model(template), [dict(m) for m in MESSAGES])
    text = str(err.value)
    assert text.startswith("hostile.gguf: the chat template") and "\n" not in text
    assert not SENTINEL.exists(), "template code ran outside the sandbox"


def _ns(body: str) -> str:
    return "{% set ns = namespace(s='ab') %}" + body + "{{ ns.s }}"


GREEDY = [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "ran"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}",
     "ran"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "failed|ran"),
    ("{{ 'a' * 1000000000 }}", "would be"),
    ("{{ messages * 100000000 }}", "would be"),
    ("{{ 2 ** 100000000 }}", "power"),
    (_ns("{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"), "would be"),
    (_ns("{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}"), "would be"),
    (_ns("{% for i in range(64) %}{% set ns.s = [ns.s, ns.s]|join %}{% endfor %}"), "would be"),
    (_ns("{% for i in range(64) %}{% set ns.s = ns.s|replace('a', ns.s) %}{% endfor %}"),
     "would be"),
    ("{{ 'x'|center(1000000000) }}", "given"),
    ("{{ 'x'|indent(1000000000, true) }}", "given"),
    ("{{ 'x'.ljust(1000000000) }}", "given"),
    ("{{ 'x'.zfill(1000000000) }}", "given"),
    ("{{ '%0999999999d' % 1 }}", "huge width"),
    ("{{ '%0999999999d'|format(1) }}", "huge width"),
    ("{{ '{:>999999999}'.format(1) }}", "huge width"),
    ("{{ 'ab'|replace('', 'x' * 30000000) }}", "would be"),
    ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", "output passed"),
]


@pytest.mark.parametrize(("template", "says"), GREEDY)
def test_endless_and_greedy_templates_are_stopped_in_bounded_time_and_memory(
        template, says, monkeypatch):
    monkeypatch.setattr(chat_template, "RENDER_SECONDS", 1.0)
    rss = psutil.Process().memory_info().rss
    t = time.monotonic()
    with pytest.raises(CarveError, match=says) as err:
        render_chat(model(template), MESSAGES)
    assert time.monotonic() - t < 1.0 + 3.0
    assert psutil.Process().memory_info().rss - rss < 600 << 20
    assert "\n" not in str(err.value) and str(err.value).startswith("hostile.gguf:")


def test_the_bounds_leave_real_templates_alone():
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 2000}
                 for i in range(200)]
    text, _ = render_chat(model(chat_template.CHATML), long_chat)
    assert text.count("<|im_start|>") == 201 and len(text) > 2_000_000


def test_a_render_leaves_the_callers_tracer_in_place():
    def tracer(frame, event, arg):
        return None

    import sys

    previous = sys.gettrace()
    sys.settrace(tracer)
    try:
        render_chat(model(chat_template.CHATML), MESSAGES)
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(previous)

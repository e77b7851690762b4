"""Render a conversation with the model's own chat template (``tokenizer.chat_template``).

A GGUF's template is code from whoever made the file, so it runs in jinja2's
``ImmutableSandboxedEnvironment``: no dunder attributes, no mutating the messages. The
environment matches what `transformers`' ``apply_chat_template`` gives templates (the dialect
they are written for): ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block, ``raise_exception``, ``strftime_now``, a ``tojson`` filter with its
keyword arguments and non-ASCII kept, and ``bos_token``/``eos_token``.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from spec.errors import CarveError

# What a model without a template (a base model) gets.
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class _HasMetadata(Protocol):
    metadata: dict[str, Any]
    paths: tuple[Path, ...]


class _TemplateRaised(Exception):
    """raise_exception() from inside a template: its message is for the user verbatim."""


def render_chat(
    model: _HasMetadata,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    *,
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, str | None]:
    """The prompt text for ``messages`` and a note for the user (None when all is as the file
    says; a sentence when Carve had to fall back to ChatML)."""
    meta = model.metadata
    where = model.paths[0].name if model.paths else "model"
    _check_messages(messages)
    source = meta.get("tokenizer.chat_template")
    note = None
    if not isinstance(source, str) or not source.strip():
        source = CHATML
        note = f"{where} has no chat template (a base model?); using ChatML, which it may not know"
    variables: dict[str, Any] = {
        "messages": messages,
        "add_generation_prompt": add_generation_prompt,
    }
    if tools is not None:
        variables["tools"] = tools
    variables.update(_special_token_texts(meta))
    try:
        template = _compile(source)
    except jinja2.TemplateSyntaxError as err:
        raise CarveError(
            f"{where}: its chat template does not parse (line {err.lineno}: {err.message}); "
            "fix the file's tokenizer.chat_template"
        ) from None
    try:
        return template.render(**variables), note
    except _TemplateRaised as err:
        raise CarveError(f"{where}: the chat template refused this conversation: {err}") from None
    except SecurityError as err:
        raise CarveError(
            f"{where}: the chat template tried something the sandbox forbids ({err}); "
            "this file's template is not safe to run"
        ) from None
    except Exception as err:  # noqa: BLE001 - an untrusted template can fail any way
        raise CarveError(
            f"{where}: the chat template failed on this conversation "
            f"({type(err).__name__}: {err})"
        ) from None


def _check_messages(messages: list[dict[str, Any]]) -> None:
    if not isinstance(messages, list):
        raise CarveError("chat messages must be a list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise CarveError(f"chat message {i} needs a 'role' string and a 'content'")


def _special_token_texts(meta: dict[str, Any]) -> dict[str, str]:
    """bos_token / eos_token / unk_token / pad_token as texts; absent ones stay undefined, as
    they are in transformers (an undefined variable renders as nothing)."""
    tokens = meta.get("tokenizer.ggml.tokens") or []
    out = {}
    for var, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                     ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):  # fmt: skip
        token_id = meta.get(f"tokenizer.ggml.{key}")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            out[var] = tokens[int(token_id)]
    return out


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: not jinja's HTML-escaping |tojson, and keeps non-ASCII text
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant spans with it);
    here it renders its body and nothing else."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _Sandbox(ImmutableSandboxedEnvironment):
    """jinja2's sandbox answers a forbidden attribute with an undefined value that prints as
    nothing; a template reaching for internals is hostile or broken, so refuse it outright."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)

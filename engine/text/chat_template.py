"""Render a conversation with the model's own chat template (``tokenizer.chat_template``).

A GGUF's template is code from whoever made the file, so it runs in jinja2's
``ImmutableSandboxedEnvironment``: no dunder attributes, no mutating the messages. The
environment matches what `transformers`' ``apply_chat_template`` gives templates (the dialect
they are written for): ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` block, ``raise_exception``, ``strftime_now``, a ``tojson`` filter with its
keyword arguments and non-ASCII kept, and ``bos_token``/``eos_token``.

The sandbox keeps a template from reaching Python's internals, not from running forever or
filling memory, so a render is also bounded: RENDER_SECONDS of template code (a tracer checks
the clock as the template's own lines run) and MAX_TEXT characters for any one string it builds
(``*``, ``+``, ``~``, ``%`` and filters with a width are checked before they allocate) and for
its output. A template past either bound is refused with a sentence, not run on.
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jinja2
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from spec.errors import CarveError

RENDER_SECONDS = 5.0  # a real template renders a long conversation in milliseconds
MAX_TEXT = 32 << 20  # characters: a 1M-token context's text is a few MB
_HUGE_WIDTH = re.compile(r"\d{7,}")  # a width or precision of a million or more in a format

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
        return _bounded_render(template, variables), note
    except _TemplateRaised as err:
        raise CarveError(f"{where}: the chat template refused this conversation: {err}") from None
    except _TooMuch as err:
        raise CarveError(f"{where}: the chat template was stopped: {err}; this file's template "
                         "is broken or hostile") from None
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


class _TooMuch(Exception):
    """The render went past RENDER_SECONDS or MAX_TEXT."""


def _bounded_render(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """template.render, stopped after RENDER_SECONDS of template code or MAX_TEXT of output."""
    deadline = time.monotonic() + RENDER_SECONDS
    steps = [0]

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        steps[0] += 1
        if steps[0] % 256 == 0 and time.monotonic() > deadline:
            raise _TooMuch(f"it ran for more than {RENDER_SECONDS:.0f} s")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:
        # only the template's compiled code is traced: Python's own code runs at full speed
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        out, size = [], 0
        for piece in template.generate(**variables):
            size += len(piece)
            if size > MAX_TEXT:
                raise _TooMuch(f"its output passed {MAX_TEXT} characters")
            out.append(piece)
        return "".join(out)
    finally:
        sys.settrace(previous)


def _check_size(n: int, what: str) -> None:
    if n > MAX_TEXT:
        raise _TooMuch(f"{what} would be {n} long (at most {MAX_TEXT})")


def _check_args(name: str, args: tuple, kwargs: dict) -> None:
    """Refuse a call whose arguments ask for a huge result before it allocates it."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_TEXT:
            raise _TooMuch(f"{name} was given {a}")
        if isinstance(a, str) and "%" in a or isinstance(a, str) and "{" in a:
            if _HUGE_WIDTH.search(a):
                raise _TooMuch(f"{name} was given a format with a huge width")


def _check_replace(text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        hits = len(text) + 1 if not old else text.count(old)
        _check_size(len(text) + hits * (len(new) - len(old)), "a replaced string")


def _bounded_filter(name: str, fn: Any) -> Any:
    def checked(*args: Any, **kwargs: Any) -> Any:
        _check_args(f"filter {name}", args, kwargs)
        if name == "replace":
            texts = [a for a in args if isinstance(a, str)]
            if len(texts) >= 3:
                _check_replace(*texts[:3])
        result = fn(*args, **kwargs)
        if isinstance(result, (str, list)):
            _check_size(len(result), f"the result of filter {name}")
        return result

    for attr in ("jinja_pass_arg",):  # context/environment-taking filters keep their marker
        if hasattr(fn, attr):
            setattr(checked, attr, getattr(fn, attr))
    return checked


def _seq_len(x: Any) -> int | None:
    return len(x) if isinstance(x, (str, list, tuple)) else None


class _BoundedCodegen(CodeGenerator):
    """``a ~ b`` joins through the environment, which checks the length first."""

    def visit_Concat(self, node: nodes.Concat, frame: Any) -> None:
        self.write("environment.bounded_join((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


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

    code_generator_class = _BoundedCodegen
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        a, b = _seq_len(left), _seq_len(right)
        if operator == "*":
            if a is not None and isinstance(right, int):
                _check_size(a * right, "a repeated string or list")
            if b is not None and isinstance(left, int):
                _check_size(b * left, "a repeated string or list")
        elif operator == "+" and a is not None and b is not None:
            _check_size(a + b, "a joined string or list")
        elif operator == "**" and isinstance(right, int) and abs(right) > 4096:
            raise _TooMuch(f"a power of {right}")
        elif operator == "%" and isinstance(left, str):
            _check_args("the % operator", (left,), {})
        return super().call_binop(context, operator, left, right)

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_args(getattr(__obj, "__name__", "a function"), args, kwargs)
        if getattr(__obj, "__name__", "") in ("format", "format_map") and isinstance(
                getattr(__obj, "__self__", None), str):
            _check_args("str.format", (__obj.__self__,), {})
        if getattr(__obj, "__name__", "") == "replace" and len(args) >= 2:
            _check_replace(getattr(__obj, "__self__", None), args[0], args[1])
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list)):
            _check_size(len(result), "a string a call built")
        return result

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)  # '...'.format, sandboxed at attribute access
        if wrapped is None:
            return None

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_args("str.format", (value.__self__, *args), kwargs)
            return wrapped(*args, **kwargs)

        return checked

    def bounded_join(self, parts: tuple) -> str:
        texts = [str(x) for x in parts]
        _check_size(sum(map(len, texts)), "a string joined with ~")
        return "".join(texts)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _Sandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[loopcontrols, _GenerationBlock],
    )
    env.filters["tojson"] = _tojson
    env.filters = {name: _bounded_filter(name, fn) for name, fn in env.filters.items()}
    env.globals.pop("lipsum", None)  # paragraphs of filler on request: nothing a chat needs
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)

"""The OpenAI API as Carve reads and writes it: request bodies become a validated ``Job``, engine
results become chat/text completion objects, stream chunks and errors of OpenAI's shapes.

Pure data, no I/O: the HTTP layer (http.py) calls these. Sampling values are checked by
``SamplingParams``, the validator the CLI, the window and the engine share.
"""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from engine.process.sampling_params import SamplingParams
from spec.errors import CarveError

MAX_STOPS = 16  # OpenAI takes 4; more cost nothing here, unbounded lists do
# OpenAI field -> SamplingParams field; top_k, min_p, repeat_penalty, repeat_last_n are the
# extra fields llama.cpp's server also takes
SAMPLING_FIELDS = {
    "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
    "repeat_penalty": "repeat_penalty", "repeat_last_n": "repeat_last_n", "seed": "seed",
}  # fmt: skip
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class ApiError(Exception):
    """An answer other than 200, as OpenAI shapes it: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error") -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)  # fmt: skip

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:  # fmt: skip
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


@dataclass(frozen=True, slots=True)
class Job:
    """One completion request, checked: what the engine is asked and how the answer is shaped."""

    chat: bool  # /v1/chat/completions (messages) or /v1/completions (prompt)
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)  # SamplingParams.to_dict()
    max_tokens: int | None = None  # None: until the model stops or the context is full
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False


def model_id(path_name: str) -> str:
    """The id a model is served under: its file name without .gguf or a split set's shard part."""
    stem = path_name[:-5] if path_name.lower().endswith(".gguf") else path_name
    return re.sub(r"-\d{5}-of-\d{5}$", "", stem)


def models_list(model: str, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [model_card(model, created)]}


def model_card(model: str, created: int) -> dict[str, Any]:
    return {"id": model, "object": "model", "created": created, "owned_by": "carve"}


# ---------------------------------------------------------------- requests


def parse_job(body: Any, served_model: str, chat: bool) -> Job:
    """A request body -> Job; ApiError (400, or 404 for a model this server does not hold)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != served_model:
        raise ApiError(404, f"the model {model!r} does not exist here; this server serves "
                       f"{served_model!r} (GET /v1/models)", "model", "model_not_found")  # fmt: skip
    n = body.get("n", 1)
    if n not in (1, None):
        raise bad(f"n={n!r}: this server writes one choice per request; send n=1", "n")
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad("stream_options must be an object", "stream_options")
    include_usage = bool(options and options.get("include_usage"))
    if chat:
        messages, prompt = _messages(body.get("messages")), None
    else:
        messages, prompt = [], _prompt(body.get("prompt"))
    return Job(chat=chat, messages=messages, prompt=prompt, sampling=_sampling(body),
               max_tokens=_max_tokens(body), stop=_stops(body.get("stop")), stream=stream,
               include_usage=stream and include_usage)  # fmt: skip


def _flag(body: dict[str, Any], name: str) -> bool:
    value = body.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad(f"{name} must be true or false, got {value!r}", name)
    return value


def _text_of(content: Any, i: int) -> str:
    """A message's content: a string, or a list of text parts (other parts are refused)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise bad(f"messages[{i}]: content part of type {kind!r} is not supported; "
                          "this server reads text parts only", f"messages[{i}].content")  # fmt: skip
            if not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}]: a text part needs a string 'text'",
                          f"messages[{i}].content")  # fmt: skip
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content must be a string or a list of text parts",
              f"messages[{i}].content")  # fmt: skip


def _messages(raw: Any) -> list[dict[str, str]]:
    if raw is None:
        raise bad("messages is missing: send a list of {role, content} objects", "messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with role and content", f"messages[{i}]")
        role = ROLES.get(m.get("role"))
        if role is None:
            raise bad(f"messages[{i}].role {m.get('role')!r} is not one of "
                      f"{', '.join(ROLES)}", f"messages[{i}].role")  # fmt: skip
        out.append({"role": role, "content": _text_of(m.get("content"), i)})
    if not any(m["content"].strip() for m in out):
        raise bad("every message is empty; send some text", "messages")
    return out


def _prompt(raw: Any) -> str:
    if isinstance(raw, list) and len(raw) == 1:
        raw = raw[0]
    if raw is None:
        raise bad("prompt is missing: send the text to continue", "prompt")
    if not isinstance(raw, str):
        raise bad("prompt must be one string (token id lists and batches are not supported)",
                  "prompt")  # fmt: skip
    if not raw:
        raise bad("prompt is empty; send the text to continue", "prompt")
    return raw


def _sampling(body: dict[str, Any]) -> dict[str, Any]:
    given = {ours: body[theirs] for theirs, ours in SAMPLING_FIELDS.items()
             if body.get(theirs) is not None}  # fmt: skip
    try:
        return SamplingParams(**given).to_dict()
    except CarveError as err:
        param = next((k for k, v in SAMPLING_FIELDS.items() if f"setting {v}=" in str(err)), None)
        raise bad(str(err), param) from None


def _max_tokens(body: dict[str, Any]) -> int | None:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad(f"{name}={value!r}: use an integer >= 1", name)
    return value


def _stops(raw: Any) -> tuple[str, ...]:
    if raw is None:
        return ()
    stops = [raw] if isinstance(raw, str) else raw
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop has {len(stops)} strings; send at most {MAX_STOPS}", "stop")
    return tuple(s for s in stops if s)


# ---------------------------------------------------------------- replies


class Reply:
    """The objects of one completion's answer: ids and timestamps shared by its chunks."""

    def __init__(self, job: Job, model: str) -> None:
        self.job, self.model = job, model
        self.id = ("chatcmpl-" if job.chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}  # fmt: skip

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(self, text: str, finish: str, usage: dict[str, int]) -> dict[str, Any]:
        """The non-streaming answer."""
        if self.job.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text},
                      "logprobs": None, "finish_reason": finish}  # fmt: skip
            return {**self._head("chat.completion"), "choices": [choice], "usage": usage}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        return {**self._head("text_completion"), "choices": [choice], "usage": usage}

    def chunk(self, text: str | None = None, finish: str | None = None,
              first: bool = False) -> dict[str, Any]:  # fmt: skip
        """One streamed piece: text, or the finish reason (then text is None)."""
        if self.job.chat:
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.job.include_usage:
            out["usage"] = None  # OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, usage: dict[str, int]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.job.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage}

"""The engine process protocol: JSON Lines on the engine's stdin (requests) and stdout (events).

Every line is one JSON object ``{"v": VERSION, "type": ..., <fields>}``, ASCII only (non-ASCII
text travels as ``\\uXXXX`` escapes, so a line can never be split inside a character).
Pure Python: the GUI, the CLIs and the engine all import it.

Requests (to the engine)
    load {plan}                       plan = Plan.to_json(); replaces any loaded model
    generate {id, messages, sampling, max_tokens, prompt, exact_max_tokens}
                                      prompt: raw text generated from as it is (no chat
                                      template; messages then empty); exact_max_tokens: a
                                      max_tokens that does not fit beside the prompt is an error
                                      (code context_overflow), not shortened to fit
    stop                              cancels the running load / generate / perplexity
    unload                            frees the model (cancels a load in progress) -> unloaded
    shutdown                          the engine exits
    tokenize {text, add_bos, parse_special, model}   model = a GGUF path: tokenize with that
                                      file's tokenizer without loading weights; "" = loaded model
    perplexity {text, ctx}            llama-perplexity's method on the loaded model

Events (from the engine)
    ready {version, pid}              first line, once the engine reads requests
    progress {stage, done, total, rate}   load progress: bytes, bytes/s
    loaded {devices}                  per device: index, name, priced, allocated, nvml_used
    unloaded                          after unload, or a cancelled load: nothing is held
    note {message}                    something a person should know (e.g. "no chat template")
    token {id, text}                  text is always valid UTF-8 (may be "" mid-character);
                                      id -1: the held bytes of an unfinished character at the end
    done {reason, prompt_tokens, completion_tokens, prefill_tps, decode_tps, ctx_used, request}
                                      reason: "stop" | "length" | "cancelled"
    error {message, fatal, request, code}   message is one line a person can act on; code
                                      names the kind a front end answers differently ("" or
                                      CONTEXT_OVERFLOW)
    tokens {ids}
    perplexity {value, stderr, chunks, total}   running estimate after each chunk;
                                      the final one has chunks == total
    alive                             every HEARTBEAT seconds while a request runs and no other
                                      event went out: the engine is working, not stuck. A client
                                      that hears nothing for SILENCE_LIMIT seconds while a
                                      request of its own runs takes the engine for hung and
                                      kills it (clients keep this event to themselves)

Decoding never raises: a bad line becomes a ``ProtocolError`` item (qutebrowser's ipc does the
same), so one malformed line can not take down either side.
"""

from __future__ import annotations

import json
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, ClassVar, Union

VERSION = 1
MAX_LINE = 32 << 20  # bytes; a perplexity text of a few MB fits, a runaway writer does not
HEARTBEAT = 1.0  # seconds between alive events while a request runs
# seconds a client waits for any event while a request runs before it takes the engine for hung;
# loads are long but send progress, and the alive events cover steps without progress
SILENCE_LIMIT = 30.0


# ---------------------------------------------------------------- requests


# load stages whose progress counts steps, not bytes: the dequant cache fill, the tokenizer
# build and the warm-up that compiles and captures what a reply will run
DEQUANT_CACHE, TOKENIZER, WARM_UP = "dequant cache", "tokenizer", "warm-up"
COMPILE = "compiling kernels"  # a cold kernel cache: the GPU runner's compile pool, per variant
STEP_STAGES = (DEQUANT_CACHE, TOKENIZER, WARM_UP, COMPILE)

CONTEXT_OVERFLOW = "context_overflow"  # an error event's code: the request does not fit the ctx


@dataclass(frozen=True, slots=True)
class Load:
    TYPE: ClassVar[str] = "load"
    plan: dict


@dataclass(frozen=True, slots=True)
class Generate:
    TYPE: ClassVar[str] = "generate"
    messages: list[dict]
    id: str = ""
    sampling: dict = field(default_factory=dict)  # SamplingParams field -> value
    max_tokens: int | None = None
    prompt: str | None = None  # raw text instead of messages: no chat template
    exact_max_tokens: bool = False  # True: refuse (context_overflow) rather than shorten


@dataclass(frozen=True, slots=True)
class Stop:
    TYPE: ClassVar[str] = "stop"


@dataclass(frozen=True, slots=True)
class Unload:
    TYPE: ClassVar[str] = "unload"


@dataclass(frozen=True, slots=True)
class Shutdown:
    TYPE: ClassVar[str] = "shutdown"


@dataclass(frozen=True, slots=True)
class Tokenize:
    TYPE: ClassVar[str] = "tokenize"
    text: str
    add_bos: bool | None = None  # None: the model file's rule
    parse_special: bool = True
    model: str = ""


@dataclass(frozen=True, slots=True)
class Perplexity:
    TYPE: ClassVar[str] = "perplexity"
    text: str
    ctx: int


# ---------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class Ready:
    TYPE: ClassVar[str] = "ready"
    version: int = VERSION
    pid: int = 0


@dataclass(frozen=True, slots=True)
class Progress:
    TYPE: ClassVar[str] = "progress"
    stage: str
    done: int
    total: int
    rate: float = 0.0


@dataclass(frozen=True, slots=True)
class Loaded:
    TYPE: ClassVar[str] = "loaded"
    devices: list[dict] = field(default_factory=list)
    # [label, seconds since the load request] marks of where the load's time went
    timeline: list[list] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Unloaded:
    TYPE: ClassVar[str] = "unloaded"


@dataclass(frozen=True, slots=True)
class Note:
    TYPE: ClassVar[str] = "note"
    message: str


@dataclass(frozen=True, slots=True)
class Token:
    TYPE: ClassVar[str] = "token"
    id: int
    text: str


@dataclass(frozen=True, slots=True)
class Done:
    TYPE: ClassVar[str] = "done"
    reason: str
    prompt_tokens: int
    completion_tokens: int
    prefill_tps: float = 0.0
    decode_tps: float = 0.0
    ctx_used: int = 0
    request: str = ""  # the generate id


@dataclass(frozen=True, slots=True)
class Error:
    TYPE: ClassVar[str] = "error"
    message: str
    fatal: bool = False  # True: the engine is exiting
    request: str = ""
    code: str = ""  # "" or CONTEXT_OVERFLOW: the prompt (plus max_tokens) exceeds the context


@dataclass(frozen=True, slots=True)
class Alive:
    TYPE: ClassVar[str] = "alive"


@dataclass(frozen=True, slots=True)
class Tokens:
    TYPE: ClassVar[str] = "tokens"
    ids: list[int]


@dataclass(frozen=True, slots=True)
class PerplexityResult:
    TYPE: ClassVar[str] = "perplexity"
    value: float
    stderr: float
    chunks: int
    total: int = 0


Request = Load | Generate | Stop | Unload | Shutdown | Tokenize | Perplexity
Event = (
    Ready | Progress | Loaded | Unloaded | Note | Token | Done | Error | Tokens | PerplexityResult
    | Alive
)
Message = Request | Event

REQUESTS: dict[str, type] = {c.TYPE: c for c in typing.get_args(Request)}
EVENTS: dict[str, type] = {c.TYPE: c for c in typing.get_args(Event)}


@dataclass(frozen=True, slots=True)
class ProtocolError:
    """A line that is not a valid message. An item, not an exception: decoding never raises."""

    message: str
    excerpt: str = ""  # the start of the offending line, for logs

    def __str__(self) -> str:
        return self.message


# ---------------------------------------------------------------- encoding


def to_dict(msg: Message) -> dict[str, Any]:
    return {"v": VERSION, "type": msg.TYPE, **asdict(msg)}


def encode(msg: Message) -> bytes:
    """One protocol line, newline-terminated, pure ASCII."""
    return (json.dumps(to_dict(msg), ensure_ascii=True, separators=(",", ":")) + "\n").encode(
        "ascii"
    )


# ---------------------------------------------------------------- decoding


def _type_ok(value: Any, tp: Any) -> bool:
    if tp is Any:
        return True
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    if tp is dict or origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return str(tp).replace("typing.", "") if typing.get_origin(tp) else tp.__name__


_HINTS: dict[type, dict[str, Any]] = {
    cls: typing.get_type_hints(cls) for cls in (*REQUESTS.values(), *EVENTS.values())
}


def _excerpt(raw: bytes | str) -> str:
    return repr(raw[:80]) + ("..." if len(raw) > 80 else "")


def decode_line(line: bytes | str, accept: dict[str, type]) -> Message | ProtocolError:
    """One line (without its newline) -> a message of a type in ``accept`` (REQUESTS or
    EVENTS), or a ProtocolError saying what is wrong with it."""
    try:
        text = line.decode("utf-8") if isinstance(line, (bytes, bytearray)) else line
    except UnicodeDecodeError as err:
        return ProtocolError(f"line is not valid UTF-8 (byte {err.start})", _excerpt(line))
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as err:
        return ProtocolError(f"line is not JSON: {str(err)[:120]}", _excerpt(line))
    if not isinstance(obj, dict):
        return ProtocolError("line is not a JSON object", _excerpt(line))
    version = obj.get("v")
    if version != VERSION:
        what = (
            "has no protocol version 'v'" if "v" not in obj else f"has protocol version {version!r}"
        )
        return ProtocolError(f"message {what}; this side speaks v{VERSION}", _excerpt(line))
    kind = obj.get("type")
    cls = accept.get(kind) if isinstance(kind, str) else None
    if cls is None:
        known = ", ".join(sorted(accept))
        return ProtocolError(
            f"unknown message type {kind!r} (expected one of: {known})", _excerpt(line)
        )
    hints = _HINTS[cls]
    values: dict[str, Any] = {}
    for f in fields(cls):
        if f.name not in obj:
            required = f.default is MISSING and f.default_factory is MISSING
            if required:
                return ProtocolError(f"{kind!r} message needs field {f.name!r}", _excerpt(line))
            continue
        value = obj[f.name]
        if not _type_ok(value, hints[f.name]):
            return ProtocolError(
                f"{kind!r} field {f.name!r} must be {_type_name(hints[f.name])}, "
                f"got {type(value).__name__}",
                _excerpt(line),
            )
        values[f.name] = float(value) if hints[f.name] is float else value
    return cls(**values)  # unknown extra fields are ignored: newer peers may add some


class LineDecoder:
    """Turns arbitrary byte chunks (half a line, several lines, anything) into messages.

    ``feed`` returns the complete lines' messages, and a ProtocolError for each bad line;
    a line longer than ``max_line`` is reported once and skipped up to its newline."""

    def __init__(self, accept: dict[str, type], max_line: int = MAX_LINE) -> None:
        self.accept = accept
        self.max_line = max_line
        self._buf = bytearray()
        self._skipping = False

    def feed(self, data: bytes | str) -> list[Message | ProtocolError]:
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogateescape")
        out: list[Message | ProtocolError] = []
        start = 0
        while (nl := data.find(b"\n", start)) >= 0:
            if self._skipping:
                self._skipping = False
            else:
                self._buf += data[start:nl]
                self._emit(out)
            self._buf.clear()
            start = nl + 1
        if not self._skipping:
            self._buf += data[start:]
            if len(self._buf) > self.max_line:
                out.append(self._too_long())
                self._buf.clear()
                self._skipping = True
        return out

    def finish(self) -> list[Message | ProtocolError]:
        """End of stream: a last line without its newline still counts."""
        out: list[Message | ProtocolError] = []
        if not self._skipping:
            self._emit(out)
        self._buf.clear()
        self._skipping = False
        return out

    def _emit(self, out: list[Message | ProtocolError]) -> None:
        line = bytes(self._buf).rstrip(b"\r")
        if len(line) > self.max_line:
            out.append(self._too_long())
        elif line.strip():
            out.append(decode_line(line, self.accept))

    def _too_long(self) -> ProtocolError:
        return ProtocolError(
            f"line longer than {self.max_line} bytes; dropped", _excerpt(bytes(self._buf[:80]))
        )

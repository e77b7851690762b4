"""Chat history and sampling settings: Qt-free, so a test drives a conversation without a window.

The view mirrors it; the engine client feeds it (``begin_reply``/``append``/``finish``). The
sampling settings are validated here rather than by ``engine.sampling`` because that module
imports torch, which the app never does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from app.models.events import Events
from engine.errors import CarveError


@dataclass(slots=True)
class SamplingSettings:
    """Mirrors ``engine.sampling.SamplingParams``; ``temperature == 0`` is greedy."""

    temperature: float = 0.7
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.1
    repeat_last_n: int = 64
    seed: int | None = None
    max_tokens: int = 512

    def __post_init__(self) -> None:
        _check("temperature", self.temperature, 0.0, 5.0)
        _check("top_k", self.top_k, 0, 1_000_000)
        _check("top_p", self.top_p, 0.0, 1.0)
        _check("min_p", self.min_p, 0.0, 1.0)
        _check("repeat_penalty", self.repeat_penalty, 0.5, 3.0)
        _check("repeat_last_n", self.repeat_last_n, 0, 1_000_000)
        _check("max_tokens", self.max_tokens, 1, 1_000_000)
        if self.seed is not None:
            _check("seed", self.seed, 0, 2**63 - 1)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _check(name: str, value: float, lo: float, hi: float) -> None:
    if not lo <= value <= hi:
        raise CarveError(f"sampling setting {name}={value} is out of range; use {lo}..{hi}")


@dataclass(slots=True)
class Message:
    role: str  # "system" | "user" | "assistant"
    content: str
    stats: dict[str, Any] = field(default_factory=dict)  # the engine's done event, for replies


class ChatHistory:
    """The conversation. At most one reply streams at a time (``streaming``)."""

    def __init__(self) -> None:
        self.events = Events("reset", "added", "text", "finished")
        self.system_prompt = ""
        self.messages: list[Message] = []
        self.streaming = False
        self.context_used = 0
        self.last_stats: dict[str, Any] = {}

    def request_messages(self) -> list[dict[str, str]]:
        """Messages as the engine's generate request takes them (system prompt first)."""
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        out += [{"role": m.role, "content": m.content} for m in self.messages]
        if self.streaming and out and out[-1]["role"] == "assistant":
            out.pop()  # the reply being written is not part of the prompt
        return out

    def add_user(self, text: str) -> None:
        if self.streaming:
            raise CarveError("a reply is still streaming; press Stop before sending another")
        text = text.strip()
        if not text:
            raise CarveError("the message is empty; type something to send")
        self.messages.append(Message("user", text))
        self.events.added.emit(self.messages[-1])

    def begin_reply(self) -> None:
        self.messages.append(Message("assistant", ""))
        self.streaming = True
        self.events.added.emit(self.messages[-1])

    def append(self, text: str) -> None:
        """Add streamed text to the reply being written (coalesced by the view per frame)."""
        if not self.streaming or not text:
            return
        self.messages[-1].content += text
        self.events.text.emit(text)

    def finish(self, stats: dict[str, Any] | None = None) -> None:
        if not self.streaming:
            return
        self.streaming = False
        stats = dict(stats or {})
        self.messages[-1].stats = stats
        self.last_stats = stats
        if "prompt_tokens" in stats:
            self.context_used = int(stats.get("prompt_tokens", 0)) + int(
                stats.get("completion_tokens", 0)
            )
        self.events.finished.emit(self.messages[-1])

    def can_regenerate(self) -> bool:
        return not self.streaming and any(m.role == "user" for m in self.messages)

    def drop_last_reply(self) -> None:
        """Forget the last reply so it can be generated again from the same prompt."""
        if self.streaming:
            raise CarveError("a reply is still streaming; press Stop before regenerating")
        while self.messages and self.messages[-1].role == "assistant":
            self.messages.pop()
        self.events.reset.emit()

    def new_chat(self) -> None:
        self.messages.clear()
        self.streaming = False
        self.context_used = 0
        self.last_stats = {}
        self.events.reset.emit()

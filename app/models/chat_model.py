"""Chat history and sampling settings: Qt-free, so a test drives a conversation without a window.

The view mirrors it; the engine client feeds it (``begin_reply``/``append``/``finish``). Sampling
settings are ``engine.process.sampling_params.SamplingParams`` (pure Python), the engine's own validator.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from app.models.events import Events
from engine.process.sampling_params import SamplingParams as SamplingSettings
from spec.errors import CarveError

__all__ = ["ChatHistory", "Message", "ReplyMeter", "SamplingSettings"]


class ReplyMeter:
    """Tokens and tokens/s of the reply streaming now, as the window shows them under the chat
    (the rate counts the tokens after the first, over the time since the first arrived)."""

    def __init__(self, clock: Any = None) -> None:
        import time

        self._clock = clock or time.monotonic
        self.tokens = 0
        self._first = self._last_shown = 0.0

    def begin(self) -> None:
        self.tokens = 0

    def token(self) -> bool:
        """Count one token; True when the status is due for a refresh (at most ten a second)."""
        now = self._clock()
        self.tokens += 1
        if self.tokens == 1:
            self._first = now
        if self.tokens == 1 or now - self._last_shown >= 0.1:
            self._last_shown = now
            return True
        return False

    @property
    def rate(self) -> float:
        dt = self._clock() - self._first
        return (self.tokens - 1) / dt if self.tokens > 1 and dt > 0 else 0.0

    def text(self, context_before: int = 0, ctx_limit: int = 0) -> str:
        parts = [f"generating: {self.tokens:,} tokens", f"{self.rate:.1f} tokens/s"]
        if context_before or ctx_limit:  # the first reply: its prompt is counted at "done"
            limit = f" / {ctx_limit:,}" if ctx_limit else ""
            parts.append(f"context over {context_before + self.tokens:,}{limit} tokens")
        return "  ·  ".join(parts)


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

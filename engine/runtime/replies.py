"""What the engine process (`engine/runtime/server.py`) says about replies and errors: the one
line a person sees for an error, whether a CUDA fault is sticky, text that is always valid
UTF-8, the token writer that detokenizes off the decode loop, and the checks of a generate
request's messages and context."""

from __future__ import annotations

import queue
import threading
from typing import Any

from engine.process import protocol as p
from spec.errors import CarveError


class ContextOverflow(CarveError):
    """The prompt, or the prompt and the max_tokens asked for, exceed the loaded context."""

    code = p.CONTEXT_OVERFLOW


def one_line(err: BaseException) -> str:
    """The message a person sees: CarveError's own sentence, else a short internal-error line."""
    if isinstance(err, CarveError):
        return str(err)
    text = " ".join(str(err).split())
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return "internal error: " + (text if len(text) <= 300 else text[:297] + "...")


def is_fatal(err: BaseException) -> bool:
    """A sticky CUDA fault (illegal address, launch failure) breaks every later call in this
    process; out-of-memory does not."""
    text = str(err)
    return "CUDA error" in text and "out of memory" not in text


def safe_text(text: str) -> str:
    """Always-valid UTF-8: a lone surrogate would make the client's terminal or widget choke."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


class TokenWriter:
    """Detokenizes and writes a reply's token events on a thread of its own, so that the decode
    loop only hands over ids. Tokens that arrive while a write is under way go out together in
    the next one (one write and one flush for all of them). ``engine``: what has
    ``emit_many(events)`` (the engine process)."""

    def __init__(self, engine: Any, decoder: Any) -> None:
        self.engine, self.decoder = engine, decoder
        self.ids: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="token-writer")
        self.thread.start()

    def put(self, token_id: int) -> None:
        self.ids.put(int(token_id))

    def close(self) -> None:
        """Write what is queued, the tail of an unfinished character, and stop."""
        self.ids.put(None)
        self.thread.join()

    def _run(self) -> None:
        done = False
        while not done:
            batch = [self.ids.get()]
            while not self.ids.empty():
                batch.append(self.ids.get())
            msgs = []
            for i in batch:
                if i is None:
                    done = True
                    break
                msgs.append(p.Token(i, safe_text(self.decoder.push(i))))
            if done and hasattr(self.decoder, "flush"):
                tail = safe_text(self.decoder.flush())
                if tail:  # bytes of a character the reply never finished: U+FFFD, as id -1
                    msgs.append(p.Token(-1, tail))
            if msgs:
                self.engine.emit_many(msgs)


def rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else 0.0


def plan_ctx(session: Any) -> int:
    return int(session.layout.plan.ctx)


def check_messages(messages: list[dict]) -> list[dict]:
    if not messages:
        raise CarveError("generate: no messages; send at least one user message")
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise CarveError(f"generate: message {i} needs text fields 'role' and 'content'")
    if not any(m["content"].strip() for m in messages):
        raise CarveError("generate: the prompt is empty; type a message")
    return messages

"""Stop strings, as OpenAI applies them: generation ends at the first one and it is not part of
the reply. Streamed text is held back only while its end could still become a stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopText:
    """Feed streamed text with ``push``; it returns the text that can go out now. Once a stop
    string appears, ``stopped`` is True and the text from it on is dropped."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.stopped = False
        self.tokens = 0  # the pieces pushed until the stop string (that one included)
        self._held = ""  # the tail that is a prefix of some stop string

    def push(self, text: str) -> str:
        if self.stopped:
            return ""
        self.tokens += 1
        buf = self._held + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buf[: min(hits)]
        keep = self._prefix_tail(buf)
        self._held = buf[len(buf) - keep :]
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """The end of the reply: what was held back was no stop string after all."""
        out, self._held = ("" if self.stopped else self._held), ""
        return out

    def _prefix_tail(self, buf: str) -> int:
        """Length of the longest end of ``buf`` that begins some stop string."""
        longest = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(buf)), longest, -1):
                if buf.endswith(stop[:n]):
                    longest = n
                    break
        return longest

"""The transcript: mirrors ``ChatHistory`` in a QTextBrowser, Markdown with code blocks.

Streaming is coalesced: ``ChatHistory.events.text`` only marks the view dirty; a frame timer
(~30 Hz) renders what arrived since. Re-rendering a whole long reply as Markdown every frame would
cost tens of ms, so a reply is split at its last paragraph break outside a code fence: everything
before is rendered once and kept ("settled"), only the tail after it is re-rendered per frame.
"""

from __future__ import annotations

import time

from PySide6.QtCore import QTimer
from PySide6.QtGui import (
    QColor,
    QFont,
    QTextBlock,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextFormat,
)
from PySide6.QtWidgets import QTextBrowser, QWidget

from app.models.chat_model import ChatHistory, Message
from app.theme import Theme

FRAME_MS = 33
TAIL_MARKDOWN_EVERY = 6  # frames (~200 ms) between Markdown re-renders of the unsettled tail
TAIL_MARKDOWN_MAX = 2000  # chars; a longer unsettled tail stays plain text until it settles


def settle_point(text: str, start: int) -> int:
    """Index in ``text`` (>= start) up to which Markdown can be rendered for good: the last blank
    line after ``start`` that is not inside a ``` fence; ``start`` when there is none."""
    idx = text.rfind("\n\n", start)
    while idx > start:
        if text.count("```", 0, idx) % 2 == 0:
            return idx + 2
        idx = text.rfind("\n\n", start, idx)
    return start


class ChatView(QTextBrowser):
    def __init__(self, history: ChatHistory, theme: Theme, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setObjectName("chatView")
        self.history = history
        self.theme = theme
        self.setOpenExternalLinks(True)
        self.document().setDocumentMargin(14)
        self._settled = 0  # chars of the streaming reply rendered for good
        self._tail_pos = 0  # document position where the re-rendered tail begins
        self._dirty = False
        self._frames = 0
        self._shown = 0  # chars of the streaming reply in the document
        self._tail_styled = False
        self.render_ms_max = 0.0  # slowest frame render, for the streaming-stall figure
        self._frame = QTimer(self)
        self._frame.setInterval(FRAME_MS)
        self._frame.timeout.connect(self._flush)
        history.events.reset.connect(self._rebuild)
        history.events.added.connect(self._on_added)
        history.events.text.connect(self._on_text)
        history.events.finished.connect(self._on_finished)
        self._loaded = False
        self._rebuild()

    def set_loaded(self, loaded: bool) -> None:
        """The empty transcript's hint follows the engine: launch first, or type now."""
        if loaded != self._loaded:
            self._loaded = loaded
            if getattr(self, "_placeholder", False):
                self._rebuild()

    def apply_theme(self, theme: Theme) -> None:
        self.theme = theme
        self._rebuild()

    # -- mirror the history ------------------------------------------------------------------
    def _rebuild(self) -> None:
        self._frame.stop()
        self.clear()
        if not self.history.messages:
            first = ("The model is loaded: type below." if self._loaded else
                     "Launch a model, then type below.")
            self.setHtml(
                f"<p style='color:{self.theme.muted}'>{first} "
                "Replies stream here; Markdown and code blocks are rendered.</p>")
            self._placeholder = True
            return
        self._placeholder = False
        for m in self.history.messages:
            self._append_message(m)

    def _on_added(self, message: Message) -> None:
        if getattr(self, "_placeholder", False):
            self.clear()
            self._placeholder = False
        self._append_message(message)

    def _append_message(self, m: Message) -> None:
        cursor = self._end_cursor()
        head = QTextBlockFormat()
        if self.document().isEmpty():
            cursor.setBlockFormat(head)
        else:
            head.setTopMargin(16)
            cursor.insertBlock(head, QTextCharFormat())
        who = {"user": "You", "assistant": "Assistant", "system": "System"}.get(m.role, m.role)
        name = QTextCharFormat()
        name.setFontWeight(QFont.Weight.Bold)
        name.setForeground(QColor(self.theme.terms["weights"] if m.role == "user"
                                  else self.theme.verdict["fits"]))
        cursor.insertText(who, name)
        body = QTextBlockFormat()
        body.setTopMargin(4)
        cursor.insertBlock(body, QTextCharFormat())
        if m.role == "user":
            cursor.insertText(m.content)
            return
        self._tail_pos = cursor.position()
        self._settled = self._shown = 0
        self._tail_styled = False
        if self.history.streaming and m is self.history.messages[-1]:
            self._frame.start()
        self._render_tail(m.content, final=not self.history.streaming)

    def _on_text(self, _text: str) -> None:
        self._dirty = True  # rendered by the next frame, however many tokens arrive before it

    def _on_finished(self, message: Message) -> None:
        self._frame.stop()
        self._dirty = False
        self._render_tail(message.content, final=True)
        reason = message.stats.get("reason")
        if reason in ("cancelled", "length"):
            note = "stopped" if reason == "cancelled" else "reached the token limit"
            self._end_cursor().insertHtml(f" <i style='color:{self.theme.muted}'>({note})</i>")

    def _flush(self) -> None:
        if not self._dirty or not self.history.messages:
            return
        self._dirty = False
        self._frames += 1
        self._render_tail(self.history.messages[-1].content, final=False)

    # -- rendering ---------------------------------------------------------------------------
    def _render_tail(self, content: str, final: bool) -> None:
        """Show ``content`` (the reply so far). Settled paragraphs are rendered as Markdown
        once; the unsettled tail is appended as plain text each frame (cheap) and re-rendered
        as Markdown every few frames while it is short, so one frame never costs more than a
        short tail's parse, however long the reply grows."""
        start = time.perf_counter()
        bar = self.verticalScrollBar()
        at_bottom = bar.value() >= bar.maximum() - 4
        cut = len(content) if final else settle_point(content, self._settled)
        tail = content[cut:]
        restyle = final or cut > self._settled or (
            self._frames % TAIL_MARKDOWN_EVERY == 0 and len(tail) <= TAIL_MARKDOWN_MAX)
        if restyle:
            self._clear_tail()
            if cut > self._settled:
                self._insert_markdown(content[self._settled:cut])
                self._settled = cut
                if not final:  # what streams next starts a block of its own, in plain format
                    self._end_cursor().insertBlock(QTextBlockFormat(), QTextCharFormat())
                self._tail_pos = self._end_cursor().position()
            if tail:
                self._insert_markdown(tail)
        else:
            shown = self._shown - self._settled if self._shown >= self._settled else 0
            if self._tail_styled:  # the tail is Markdown now: start it again as plain text
                self._clear_tail()
                shown = 0
            self._end_cursor().insertText(tail[shown:], QTextCharFormat())
        self._tail_styled = restyle
        self._shown = len(content)
        if at_bottom:
            bar.setValue(bar.maximum())
        self.render_ms_max = max(self.render_ms_max, (time.perf_counter() - start) * 1e3)

    def _clear_tail(self) -> None:
        cursor = self._end_cursor()
        cursor.setPosition(self._tail_pos, QTextCursor.MoveMode.KeepAnchor)
        cursor.removeSelectedText()

    def _insert_markdown(self, text: str) -> None:
        cursor = self._end_cursor()
        begin = cursor.position()
        cursor.insertMarkdown(text)
        self._style_code(begin, cursor.position())

    def _style_code(self, begin: int, end: int) -> None:
        """Qt's Markdown import marks fenced code blocks but gives them no look; add one."""
        doc = self.document()
        block = doc.findBlock(begin)
        fmt = QTextBlockFormat()
        fmt.setBackground(QColor(self.theme.free))
        fmt.setLeftMargin(8)
        char = QTextCharFormat()
        char.setFontFamilies(["DejaVu Sans Mono", "Menlo", "Consolas", "monospace"])
        char.setFontStyleHint(QFont.StyleHint.Monospace)
        while block.isValid() and block.position() <= end:
            if _is_code(block):
                c = QTextCursor(block)
                c.mergeBlockFormat(fmt)
                c.select(QTextCursor.SelectionType.BlockUnderCursor)
                c.mergeCharFormat(char)
            block = block.next()

    def _end_cursor(self) -> QTextCursor:
        cursor = QTextCursor(self.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        return cursor


def _is_code(block: QTextBlock) -> bool:
    """A fenced code line. Qt marks those with BlockCodeFence, except the first line of an
    insertMarkdown() that lands in an existing block: that one only keeps the monospace
    character format of its text, so accept a block whose every fragment is monospace."""
    if block.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence):
        return True
    it = block.begin()
    seen = False
    while not it.atEnd():
        families = it.fragment().charFormat().fontFamilies() or []
        if "monospace" not in families:
            return False
        seen = True
        it += 1
    return seen

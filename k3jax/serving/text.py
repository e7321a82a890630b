"""Streamed text: token ids -> UTF-8 text as it becomes whole, cut at the first stop string.

A stop string is matched on the decoded text, across token boundaries: text that could still be the
start of a stop string is held back until it is known not to be, and the output ends right before
the stop string (which is not returned). A character split across tokens is held back until whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Sequence

from k3jax.tokenizer import Tokenizer


class StopMatcher:
    """Feed text pieces; get back what is safe to show, and whether a stop string was met."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = tuple(stops)
        self.text = ""
        self.sent = 0
        self.stopped = False

    def push(self, piece: str) -> str:
        """Add text; returns the new text that can be shown (empty once stopped)."""
        if self.stopped:
            return ""
        self.text += piece
        longest = max(map(len, self.stops), default=0)
        search_from = max(0, self.sent - longest + 1)
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self.text = self.text[: min(hits)]
            return self._take(len(self.text))
        hold = 0
        for stop in self.stops:  # the longest tail of the text that starts a stop string
            for n in range(min(len(stop) - 1, len(self.text)), hold, -1):
                if self.text.endswith(stop[:n]):
                    hold = n
                    break
        return self._take(len(self.text) - hold)

    def flush(self) -> str:
        """The end of the stream: everything held back."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out = self.text[self.sent: end]
        self.sent = max(self.sent, end)
        return out


class TextStream:
    """Token ids -> text (special tokens left out), with stop strings."""

    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str]) -> None:
        self.tokenizer = tokenizer
        self.special = frozenset(tokenizer.special_tokens.values())
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.matcher = StopMatcher(stops)

    @property
    def stopped(self) -> bool:
        return self.matcher.stopped

    @property
    def text(self) -> str:
        return self.matcher.text

    def push(self, token: int) -> str:
        try:
            raw = b"" if token in self.special else self.tokenizer.decode_bytes([token])
        except ValueError:  # an id the tokenizer cannot decode (an unnamed reserved id): no text
            raw = b""
        return self.matcher.push(self.decoder.decode(raw))

    def flush(self) -> str:
        return self.matcher.push(self.decoder.decode(b"", final=True)) + self.matcher.flush()

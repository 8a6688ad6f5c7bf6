"""Incremental detokenization with stop strings: what a stream may send now, and where the text ends.

The whole output is decoded after every Step (byte-level BPE decodes are prefix-stable except for a
trailing partial UTF-8 character, which shows as U+FFFD and is held back). Text that could be the
start of a stop string is held back too, so a stream never sends part of a stop string.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""          # decoded output, cut at the first stop string once one is seen
        self.sent = 0           # characters of `text` already handed out
        self.stopped = False    # a stop string was found: the request should end

    def push(self, tokens: list[int]) -> str:
        """Add a Step's tokens; return the new text that is safe to send."""
        if self.stopped:
            return ""
        self.ids += tokens
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((i for i in (self.text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = self.text[:max(cut, self.sent)], True
            return self._take(len(self.text))
        stable = len(self.text.rstrip("\ufffd"))
        return self._take(max(self.sent, stable - self.hold))

    def finish(self) -> str:
        """The rest of the text, once the request has ended."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

"""Incremental detokenization with stop strings: what a stream may send now, and where the text ends.

The whole output is decoded after every Step (byte-level BPE decodes are prefix-stable except for a
trailing partial UTF-8 character, which shows as U+FFFD and is held back). Text that could be the
start of a stop string is held back too, so a stream never sends part of a stop string.
"""

from __future__ import annotations

from tokenizers import decoders
from transformers.convert_slow_tokenizer import bytes_to_unicode


class TextStream:
    def __init__(self, tokenizer, stops: list[str]):
        self.tokenizer = tokenizer
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []  # the tokens returned: through the one that completed a stop string, if any
        self.text = ""          # decoded output, cut at the first stop string once one is seen
        self.sent = 0           # characters of `text` already handed out
        self.stopped = False    # a stop string was found: the request should end

    def push(self, tokens: list[int]) -> str:
        """Add a Step's tokens; return the new text that is safe to send."""
        if self.stopped:
            return ""
        start = len(self.ids)
        self.ids += tokens
        self.text = self._decode(self.ids)
        if self._stop_at(self.text) >= 0:
            # A round may run past the stop string: keep the tokens through the one that completed it, as
            # a decode of one token at a time would, so usage and logprobs count what the text holds
            end = next(n for n in range(start + 1, len(self.ids) + 1)
                       if self._stop_at(self._decode(self.ids[:n])) >= 0)
            self.ids = self.ids[:end]
            self.text = self._decode(self.ids)
            self.text, self.stopped = self.text[:max(self._stop_at(self.text), self.sent)], True
            return self._take(len(self.text))
        stable = len(self.text.rstrip("\ufffd"))
        return self._take(max(self.sent, stable - self.hold))

    def finish(self) -> str:
        """The rest of the text, once the request has ended."""
        return self._take(len(self.text))

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _stop_at(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)

    def _take(self, end: int) -> str:
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out


class TokenText:
    """One token as logprobs show it: its text decoded alone (U+FFFD where it holds part of a character),
    its own bytes (which put such parts back together), and the bytes it adds to the output text
    (none for a control token, which the text skips)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # what a decode with skip_special_tokens leaves out: every added token marked special (IQuest-Q1's role,
        # think and tool-call tokens), not only those named in the tokenizer's special-token map (EOS)
        self.special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items()
                                                         if t.special}
        self.added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        byte_level = isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel)
        self.unbyte = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
        self.cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        if token not in self.cache:
            text = self.tokenizer.decode([token])
            if token in self.added or self.unbyte is None:
                raw = text.encode()
            else:
                raw = bytes(self.unbyte[c] for c in self.tokenizer.convert_ids_to_tokens(token))
            self.cache[token] = (text, raw)
        return self.cache[token]

    def text_bytes(self, token: int) -> bytes:
        return b"" if token in self.special else self(token)[1]

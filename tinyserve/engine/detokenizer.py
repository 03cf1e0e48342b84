"""Incremental detokenization with stop strings.

Decoding restarts at the last character boundary (O(1) per token); a partial UTF-8 character
is held back, and so is a tail that could still become a stop string. A fast tokenizer without
decode post-processing is decoded through its Rust backend directly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

_REPLACEMENT = "\ufffd"
# A UTF-8 character has at most 4 bytes, so at most 4 byte-level tokens: past that a trailing
# U+FFFD is a real invalid sequence, not an incomplete one, and is emitted.
_MAX_HELD_TOKENS = 4


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], **kwargs: Any) -> str: ...


class IncrementalDetokenizer:
    """Per-request decoder. `add(ids)` returns the new text that is safe to emit; once a stop
    string matched, `stopped` is True, `matched` is that string and nothing more is emitted.
    `finish()` returns the text still held back when the request ends for another reason.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text
        self._max_stop = max((len(s) for s in self.stop), default=0)
        self._decode_fn = _decoder(tokenizer)
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the decode window (a character boundary)
        self._read_offset = 0  # tokens whose text is already in self._text
        self._text = ""  # decoded text (cut at the stop string once matched)
        self._emitted = 0  # characters of self._text handed out

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self._text[:self._emitted]

    def add(self, token_ids: Sequence[int]) -> str:
        if self.stopped:
            return ""
        self._ids.extend(token_ids)
        self._decode(final=False)
        return self._emit(final=False)

    def finish(self) -> str:
        """Flush held-back text (a partial character, a possible stop-string start)."""
        if self.stopped:
            return ""
        self._decode(final=True)
        return self._emit(final=True)

    def _decode(self, *, final: bool) -> None:
        if self._read_offset == len(self._ids):
            return
        prefix = self._decode_ids(self._ids[self._prefix_offset:self._read_offset])
        end = len(self._ids)
        full = self._decode_ids(self._ids[self._prefix_offset:end])
        if not final:
            # Drop trailing tokens of an incomplete character (at most _MAX_HELD_TOKENS).
            while full.endswith(_REPLACEMENT) and len(self._ids) - end < _MAX_HELD_TOKENS:
                end -= 1
                if end <= self._read_offset:
                    return  # nothing complete yet: wait for the next bytes
                full = self._decode_ids(self._ids[self._prefix_offset:end])
            if full.endswith(_REPLACEMENT):  # a real invalid sequence: emit it as it is
                end = len(self._ids)
                full = self._decode_ids(self._ids[self._prefix_offset:end])
        self._text += full[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = end

    def _decode_ids(self, ids: list[int]) -> str:
        return self._decode_fn(ids) if ids else ""

    def _emit(self, *, final: bool) -> str:
        end = len(self._text)
        if self.stop:
            start = max(0, self._emitted - self._max_stop + 1)
            # (end, start) of each stop string's first match: the one that completes first
            # wins, as if the text came one character at a time (ties: the longest).
            hits = [(i + len(s), i, s) for s in self.stop
                    if (i := self._text.find(s, start)) >= 0]
            if hits:
                _, end, self.matched = min(hits)
                self._text = self._text[:end]
                self.stopped = True
            elif not final:
                end -= _stop_prefix_len(self._text, self.stop, self._max_stop)
        end = max(end, self._emitted)
        delta = self._text[self._emitted:end]
        self._emitted = end
        return delta


def _decoder(tokenizer: Tokenizer) -> Callable[[list[int]], str]:
    """`ids -> text` without special tokens: the Rust backend of a Hugging Face fast tokenizer
    when its `decode` would return the backend's text unchanged, else `tokenizer.decode`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = tokenizer
    if (getattr(tokenizer, "clean_up_tokenization_spaces", None) is False
            and callable(getattr(backend, "decode", None))):
        decoder = backend
    return lambda ids: decoder.decode(ids, skip_special_tokens=True)


def _stop_prefix_len(text: str, stops: tuple[str, ...], max_len: int) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string."""
    for k in range(min(max_len - 1, len(text)), 0, -1):
        tail = text[-k:]
        if any(s.startswith(tail) for s in stops):
            return k
    return 0

"""Client text -> token ids: special-token strings a client sends stay text, and a prompt longer
than the context is refused before it is tokenised in full.

Every client string is escaped before the template renders it (each special-token string
becomes a private-use marker), the rendered text is split at the control tokens the template
wrote, and the pieces between are tokenised with special tokens off after unescaping: a user's
literal `<|im_end|>` cannot forge a turn, and benign input gets the ids of the whole text.
A token covers at most `max_token_chars` characters, so a text over `limit x max_token_chars`
is refused at once; a long one is counted in pieces and refused as soon as they exceed.
"""

from __future__ import annotations

import re
import weakref
from typing import Any

_ESC = "\ue000"  # private use area: marks a client's special-token string (or a literal _ESC)
_FIRST = 0xE100  # _ESC + chr(_FIRST + k): the k-th special token; _ESC + _ESC: a literal _ESC
PIECE_CHARS_PER_TOKEN = 8  # a piece of the length probe holds (limit + 1) x this many chars
CUT_MARGIN = 8  # tokens a cut between two pieces may add to their counts


class PromptTooLong(ValueError):
    """The text holds more than `limit` tokens: `tokens` of them when `exact`, else at least
    that many (it was refused before it was tokenised in full)."""

    def __init__(self, tokens: int, limit: int, *, exact: bool = False) -> None:
        super().__init__(f"{tokens} tokens" if exact else f"more than {limit} tokens")
        self.tokens = tokens
        self.limit = limit
        self.exact = exact


class PromptEncoder:
    """Token ids of client text for one tokenizer (`encoder_for(tokenizer)` caches one)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = sorted({t.content for t in decoder.values()
                           if getattr(t, "special", False) and t.content}, key=len, reverse=True)
        self.specials: tuple[str, ...] = tuple(specials)
        self._special_ids = {s: tokenizer.convert_tokens_to_ids(s) for s in specials}
        self._marker = {s: _ESC + chr(_FIRST + k) for k, s in enumerate(specials)}
        self._unmarker = {m[1]: s for s, m in self._marker.items()} | {_ESC: _ESC}
        alternatives = "|".join(re.escape(s) for s in specials)
        self._split = re.compile(f"({alternatives})") if specials else None
        self._find = re.compile("|".join([re.escape(_ESC), *map(re.escape, specials)]))
        self.max_token_chars = _longest_token(tokenizer)

    def escape(self, value: Any) -> Any:
        """`value` (strings, lists, dicts, nested) with every special-token string in its
        strings (dict keys included) replaced by a marker; other values as they are."""
        if isinstance(value, str):
            if _ESC not in value and not any(s in value for s in self.specials):
                return value
            return self._find.sub(lambda m: self._marker.get(m.group(0), _ESC + _ESC), value)
        if isinstance(value, dict):
            return {self.escape(k): self.escape(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.escape(v) for v in value]
        return value

    def unescape(self, text: str) -> str:
        """The client's literal text of an escaped string."""
        if _ESC not in text:
            return text
        return re.sub(f"{_ESC}(.)", lambda m: self._unmarker.get(m.group(1), m.group(1)), text,
                      flags=re.S)

    def encode_rendered(self, text: str, limit: int | None = None) -> list[int]:
        """Ids of a template's output whose client strings were `escape`d: the control tokens
        the template wrote, and the client's text (special-token strings included) as text.
        Raises PromptTooLong when `limit` is set and the ids would be more."""
        self._check_chars(text, limit)
        ids: list[int] = []
        pieces = self._split.split(text) if self._split is not None else [text]
        for k, piece in enumerate(pieces):
            if k % 2:  # a control token the template wrote
                ids.append(self._special_ids[piece])
            elif piece:
                left = None if limit is None else limit - len(ids)
                try:
                    ids += self.encode(self.unescape(piece), left, specials=False)
                except PromptTooLong as exc:
                    raise PromptTooLong(len(ids) + exc.tokens, limit) from None
            if limit is not None and len(ids) > limit:
                raise PromptTooLong(len(ids), limit)
        return ids

    def encode(self, text: str, limit: int | None = None, *, specials: bool = True
               ) -> list[int]:
        """Ids of `text` (no BOS/EOS added); special-token strings in it are control tokens
        when `specials` is true, text otherwise. Raises PromptTooLong when `limit` is set
        and the ids would be more (refused after tokenising at most a few pieces of
        `(limit + 1) x PIECE_CHARS_PER_TOKEN` characters)."""
        self._check_chars(text, limit)
        if limit is not None:
            self._probe(text, limit, specials)
        ids = self._ids(text, specials)
        if limit is not None and len(ids) > limit:
            raise PromptTooLong(len(ids), limit, exact=True)
        return ids

    def _check_chars(self, text: str, limit: int | None) -> None:
        if limit is not None and len(text) > (limit + 1) * self.max_token_chars:
            raise PromptTooLong(-(-len(text) // self.max_token_chars), limit)

    def _probe(self, text: str, limit: int, specials: bool) -> None:
        """Count the tokens of `text` piece by piece; raise as soon as they surely exceed."""
        size = (limit + 1) * PIECE_CHARS_PER_TOKEN
        if len(text) <= size:
            return
        count, cuts, start = 0, 0, 0
        while start < len(text):
            end = _cut(text, start + size)
            count += len(self._ids(text[start:end], specials))
            if end < len(text):
                cuts += 1
            if count - CUT_MARGIN * cuts > limit:
                raise PromptTooLong(count - CUT_MARGIN * cuts, limit)
            start = end

    def _ids(self, text: str, specials: bool) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False,
                                          split_special_tokens=not specials))


def _cut(text: str, end: int) -> int:
    """A cut at or before `end` at a whitespace (within 256 characters), else at `end`."""
    if end >= len(text):
        return len(text)
    for i in range(end, max(end - 256, 0), -1):
        if text[i - 1].isspace() and not text[i].isspace():
            return i
    return end


def _longest_token(tokenizer: Any) -> int:
    """Characters of the longest vocabulary entry (decoded), at least 1."""
    try:
        vocab = tokenizer.get_vocab()
        longest = max(vocab, key=len) if vocab else ""
        # byte-level pieces are longer than their text; added tokens are their own text
        return max(1, len(longest), *(len(t) for t in getattr(tokenizer, "all_special_tokens",
                                                                     ()) or ()))
    except Exception:  # a tokenizer without a vocabulary listing: no character bound
        return 1 << 30


_ENCODERS: weakref.WeakKeyDictionary[Any, PromptEncoder] = weakref.WeakKeyDictionary()


def encoder_for(tokenizer: Any) -> PromptEncoder:
    """The PromptEncoder of `tokenizer` (made once)."""
    try:
        return _ENCODERS[tokenizer]
    except (KeyError, TypeError):
        enc = PromptEncoder(tokenizer)
        try:
            _ENCODERS[tokenizer] = enc
        except TypeError:  # not weak-referenceable: not cached
            pass
        return enc

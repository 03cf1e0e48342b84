"""Log-probabilities in OpenAI's shapes: chat's `logprobs.content` entries and the completions
object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's text is its own bytes decoded alone (byte-level BPE: U+FFFD in `token` for part of a
character, the exact `bytes`); minus infinity is sent as -9999.0, as OpenAI does.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from tinyserve.core import TokenLogprobs

MIN_LOGPROB = -9999.0  # what OpenAI sends for a token the model rules out


def _value(logprob: float) -> float:
    """A log-probability as JSON can carry it (NaN, which no model should give, too)."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, printable character -> byte."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """Token id -> (text, bytes) for one tokenizer, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}
        backend = getattr(tokenizer, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._byte_level = type(decoder).__name__ == "ByteLevel"

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._lookup(token_id)
        return hit

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        if self._byte_level:
            piece = self._tokenizer.convert_ids_to_tokens(token_id)
            decoder = _byte_decoder()
            if isinstance(piece, str) and piece and all(ch in decoder for ch in piece):
                raw = bytes(decoder[ch] for ch in piece)
                return raw.decode("utf-8", errors="replace"), list(raw)
        text = self._tokenizer.decode([token_id])
        return text, list(text.encode("utf-8"))


def chat_entries(text_of: TokenText, logprobs: Sequence[TokenLogprobs]) -> list[dict[str, Any]]:
    """Chat's `logprobs.content` entries, one per token."""
    out = []
    for lp in logprobs:
        token, raw = text_of(lp.token_id)
        top = []
        for tid, value in lp.top:
            t, b = text_of(tid)
            top.append({"token": t, "logprob": _value(value), "bytes": b})
        out.append({"token": token, "logprob": _value(lp.logprob), "bytes": raw,
                    "top_logprobs": top})
    return out


def completion_logprobs(text_of: TokenText, logprobs: Sequence[TokenLogprobs],
                        offset: int) -> dict[str, Any]:
    """The completions `logprobs` object of `logprobs`, whose first token starts at
    character `offset` of the completion's text; each token advances the offset by the
    length of its own text (a token holding part of a character counts as one, and the
    tokens of a matched stop string, whose text is not sent, count too)."""
    tokens, values, tops, offsets = [], [], [], []
    for lp in logprobs:
        token, _ = text_of(lp.token_id)
        tokens.append(token)
        values.append(_value(lp.logprob))
        tops.append({text_of(tid)[0]: _value(value) for tid, value in lp.top})
        offsets.append(offset)
        offset += len(token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}

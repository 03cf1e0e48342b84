"""OpenAI response shapes: one choice's text deltas -> SSE chunks or one response body.

A formatter (the `Formatter` protocol, which the Anthropic and Responses formatters follow
too) turns one choice's deltas into chunks, frames them as SSE events and builds the body;
with `n` > 1 there is one formatter per choice, sharing the response id.

Log-probabilities travel with the first chunk sent after their tokens arrive (a token whose
text is held back has its entry in a later chunk); every token's entry is sent once, in order.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tinyserve.core import TokenLogprobs
from tinyserve.server.errors import APIError
from tinyserve.server.logprobs import TokenText, chat_entries, completion_logprobs
from tinyserve.server.responses import ChatAssembler

DONE = "data: [DONE]\n\n"


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    """One SSE event carrying `obj` as strict JSON (NaN raises ValueError), named `event`
    when given."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n" if event is None else f"event: {event}\ndata: {text}\n\n"


@dataclass(frozen=True)
class TokenCounts:
    """A response's tokens; `cached`: prompt tokens served from the prefix cache."""

    prompt: int
    completion: int
    cached: int = 0


class Formatter(Protocol):
    """What the generation driver asks of one choice's formatter."""

    endpoint: str  # the metrics label
    prompt_param: str  # the request field a prompt that cannot fit is blamed on
    id: str
    finish_reason: str | None

    def start(self) -> list[dict[str, Any]]: ...
    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()
                ) -> list[dict[str, Any]]: ...
    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]: ...
    def encode(self, chunk: dict[str, Any]) -> str: ...
    def error_event(self, err: APIError) -> str: ...  # a failed stream's last events
    def stream_end(self, counts: TokenCounts, include_usage: bool) -> list[str]: ...
    def body(self, counts: TokenCounts) -> dict[str, Any]: ...


def usage(counts: TokenCounts) -> dict[str, Any]:
    return {"prompt_tokens": counts.prompt, "completion_tokens": counts.completion,
            "total_tokens": counts.prompt + counts.completion,
            "prompt_tokens_details": {"cached_tokens": counts.cached}}


class _OpenAIFormatter:
    """One choice of an OpenAI response: `data: {json}` events, the usage chunk when asked,
    `data: [DONE]` (after an error event too). `first`: the formatter of the response's first
    choice, whose id this one shares and whose body holds every choice."""

    endpoint: str
    prompt_param: str
    id_prefix: str
    object: str  # the body's
    chunk_object: str  # the streamed chunks'

    def __init__(self, model: str, *, usage_null: bool, token_text: TokenText | None = None,
                 first: _OpenAIFormatter | None = None) -> None:
        if first is None:
            self.id, self.created = f"{self.id_prefix}-{uuid.uuid4().hex}", int(time.time())
            self.choices: list[_OpenAIFormatter] = []
        else:
            self.id, self.created, self.choices = first.id, first.created, first.choices
        self.index = len(self.choices)
        self.choices.append(self)
        self.model = model
        self._usage_null = usage_null
        self._text_of = token_text
        self._logprobs: list[TokenLogprobs] = []  # every token's, for the body
        self._unsent = 0  # tokens not in a chunk yet (the last ones of _logprobs)
        self.finish_reason: str | None = None

    def _envelope(self, choices: list[dict[str, Any]], object: str) -> dict[str, Any]:
        return {"id": self.id, "object": object, "created": self.created, "model": self.model,
                "choices": choices}

    def _chunk(self, choice: dict[str, Any], reason: str | None = None) -> dict[str, Any]:
        choice = {"index": self.index, **choice, "logprobs": None, "finish_reason": reason}
        if self._unsent:
            choice["logprobs"] = self._chunk_logprobs(self._logprobs[-self._unsent:])
            self._unsent = 0
        chunk = self._envelope([choice], self.chunk_object)
        if self._usage_null:
            chunk["usage"] = None
        return chunk

    def _add_logprobs(self, logprobs: Sequence[TokenLogprobs]) -> None:
        if self._text_of is not None and logprobs:
            self._logprobs += logprobs
            self._unsent += len(logprobs)

    def encode(self, chunk: dict[str, Any]) -> str:
        return sse(chunk)

    def error_event(self, err: APIError) -> str:
        return sse(err.body()) + DONE

    def stream_end(self, counts: TokenCounts, include_usage: bool) -> list[str]:
        last = self._envelope([], self.chunk_object)
        last["usage"] = usage(counts)
        return ([sse(last)] if include_usage else []) + [DONE]

    def body(self, counts: TokenCounts) -> dict[str, Any]:
        out = self._envelope([f.choice() for f in self.choices], self.object)
        out["usage"] = usage(counts)
        return out


class ChatFormatter(_OpenAIFormatter):
    endpoint, prompt_param, id_prefix = "chat", "messages", "chatcmpl"
    object, chunk_object = "chat.completion", "chat.completion.chunk"

    def __init__(self, model: str, assembler: ChatAssembler, **kw: Any) -> None:
        super().__init__(model, **kw)
        self.assembler = assembler

    def _chunk_logprobs(self, tokens: list[TokenLogprobs]) -> dict[str, Any]:
        return {"content": chat_entries(self._text_of, tokens)}

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"delta": {"role": "assistant", "content": ""}})]

    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        self._add_logprobs(logprobs)
        return [self._chunk({"delta": d}) for d in self.assembler.feed(text)] if text else []

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        chunks = [self._chunk({"delta": d}) for d in self.assembler.finish()]
        self.finish_reason = self.assembler.finish_reason(engine_reason)
        return chunks + [self._chunk({"delta": {}}, self.finish_reason)]

    def choice(self) -> dict[str, Any]:
        return {"index": self.index, "message": self.assembler.message(),
                "logprobs": (self._chunk_logprobs(self._logprobs)
                             if self._text_of is not None else None),
                "finish_reason": self.finish_reason}


class CompletionFormatter(_OpenAIFormatter):
    endpoint, prompt_param, id_prefix = "completions", "prompt", "cmpl"
    object = chunk_object = "text_completion"

    def __init__(self, model: str, **kw: Any) -> None:
        super().__init__(model, **kw)
        self._offset = 0  # text offset of the first unsent token
        self.text = ""

    def _chunk_logprobs(self, tokens: list[TokenLogprobs]) -> dict[str, Any]:
        lp = completion_logprobs(self._text_of, tokens, self._offset)
        self._offset += sum(len(t) for t in lp["tokens"])
        return lp

    def start(self) -> list[dict[str, Any]]:
        return []

    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        self._add_logprobs(logprobs)
        if not text:
            return []
        self.text += text
        return [self._chunk({"text": text})]

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        self.finish_reason = engine_reason
        return [self._chunk({"text": ""}, engine_reason)]

    def choice(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.text,
                "logprobs": (completion_logprobs(self._text_of, self._logprobs, 0)
                             if self._text_of is not None else None),
                "finish_reason": self.finish_reason}

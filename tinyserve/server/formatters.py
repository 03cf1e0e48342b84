"""Per-endpoint response shapes: engine outputs -> streamed chunks or one response body.

A formatter (the `Formatter` protocol) turns one choice's text deltas into chunks (`start`,
`on_text`, `on_finish`), frames them as SSE events (`encode`, `error_event`, `stream_end`:
OpenAI's `data:` lines, a usage chunk on request and `data: [DONE]` here, after an error
event too; every event strict JSON: `streaming.sse`) and builds the
non-streamed body (`body`, with every choice's `choice()` when the request asks for `n` > 1:
one formatter per choice, sharing the response id). The generation driver in
`server.generate` is shared by every endpoint; only these shapes differ (the Anthropic and
Responses formatters live beside their translators).

Log-probabilities (when the request asks: `token_text` set) travel with the first chunk
sent after their tokens arrive: a token whose text is held back (a possible stop string, a
tool call being parsed) has its entry in a later chunk, the last ones in the finishing
chunk; every token's entry is sent once, in order. Chat entries cover every generated token,
reasoning included.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from tinyserve.core import TokenLogprobs
from tinyserve.server.errors import APIError
from tinyserve.server.logprobs import TokenText, chat_entries, completion_logprobs
from tinyserve.server.responses import (
    ChatAssembler,
    chat_chunk,
    completion_chunk,
    new_id,
    now,
    usage,
)
from tinyserve.server.streaming import DONE, sse


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
    def stream_end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                   include_usage: bool) -> list[str]: ...
    def choice(self) -> dict[str, Any]: ...
    def body(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]: ...


class _OpenAIEvents:
    """OpenAI's SSE framing: `data: {json}` events, the usage chunk when asked, `[DONE]`."""

    def encode(self, chunk: dict[str, Any]) -> str:
        return sse(chunk)

    def error_event(self, err: APIError) -> str:
        return sse(err.body()) + DONE  # the stream ends as every OpenAI stream does

    def stream_end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                   include_usage: bool) -> list[str]:
        usage_event = [sse(self.usage_chunk(prompt_tokens, completion_tokens, cached_tokens))]
        return (usage_event if include_usage else []) + [DONE]


class ChatFormatter(_OpenAIEvents):
    endpoint = "chat"
    prompt_param = "messages"

    def __init__(self, model: str, assembler: ChatAssembler, *, usage_null: bool,
                 token_text: TokenText | None = None, index: int = 0,
                 first: ChatFormatter | None = None) -> None:
        self.id = first.id if first is not None else new_id("chatcmpl")
        self.created = first.created if first is not None else now()
        self.index = index
        self.model = model
        self.assembler = assembler
        self._usage_null = usage_null
        self._text_of = token_text
        self._logprobs: list[dict[str, Any]] = []  # every entry, for the body
        self._unsent = 0  # entries not in a chunk yet (the last ones of _logprobs)
        self.finish_reason: str | None = None

    def _chunk(self, delta: dict[str, Any] | None, reason: str | None = None) -> dict[str, Any]:
        chunk = chat_chunk(self.id, self.created, self.model, delta, reason,
                           with_usage_null=self._usage_null, index=self.index)
        if self._unsent:
            chunk["choices"][0]["logprobs"] = {"content": self._logprobs[-self._unsent:]}
            self._unsent = 0
        return chunk

    def _add_logprobs(self, logprobs: Sequence[TokenLogprobs]) -> None:
        if self._text_of is not None and logprobs:
            self._logprobs += chat_entries(self._text_of, logprobs)
            self._unsent += len(logprobs)

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        self._add_logprobs(logprobs)
        return [self._chunk(d) for d in self.assembler.feed(text)] if text else []

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        chunks = [self._chunk(d) for d in self.assembler.finish()]
        self.finish_reason = self.assembler.finish_reason(engine_reason)
        return chunks + [self._chunk({}, self.finish_reason)]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def choice(self) -> dict[str, Any]:
        return {"index": self.index, "message": self.assembler.message(),
                "logprobs": {"content": self._logprobs} if self._text_of is not None else None,
                "finish_reason": self.finish_reason}

    def body(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices or [self.choice()],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class CompletionFormatter(_OpenAIEvents):
    endpoint = "completions"
    prompt_param = "prompt"

    def __init__(self, model: str, *, usage_null: bool, token_text: TokenText | None = None,
                 index: int = 0, first: CompletionFormatter | None = None) -> None:
        self.id = first.id if first is not None else new_id("cmpl")
        self.created = first.created if first is not None else now()
        self.index = index
        self.model = model
        self._usage_null = usage_null
        self._text_of = token_text
        self._logprobs: list[TokenLogprobs] = []  # every token's, for the body
        self._unsent = 0  # tokens not in a chunk yet (the last ones of _logprobs)
        self._offset = 0  # text offset of the first unsent token
        self.text = ""
        self.finish_reason: str | None = None

    def _chunk(self, text: str, reason: str | None = None) -> dict[str, Any]:
        chunk = completion_chunk(self.id, self.created, self.model, text, reason,
                                 with_usage_null=self._usage_null, index=self.index)
        if self._unsent:
            lp = completion_logprobs(self._text_of, self._logprobs[-self._unsent:],
                                     self._offset)
            chunk["choices"][0]["logprobs"] = lp
            self._offset += sum(len(t) for t in lp["tokens"])
            self._unsent = 0
        return chunk

    def start(self) -> list[dict[str, Any]]:
        return []

    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        if self._text_of is not None and logprobs:
            self._logprobs += logprobs
            self._unsent += len(logprobs)
        if not text:
            return []
        self.text += text
        return [self._chunk(text)]

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        self.finish_reason = engine_reason
        return [self._chunk("", engine_reason)]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def choice(self) -> dict[str, Any]:
        return {"index": self.index, "text": self.text,
                "logprobs": (completion_logprobs(self._text_of, self._logprobs, 0)
                             if self._text_of is not None else None),
                "finish_reason": self.finish_reason}

    def body(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices or [self.choice()],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


"""Per-endpoint response shapes: engine outputs -> streamed chunks or one response body.

A formatter turns text deltas into chunks (`start`, `on_text`, `on_finish`) and builds the
non-streamed body (`body`). The generation driver in `server.generate` is shared by both
endpoints; only these shapes differ.
"""

from __future__ import annotations

from typing import Any

from tinyserve.server.responses import (
    ChatAssembler,
    chat_chunk,
    completion_chunk,
    new_id,
    now,
    usage,
)


class ChatFormatter:
    endpoint = "chat"
    prompt_param = "messages"

    def __init__(self, model: str, assembler: ChatAssembler, *, usage_null: bool) -> None:
        self.id = new_id("chatcmpl")
        self.created = now()
        self.model = model
        self.assembler = assembler
        self._usage_null = usage_null
        self.finish_reason: str | None = None

    def _chunk(self, delta: dict[str, Any] | None, reason: str | None = None) -> dict[str, Any]:
        return chat_chunk(self.id, self.created, self.model, delta, reason,
                          with_usage_null=self._usage_null)

    def start(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def on_text(self, text: str) -> list[dict[str, Any]]:
        return [self._chunk(d) for d in self.assembler.feed(text)] if text else []

    def on_finish(self, engine_reason: str | None) -> list[dict[str, Any]]:
        chunks = [self._chunk(d) for d in self.assembler.finish()]
        self.finish_reason = self.assembler.finish_reason(engine_reason)
        return chunks + [self._chunk({}, self.finish_reason)]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def body(self, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "message": self.assembler.message(), "logprobs": None,
                             "finish_reason": self.finish_reason}],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


class CompletionFormatter:
    endpoint = "completions"
    prompt_param = "prompt"

    def __init__(self, model: str, *, usage_null: bool) -> None:
        self.id = new_id("cmpl")
        self.created = now()
        self.model = model
        self._usage_null = usage_null
        self.text = ""
        self.finish_reason: str | None = None

    def start(self) -> list[dict[str, Any]]:
        return []

    def on_text(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        self.text += text
        return [completion_chunk(self.id, self.created, self.model, text,
                                 with_usage_null=self._usage_null)]

    def on_finish(self, engine_reason: str | None) -> list[dict[str, Any]]:
        self.finish_reason = engine_reason
        return [completion_chunk(self.id, self.created, self.model, "", engine_reason,
                                 with_usage_null=self._usage_null)]

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int,
                    cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}

    def body(self, prompt_tokens: int, completion_tokens: int,
             cached_tokens: int = 0) -> dict[str, Any]:
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model,
                "choices": [{"index": 0, "text": self.text, "logprobs": None,
                             "finish_reason": self.finish_reason}],
                "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


Formatter = ChatFormatter | CompletionFormatter

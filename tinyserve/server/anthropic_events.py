"""Anthropic Messages responses: the chat deltas as content blocks, streamed or in one body.

Events, each named by its type: `message_start`, `ping`, per block `content_block_start` /
`content_block_delta` (`thinking_delta` + one `signature_delta`, `text_delta`,
`input_json_delta`) / `content_block_stop`, then `message_delta` and `message_stop`; a failure
after the stream started is one `error` event. `input_tokens` are the prompt tokens not served
from the prefix cache, `cache_read_input_tokens` those that were. A thinking block's signature
is a digest of its text, not checked when the block comes back.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from typing import Any

from tinyserve.server.errors import APIError
from tinyserve.server.formatters import TokenCounts, sse
from tinyserve.server.responses import ChatAssembler, ItemWriter


def usage(counts: TokenCounts) -> dict[str, Any]:
    return {"input_tokens": counts.prompt - counts.cached, "output_tokens": counts.completion,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": counts.cached}


def stop_reason(chat_reason: str | None, stop_str: str | None, clamped: bool) -> str:
    """Anthropic's stop_reason for the chat finish reason (after tool-call detection)."""
    if chat_reason == "tool_calls":
        return "tool_use"
    if chat_reason == "length":
        return "model_context_window_exceeded" if clamped else "max_tokens"
    return "stop_sequence" if stop_str else "end_turn"


class MessagesFormatter(ItemWriter):
    """One message's events and body (`server.formatters.Formatter`). `clamped`: max_tokens
    was cut to the context's room."""

    endpoint = prompt_param = "messages"
    REASONING, TEXT, TOOL = "thinking", "text", "tool_use"

    def __init__(self, model: str, assembler: ChatAssembler, *, prompt_tokens: int,
                 clamped: bool = False) -> None:
        super().__init__(assembler)
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.prompt_tokens = prompt_tokens
        self.clamped = clamped
        self._args: dict[int, str] = {}  # block index -> tool input JSON so far
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None

    def start(self) -> list[dict[str, Any]]:
        message = self._message(None, usage(TokenCounts(self.prompt_tokens, 0)))
        message["content"] = []
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        events = super().on_finish(engine_reason)
        self.stop_reason = stop_reason(self.finish_reason, stop_str, self.clamped)
        self.stop_sequence = stop_str if self.stop_reason == "stop_sequence" else None
        return events

    def encode(self, event: dict[str, Any]) -> str:
        return sse(event, event["type"])

    def error_event(self, err: APIError) -> str:
        return self.encode(err.anthropic_body())

    def stream_end(self, counts: TokenCounts, include_usage: bool) -> list[str]:
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                 "usage": usage(counts)}
        return [self.encode(delta), self.encode({"type": "message_stop"})]

    def body(self, counts: TokenCounts) -> dict[str, Any]:
        return self._message(self.stop_reason, usage(counts))

    def _message(self, reason: str | None, use: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.items, "stop_reason": reason,
                "stop_sequence": self.stop_sequence, "usage": use}

    # -- blocks (`ItemWriter`): a thinking or text block holds its text under its kind's name

    def _new_text(self, kind: str) -> dict[str, Any]:
        block = {"type": kind, kind: ""}
        if kind == "thinking":
            block["signature"] = ""
        return block

    def _new_call(self, call_id: str, name: str | None) -> dict[str, Any]:
        return {"type": "tool_use", "id": "toolu_" + str(call_id).removeprefix("call_"),
                "name": name, "input": {}}

    def _started(self, index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "content_block_start", "index": index, "content_block": dict(block)}]

    def _append(self, index: int, kind: str, text: str) -> list[dict[str, Any]]:
        self.items[index][kind] += text
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": f"{kind}_delta", kind: text}}]

    def _call_args(self, index: int, fragment: str) -> list[dict[str, Any]]:
        self._args[index] = self._args.get(index, "") + fragment
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": fragment}}]

    def _closed(self, index: int, kind: str) -> list[dict[str, Any]]:
        block = self.items[index]
        out: list[dict[str, Any]] = []
        if kind == "thinking":
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()[:32]
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif kind == "tool_use":
            try:
                block["input"] = json.loads(self._args.get(index) or "{}")
            except json.JSONDecodeError:  # the parser always closes its JSON; be safe anyway
                block["input"] = {}
        return out + [{"type": "content_block_stop", "index": index}]

"""Anthropic Messages responses: the chat deltas of `ChatAssembler` as content blocks.

Streamed as Anthropic's API sends them, each SSE event named by its type:
`message_start` (usage with the prompt's tokens), `ping`, then per block
`content_block_start` / `content_block_delta` (`thinking_delta` + one `signature_delta`,
`text_delta`, `input_json_delta`) / `content_block_stop`, then `message_delta` (stop_reason,
stop_sequence, the final usage) and `message_stop`; a failure after the stream started is one
`error` event. The non-streamed message holds the same blocks.

Usage follows Anthropic: `input_tokens` are the prompt tokens not served from the prefix cache,
`cache_read_input_tokens` those that were. Thinking blocks carry an opaque signature (a digest
of their text) that this server does not check when the block comes back.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Sequence
from typing import Any

from tinyserve.core import TokenLogprobs
from tinyserve.server.errors import APIError, anthropic_error_body
from tinyserve.server.responses import ChatAssembler
from tinyserve.server.streaming import sse


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def stop_reason(chat_reason: str | None, stop_str: str | None, clamped: bool) -> str:
    """Anthropic's stop_reason for the chat finish reason (after tool-call detection)."""
    if chat_reason == "tool_calls":
        return "tool_use"
    if chat_reason == "length":
        return "model_context_window_exceeded" if clamped else "max_tokens"
    return "stop_sequence" if stop_str else "end_turn"


class MessagesFormatter:
    """One message's events and body (`server.formatters.Formatter`)."""

    endpoint = "messages"
    prompt_param = "messages"

    def __init__(self, model: str, assembler: ChatAssembler, *, prompt_tokens: int,
                 clamped: bool = False) -> None:
        self.id = f"msg_{uuid.uuid4().hex[:24]}"
        self.model = model
        self.assembler = assembler
        self.prompt_tokens = prompt_tokens
        self.clamped = clamped  # max_tokens was cut to the context's room
        self.blocks: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the block being written
        self._tool_block: dict[int, int] = {}  # tool call index -> block index
        self._args: dict[int, str] = {}  # block index -> tool input JSON so far
        self.finish_reason: str | None = None  # the chat finish reason (metrics) once finished
        self.stop_reason: str | None = None  # Anthropic's
        self.stop_sequence: str | None = None

    # -- events ----------------------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        message = self._message(None, {"input_tokens": self.prompt_tokens, "output_tokens": 0,
                                       "cache_creation_input_tokens": 0,
                                       "cache_read_input_tokens": 0})
        message["content"] = []
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        return self._events(self.assembler.feed(text)) if text else []

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        events = self._events(self.assembler.finish()) + self._close()
        self.finish_reason = self.assembler.finish_reason(engine_reason)
        self.stop_reason = stop_reason(self.finish_reason, stop_str, self.clamped)
        self.stop_sequence = stop_str if self.stop_reason == "stop_sequence" else None
        return events

    def encode(self, event: dict[str, Any]) -> str:
        return sse(event, event["type"])

    def error_event(self, err: APIError) -> str:
        return self.encode(anthropic_error_body(err.status, err.message))

    def stream_end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                   include_usage: bool) -> list[str]:
        delta = {"type": "message_delta",
                 "delta": {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence},
                 "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}
        return [self.encode(delta), self.encode({"type": "message_stop"})]

    # -- the body --------------------------------------------------------------------------

    def choice(self) -> dict[str, Any]:
        return {"content": self.blocks, "stop_reason": self.stop_reason}

    def body(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        return self._message(self.stop_reason,
                             usage(prompt_tokens, completion_tokens, cached_tokens))

    def _message(self, reason: str | None, use: dict[str, Any]) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": self.blocks, "stop_reason": reason,
                "stop_sequence": self.stop_sequence, "usage": use}

    # -- chat deltas -> block events -------------------------------------------------------

    def _events(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if "reasoning_content" in d:
                out += self._append("thinking", "thinking", d["reasoning_content"])
            elif "content" in d:
                out += self._append("text", "text", d["content"])
            for call in d.get("tool_calls") or ():
                out += self._tool_event(call)
        return out

    def _append(self, kind: str, field: str, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open != kind:
            out += self._close()
            block: dict[str, Any] = {"type": kind, field: ""}
            if kind == "thinking":
                block["signature"] = ""
            out += self._begin(kind, block)
        index = len(self.blocks) - 1
        self.blocks[index][field] += text
        out.append({"type": "content_block_delta", "index": index,
                    "delta": {"type": f"{kind}_delta", field: text}})
        return out

    def _tool_event(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function") or {}
        if "id" in call:  # a new call
            out = self._close()
            tool_id = "toolu_" + str(call["id"]).removeprefix("call_")
            out += self._begin("tool_use", {"type": "tool_use", "id": tool_id,
                                            "name": fn.get("name"), "input": {}})
            self._tool_block[call["index"]] = len(self.blocks) - 1
            self._args[len(self.blocks) - 1] = ""
            return out
        index = self._tool_block[call["index"]]
        self._args[index] += fn.get("arguments", "")
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": "input_json_delta", "partial_json": fn.get("arguments", "")}}]

    def _begin(self, kind: str, block: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = kind
        self.blocks.append(block)
        return [{"type": "content_block_start", "index": len(self.blocks) - 1,
                 "content_block": dict(block)}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, kind = len(self.blocks) - 1, self._open
        self._open = None
        block = self.blocks[index]
        out: list[dict[str, Any]] = []
        if kind == "thinking":
            block["signature"] = hashlib.sha256(block["thinking"].encode()).hexdigest()[:32]
            out.append({"type": "content_block_delta", "index": index,
                        "delta": {"type": "signature_delta", "signature": block["signature"]}})
        elif kind == "tool_use":
            try:
                block["input"] = json.loads(self._args[index] or "{}")
            except json.JSONDecodeError:  # the parser always closes its JSON; be safe anyway
                block["input"] = {}
        return out + [{"type": "content_block_stop", "index": index}]

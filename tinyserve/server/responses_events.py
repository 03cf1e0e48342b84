"""OpenAI Responses output: the chat deltas as output items, streamed or in one body.

Items in the order the model writes them: `reasoning` (`reasoning_text` content, plus
`encrypted_content` when the request includes it), `message` (one `output_text` part), one
`function_call` per call. Events are named by their type and numbered: `response.created`,
`response.in_progress`, per item `output_item.added`, `content_part.added`, the deltas, their
`.done` events and `output_item.done`; then `response.completed` (or `response.incomplete`),
or `response.failed` after a failure. `encrypted_content` is not encrypted: it is this
server's opaque encoding of the text (`tsr1.` + base64), read back by `decode_reasoning`.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from tinyserve.server.errors import APIError
from tinyserve.server.formatters import TokenCounts, sse
from tinyserve.server.responses import ChatAssembler, ItemWriter

_MARK = "tsr1."
_ECHOED = ("instructions", "max_output_tokens", "parallel_tool_calls", "temperature", "top_p",
           "tool_choice", "tools", "reasoning", "text", "metadata")


def encode_reasoning(text: str) -> str:
    return _MARK + base64.b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning(item: dict[str, Any]) -> str:
    """The reasoning text of an input `reasoning` item: this server's `encrypted_content`,
    else its `reasoning_text` content, else its summary (other servers' encrypted content is
    unreadable here and skipped)."""
    blob = item.get("encrypted_content")
    if isinstance(blob, str) and blob.startswith(_MARK):
        try:
            return base64.b64decode(blob[len(_MARK):], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            pass
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        texts = [p.get("text", "") for p in item.get(key) or ()
                 if isinstance(p, dict) and p.get("type") == kind]
        if texts:
            return "\n\n".join(texts)
    return ""


class ResponsesFormatter(ItemWriter):
    """One response's events and body (`server.formatters.Formatter`). `echo`: the request
    (its settings are repeated in the response object); `count_tokens`: text -> tokens (the
    reasoning part of the usage)."""

    endpoint, prompt_param = "responses", "input"
    REASONING, TEXT, TOOL = "reasoning", "message", "function_call"

    def __init__(self, model: str, assembler: ChatAssembler, *, echo: Any,
                 with_encrypted: bool, count_tokens: Callable[[str], int]) -> None:
        super().__init__(assembler)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        settings = echo.model_dump(mode="json", exclude_none=True, by_alias=True)
        self._echo = {k: settings.get(k) for k in _ECHOED}
        self._echo["tools"] = self._echo["tools"] or []
        self._echo["tool_choice"] = self._echo["tool_choice"] or "auto"
        self._echo["parallel_tool_calls"] = self._echo["parallel_tool_calls"] is not False
        self._with_encrypted = with_encrypted
        self._count = count_tokens
        self._seq = 0

    def start(self) -> list[dict[str, Any]]:
        snapshot = self._response("in_progress", None)
        return [{"type": "response.created", "response": snapshot},
                {"type": "response.in_progress", "response": snapshot}]

    def encode(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self._seq
        self._seq += 1
        return sse(event, event["type"])

    def error_event(self, err: APIError) -> str:
        failed = self._response("failed", None)
        failed["error"] = {"code": err.type, "message": err.message}
        return self.encode({"type": "response.failed", "response": failed})

    def stream_end(self, counts: TokenCounts, include_usage: bool) -> list[str]:
        body = self.body(counts)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [self.encode({"type": kind, "response": body})]

    def body(self, counts: TokenCounts) -> dict[str, Any]:
        reasoning = self._count(self.assembler.reasoning) if self.assembler.reasoning else 0
        use = {"input_tokens": counts.prompt,
               "input_tokens_details": {"cached_tokens": counts.cached},
               "output_tokens": counts.completion,
               "output_tokens_details": {"reasoning_tokens": min(reasoning, counts.completion)},
               "total_tokens": counts.prompt + counts.completion}
        if self.finish_reason == "length":
            out = self._response("incomplete", use)
            out["incomplete_details"] = {"reason": "max_output_tokens"}
            return out
        return self._response("completed", use)

    def _response(self, status: str, use: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model,
                "output": [dict(item) for item in self.items] if use else [],
                "usage": use, "error": None, "incomplete_details": None, "store": False,
                "previous_response_id": None, "truncation": "disabled", "background": False,
                **self._echo}

    # -- output items (`ItemWriter`): reasoning and message items hold one text part -------

    def _new_text(self, kind: str) -> dict[str, Any]:
        if kind == "reasoning":
            return {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}],
                    "status": "in_progress"}
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                "status": "in_progress", "content": [
                    {"type": "output_text", "text": "", "annotations": [], "logprobs": []}]}

    def _new_call(self, call_id: str, name: str | None) -> dict[str, Any]:
        return {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                "status": "in_progress", "call_id": call_id, "name": name, "arguments": ""}

    def _where(self, index: int) -> dict[str, Any]:
        return {"item_id": self.items[index]["id"], "output_index": index}

    def _started(self, index: int, item: dict[str, Any]) -> list[dict[str, Any]]:
        if "content" not in item:
            return [{"type": "response.output_item.added", "output_index": index,
                     "item": dict(item)}]
        return [{"type": "response.output_item.added", "output_index": index,
                 "item": dict(item, content=[])},
                {"type": "response.content_part.added", **self._where(index),
                 "content_index": 0, "part": dict(item["content"][0])}]

    def _text_event(self, index: int, kind: str, done: bool, **fields: Any) -> dict[str, Any]:
        name = "reasoning_text" if kind == "reasoning" else "output_text"
        event = {"type": f"response.{name}.{'done' if done else 'delta'}", **self._where(index),
                 "content_index": 0, **fields}
        if kind == "message":
            event["logprobs"] = []
        return event

    def _append(self, index: int, kind: str, text: str) -> list[dict[str, Any]]:
        self.items[index]["content"][0]["text"] += text
        return [self._text_event(index, kind, False, delta=text)]

    def _call_args(self, index: int, fragment: str) -> list[dict[str, Any]]:
        self.items[index]["arguments"] += fragment
        return [{"type": "response.function_call_arguments.delta", **self._where(index),
                 "delta": fragment}]

    def _closed(self, index: int, kind: str) -> list[dict[str, Any]]:
        item = self.items[index]
        item["status"] = "completed"
        if kind == "function_call":
            out = [{"type": "response.function_call_arguments.done", **self._where(index),
                    "name": item["name"], "arguments": item["arguments"]}]
        else:
            part = item["content"][0]
            out = [self._text_event(index, kind, True, text=part["text"]),
                   {"type": "response.content_part.done", **self._where(index),
                    "content_index": 0, "part": dict(part)}]
            if kind == "reasoning" and self._with_encrypted:
                item["encrypted_content"] = encode_reasoning(part["text"])
        return out + [{"type": "response.output_item.done", "output_index": index,
                       "item": json.loads(json.dumps(item))}]

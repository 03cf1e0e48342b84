"""OpenAI Responses output: the chat deltas of `ChatAssembler` as output items and events.

Items in the order the model writes them: a `reasoning` item (its text as `reasoning_text`
content, plus `encrypted_content` when the request includes it), a `message` item with one
`output_text` part, one `function_call` item per call. Streamed as the Responses API sends
them, each SSE event named by its type and numbered (`sequence_number`): `response.created`,
`response.in_progress`, per item `response.output_item.added`, its part's
`response.content_part.added`, the deltas (`response.reasoning_text.delta`,
`response.output_text.delta`, `response.function_call_arguments.delta`), their `.done` events
and `response.output_item.done`; then `response.completed` (or `response.incomplete` when
max_output_tokens ran out) with the whole response and its usage. A failure after the stream
started is `response.failed`. The non-streamed response is the same object.

`encrypted_content` is not encrypted: it is this server's opaque encoding of the reasoning
text (`tsr1.` + base64), read back by `decode_reasoning` when a client returns the item.
"""

from __future__ import annotations

import base64
import binascii
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from tinyserve.core import TokenLogprobs
from tinyserve.server.errors import APIError
from tinyserve.server.responses import ChatAssembler
from tinyserve.server.streaming import sse

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


class ResponsesFormatter:
    """One response's events and body (`server.formatters.Formatter`). `echo`: the request
    (its settings are repeated in the response object); `count_tokens`: text -> tokens (the
    reasoning part of the usage)."""

    endpoint = "responses"
    prompt_param = "input"

    def __init__(self, model: str, assembler: ChatAssembler, *, echo: Any,
                 with_encrypted: bool = False,
                 count_tokens: Callable[[str], int] | None = None) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = model
        self.assembler = assembler
        settings = echo.model_dump(mode="json", exclude_none=True, by_alias=True)
        self._echo = {k: settings.get(k) for k in _ECHOED}
        self._echo["tools"] = self._echo["tools"] or []
        self._echo["tool_choice"] = self._echo["tool_choice"] or "auto"
        self._echo["parallel_tool_calls"] = self._echo["parallel_tool_calls"] is not False
        self._with_encrypted = with_encrypted
        self._count = count_tokens
        self.output: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the item being written
        self._tool_item: dict[int, int] = {}  # tool call index -> output index
        self._seq = 0
        self.finish_reason: str | None = None  # the chat finish reason once finished

    # -- events ----------------------------------------------------------------------------

    def start(self) -> list[dict[str, Any]]:
        snapshot = self._response("in_progress", None)
        return [{"type": "response.created", "response": snapshot},
                {"type": "response.in_progress", "response": snapshot}]

    def on_text(self, text: str, logprobs: Sequence[TokenLogprobs] = ()) -> list[dict[str, Any]]:
        return self._events(self.assembler.feed(text)) if text else []

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        events = self._events(self.assembler.finish()) + self._close()
        self.finish_reason = self.assembler.finish_reason(engine_reason)
        return events

    def encode(self, event: dict[str, Any]) -> str:
        event["sequence_number"] = self._seq
        self._seq += 1
        return sse(event, event["type"])

    def error_event(self, err: APIError) -> str:
        failed = self._response("failed", None)
        failed["error"] = {"code": "server_error" if err.status >= 500 else
                           "invalid_request_error", "message": err.message}
        return self.encode({"type": "response.failed", "response": failed})

    def stream_end(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int,
                   include_usage: bool) -> list[str]:
        body = self.body(prompt_tokens, completion_tokens, cached_tokens)
        kind = "response.completed" if body["status"] == "completed" else "response.incomplete"
        return [self.encode({"type": kind, "response": body})]

    # -- the body --------------------------------------------------------------------------

    def choice(self) -> dict[str, Any]:
        return {"output": self.output}

    def body(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
             choices: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        reasoning = self._count(self.assembler.reasoning) if (
            self._count and self.assembler.reasoning) else 0
        use = {"input_tokens": prompt_tokens,
               "input_tokens_details": {"cached_tokens": cached_tokens},
               "output_tokens": completion_tokens,
               "output_tokens_details": {"reasoning_tokens": min(reasoning, completion_tokens)},
               "total_tokens": prompt_tokens + completion_tokens}
        if self.finish_reason == "length":
            out = self._response("incomplete", use)
            out["incomplete_details"] = {"reason": "max_output_tokens"}
            return out
        return self._response("completed", use)

    def _response(self, status: str, use: dict[str, Any] | None) -> dict[str, Any]:
        return {"id": self.id, "object": "response", "created_at": self.created_at,
                "status": status, "model": self.model,
                "output": [dict(item) for item in self.output] if use else [],
                "usage": use, "error": None, "incomplete_details": None, "store": False,
                "previous_response_id": None, "truncation": "disabled", "background": False,
                **self._echo}

    # -- chat deltas -> item events --------------------------------------------------------

    def _events(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if "reasoning_content" in d:
                out += self._text("reasoning", d["reasoning_content"])
            elif "content" in d:
                out += self._text("message", d["content"])
            for call in d.get("tool_calls") or ():
                out += self._tool_event(call)
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open != kind:
            out += self._close()
            if kind == "reasoning":
                item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "summary": [],
                        "content": [], "status": "in_progress"}
                part = {"type": "reasoning_text", "text": ""}
            else:
                item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                        "status": "in_progress", "content": []}
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            out += self._begin(kind, item)
            item["content"] = [part]
            out.append({"type": "response.content_part.added", **self._where(),
                        "content_index": 0, "part": dict(part)})
        index = len(self.output) - 1
        self.output[index]["content"][0]["text"] += text
        delta = {"type": "response.reasoning_text.delta" if kind == "reasoning" else
                 "response.output_text.delta", **self._where(), "content_index": 0,
                 "delta": text}
        if kind == "message":
            delta["logprobs"] = []
        return out + [delta]

    def _tool_event(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function") or {}
        if "id" in call:  # a new call
            out = self._close()
            out += self._begin("function_call", {
                "id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                "status": "in_progress", "call_id": call["id"], "name": fn.get("name"),
                "arguments": ""})
            self._tool_item[call["index"]] = len(self.output) - 1
            return out
        index = self._tool_item[call["index"]]
        self.output[index]["arguments"] += fn.get("arguments", "")
        return [{"type": "response.function_call_arguments.delta", **self._where(index),
                 "delta": fn.get("arguments", "")}]

    def _where(self, index: int | None = None) -> dict[str, Any]:
        index = len(self.output) - 1 if index is None else index
        return {"item_id": self.output[index]["id"], "output_index": index}

    def _begin(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = kind
        self.output.append(item)
        return [{"type": "response.output_item.added", "output_index": len(self.output) - 1,
                 "item": dict(item, content=[]) if "content" in item else dict(item)}]

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        index, kind = len(self.output) - 1, self._open
        self._open = None
        item = self.output[index]
        item["status"] = "completed"
        out: list[dict[str, Any]] = []
        if kind == "function_call":
            out.append({"type": "response.function_call_arguments.done", **self._where(index),
                        "name": item["name"], "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            done = {"type": "response.reasoning_text.done" if kind == "reasoning" else
                    "response.output_text.done", **self._where(index), "content_index": 0,
                    "text": part["text"]}
            if kind == "message":
                done["logprobs"] = []
            out += [done, {"type": "response.content_part.done", **self._where(index),
                           "content_index": 0, "part": dict(part)}]
            if kind == "reasoning" and self._with_encrypted:
                item["encrypted_content"] = encode_reasoning(part["text"])
        return out + [{"type": "response.output_item.done", "output_index": index,
                       "item": json.loads(json.dumps(item))}]

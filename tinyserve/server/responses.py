"""Generated text -> OpenAI chat deltas and messages.

`ChatAssembler` runs the reasoning splitter and (when the request has tools) the tool-call
parser over the engine's text deltas. The streaming chunks and the non-streamed message come
from the same deltas, so both carry the same text. The Anthropic and Responses formatters
translate the same deltas into their own events.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tinyserve.server.reasoning import ReasoningParser
from tinyserve.server.tool_parser import ContentDelta, ToolCallParser, ToolCallStart, ToolEvent


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0
          ) -> dict[str, Any]:
    """The usage object; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class ChatAssembler:
    """Per-request text processing for chat completions."""

    def __init__(self, *, reasoning_open: bool, tools: list[dict] | None = None,
                 parallel_tool_calls: bool | None = True, prefill: str = "") -> None:
        """`prefill`: text the prompt ends with that the parsers read before the generated
        text, as if generated (a forced tool call's preamble)."""
        self._prefill = prefill
        self._reasoning = ReasoningParser(reasoning_open)
        self._tools = ToolCallParser(tools) if tools else None
        self._parallel = parallel_tool_calls is not False  # None: OpenAI's default, true
        self.content = ""
        self.reasoning = ""
        self.tool_calls: list[dict[str, Any]] = []

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas (`{"content"}`, `{"reasoning_content", "reasoning"}`, `{"tool_calls"}`) for
        the next piece of generated text."""
        reasoning, content = self._reasoning.feed(self._prefill + text)
        self._prefill = ""
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        out = self.feed("") if self._prefill else []
        reasoning, content = self._reasoning.finish()
        return out + self._deltas(reasoning, content, final=True)

    def message(self) -> dict[str, Any]:
        """The whole assistant message (non-streaming responses)."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        elif msg["content"] is None:
            msg["content"] = ""
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    # ---------------------------------------------------------------------------------------

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning += reasoning
            out.append({"reasoning_content": reasoning, "reasoning": reasoning})
        if self._tools is None:
            if content:
                self.content += content
                out.append({"content": content})
            return out
        events = self._tools.feed(content) if content else []
        if final:
            events += self._tools.finish()
        for ev in events:
            self._tool_event(ev, out)
        return out

    def _tool_event(self, ev: ToolEvent, out: list[dict[str, Any]]) -> None:
        if isinstance(ev, ContentDelta):
            self.content += ev.text
            if out and "content" in out[-1]:
                out[-1]["content"] += ev.text
            else:
                out.append({"content": ev.text})
            return
        if ev.index > 0 and not self._parallel:
            return  # parallel_tool_calls=false: the first call only
        if isinstance(ev, ToolCallStart):
            self.tool_calls.append({"id": ev.id, "type": "function",
                                    "function": {"name": ev.name, "arguments": ""}})
            out.append({"tool_calls": [{"index": ev.index, "id": ev.id, "type": "function",
                                        "function": {"name": ev.name, "arguments": ""}}]})
            return
        self.tool_calls[ev.index]["function"]["arguments"] += ev.fragment
        out.append({"tool_calls": [{"index": ev.index,
                                    "function": {"arguments": ev.fragment}}]})


def chat_chunk(rid: str, created: int, model: str, delta: dict[str, Any] | None,
               finish_reason: str | None = None, *, with_usage_null: bool = False,
               index: int = 0) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
        "choices": [{"index": index, "delta": delta or {}, "logprobs": None,
                     "finish_reason": finish_reason}]}
    if with_usage_null:
        chunk["usage"] = None
    return chunk


def completion_chunk(rid: str, created: int, model: str, text: str,
                     finish_reason: str | None = None, *, with_usage_null: bool = False,
                     index: int = 0) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": rid, "object": "text_completion", "created": created, "model": model,
        "choices": [{"index": index, "text": text, "logprobs": None,
                     "finish_reason": finish_reason}]}
    if with_usage_null:
        chunk["usage"] = None
    return chunk


def now() -> int:
    return int(time.time())

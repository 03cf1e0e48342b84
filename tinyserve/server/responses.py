"""Generated text -> chat deltas and messages, and the writer of output items built on them.

`ChatAssembler` runs the reasoning splitter and (when the request has tools) the tool-call
parser over the engine's text deltas; streamed chunks and the non-streamed message come from
the same deltas. `ItemWriter` turns the deltas into the Anthropic and Responses output items.
"""

from __future__ import annotations

from typing import Any

from tinyserve.server.reasoning import ReasoningParser
from tinyserve.server.tool_parser import ContentDelta, ToolCallParser, ToolCallStart, ToolEvent


class ChatAssembler:
    """One choice's generated text -> chat deltas, and the whole message at the end."""

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
        msg: dict[str, Any] = {"role": "assistant",
                               "content": self.content or (None if self.tool_calls else "")}
        if self.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if self.tool_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning:
            self.reasoning += reasoning
            out.append({"reasoning_content": reasoning, "reasoning": reasoning})
        if self._tools is None:
            events: list[ToolEvent] = [ContentDelta(content)] if content else []
        else:
            events = self._tools.feed(content) if content else []
            events += self._tools.finish() if final else []
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


class ItemWriter:
    """Chat deltas -> output items (Anthropic's content blocks, the Responses API's output
    items) and their events, each item opened when the model starts it and closed when it
    moves on. Subclasses name the kinds (`REASONING`, `TEXT`, `TOOL`) and write the items and
    events (`_new_text`, `_new_call`, `_started`, `_append`, `_call_args`, `_closed`)."""

    REASONING: str
    TEXT: str
    TOOL: str

    def __init__(self, assembler: ChatAssembler) -> None:
        self.assembler = assembler
        self.items: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the item being written
        self._tool_item: dict[int, int] = {}  # tool call index -> item index
        self.finish_reason: str | None = None  # the chat finish reason once finished

    def on_text(self, text: str, logprobs: Any = ()) -> list[dict[str, Any]]:
        return self._events(self.assembler.feed(text)) if text else []

    def on_finish(self, engine_reason: str | None, stop_str: str | None = None
                  ) -> list[dict[str, Any]]:
        events = self._events(self.assembler.finish()) + self._close()
        self.finish_reason = self.assembler.finish_reason(engine_reason)
        return events

    def _events(self, deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for d in deltas:
            if "reasoning_content" in d:
                out += self._text(self.REASONING, d["reasoning_content"])
            elif "content" in d:
                out += self._text(self.TEXT, d["content"])
            for call in d.get("tool_calls") or ():
                fn = call.get("function") or {}
                if "id" in call:  # a new call
                    out += self._close()
                    out += self._begin(self.TOOL, self._new_call(call["id"], fn.get("name")))
                    self._tool_item[call["index"]] = len(self.items) - 1
                else:
                    out += self._call_args(self._tool_item[call["index"]],
                                           fn.get("arguments", ""))
        return out

    def _text(self, kind: str, text: str) -> list[dict[str, Any]]:
        out = []
        if self._open != kind:
            out += self._close() + self._begin(kind, self._new_text(kind))
        return out + self._append(len(self.items) - 1, kind, text)

    def _begin(self, kind: str, item: dict[str, Any]) -> list[dict[str, Any]]:
        self._open = kind
        self.items.append(item)
        return self._started(len(self.items) - 1, item)

    def _close(self) -> list[dict[str, Any]]:
        if self._open is None:
            return []
        kind, self._open = self._open, None
        return self._closed(len(self.items) - 1, kind)

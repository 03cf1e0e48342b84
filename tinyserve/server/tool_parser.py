"""Streaming parser for Qwen3.5 XML tool calls, one block per call::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

`feed(text)` returns `ContentDelta` (text outside the blocks), `ToolCallStart` (a name is
known) and `ToolCallArgs` (the next fragment of the call's JSON arguments). Values take the
JSON type their schema declares, and the arguments are always strict JSON. `finish()` closes a
half-written call whose name is known and gives anything else back as content.
"""

from __future__ import annotations

import ast
import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

TOOL_OPEN = "<tool_call>"
TOOL_CLOSE = "</tool_call>"
_FUNC_RE = re.compile(r"<function=([^>\n]+)>")
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>")
_PARAM_CLOSE = "</parameter>"
_FUNC_CLOSE = "</function>"


@dataclass
class ContentDelta:
    text: str


@dataclass
class ToolCallStart:
    index: int
    id: str
    name: str


@dataclass
class ToolCallArgs:
    index: int
    fragment: str


ToolEvent = ContentDelta | ToolCallStart | ToolCallArgs


def partial_suffix_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _first(text: str, *tags: str, start: int = 0) -> int:
    """Where the first of `tags` found in `text` from `start` begins, or -1."""
    return min((p for tag in tags if (p := text.find(tag, start)) >= 0), default=-1)


def schema_types(tools: list[dict] | None) -> dict[str, dict[str, Any]]:
    """{function name: {parameter name: JSON-schema of that parameter}} from request tools."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[fn.get("name", "")] = dict(props) if isinstance(props, dict) else {}
    return out


_MAX_SCHEMA_DEPTH = 16  # anyOf / oneOf nesting followed when looking for a type


def _type_names(schema: Any, depth: int = 0) -> list[str]:
    if not isinstance(schema, dict) or depth > _MAX_SCHEMA_DEPTH:
        return []
    t = schema.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list):
        return [x for x in t if isinstance(x, str)]
    names: list[str] = []
    for key in ("anyOf", "oneOf"):
        subs = schema.get(key)
        for sub in subs if isinstance(subs, list) else ():
            names += _type_names(sub, depth + 1)
    if not names and "enum" in schema:
        names = ["string"]
    return names


def json_text(value: Any) -> str | None:
    """`value` as strict JSON text (no NaN or Infinity, only JSON types), or None."""
    try:
        return json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


def convert_value(value: str, schema: Any) -> Any:
    """Turn a parameter's text into the JSON type its schema declares (text when unsure, or
    when the converted value would not be strict JSON)."""
    out = _convert(value, schema)
    if out is value:
        return value
    text = json_text(out)
    if text is None:
        return value
    return json.loads(text) if isinstance(out, (tuple, list, dict)) else out  # JSON's own types


def _convert(value: str, schema: Any) -> Any:
    types = _type_names(schema)
    if not types:
        return value
    stripped = value.strip()
    if stripped == "null" and ("null" in types or "string" not in types):
        return None
    for t in types:
        try:
            if t == "string":
                return value
            if t == "integer":
                return int(stripped)
            if t == "number":
                num = float(stripped)
                if not math.isfinite(num):
                    continue
                return int(stripped) if re.fullmatch(r"-?\d+", stripped) else num
            if t == "boolean" and stripped.lower() in ("true", "false"):
                return stripped.lower() == "true"
            if t in ("object", "array"):
                try:
                    return json.loads(stripped)
                except json.JSONDecodeError:
                    return ast.literal_eval(stripped)
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
    return value


class ToolCallParser:
    """Incremental parser for one response. Not thread-safe; one instance per request."""

    def __init__(self, tools: list[dict] | None = None) -> None:
        self._schemas = schema_types(tools)
        self._buf = ""  # text not yet turned into events
        self._in_call = False
        self._after_func = False
        self._name: str | None = None  # function name of the open call once known
        self._num_params = 0
        self._pending_ws = ""  # whitespace held back in content (dropped before a call)
        self._ws_before = ""
        self.num_calls = 0  # calls started; the open or last call's index is one less

    def feed(self, text: str) -> list[ToolEvent]:
        self._buf += text
        events: list[ToolEvent] = []
        while True:
            before = (self._buf, self._in_call, self._after_func, len(events))
            if self._in_call:
                self._step_call(events)
            elif self._after_func:
                self._step_after_func()
            else:
                self._step_text(events)
            if (self._buf, self._in_call, self._after_func, len(events)) == before:
                return events

    def finish(self) -> list[ToolEvent]:
        """Flush everything held back at the end of generation."""
        events: list[ToolEvent] = []
        if self._in_call:
            if self._name is None:
                events.append(ContentDelta(self._ws_before + TOOL_OPEN + self._buf))
            else:
                # Close a truncated call with the complete parameters seen so far.
                self._buf = self._buf + _FUNC_CLOSE
                while self._in_call:
                    self._step_call(events)
            self._in_call = False
            self._buf = ""
        if self._after_func:
            self._after_func = False
            if TOOL_CLOSE.startswith(self._buf.strip()):
                self._buf = ""
        tail = self._buf
        if tail.strip():
            events.append(ContentDelta(self._pending_ws + tail))
        self._buf = self._pending_ws = ""
        return events

    def _emit_content(self, text: str, events: list[ToolEvent]) -> None:
        if not text:
            return
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        if self.num_calls and not body.strip():
            body = ""
        if body:
            events.append(ContentDelta(body))

    def _step_text(self, events: list[ToolEvent]) -> None:
        pos = self._buf.find(TOOL_OPEN)
        if pos >= 0:
            self._emit_content(self._buf[:pos], events)
            # Whitespace before a call is layout, not content (unless the block is malformed).
            self._ws_before, self._pending_ws = self._pending_ws, ""
            self._buf = self._buf[pos + len(TOOL_OPEN):]
            self._in_call = True
            self._name = None
            self._num_params = 0
            return
        keep = partial_suffix_len(self._buf, TOOL_OPEN)
        self._emit_content(self._buf[: len(self._buf) - keep], events)
        self._buf = self._buf[len(self._buf) - keep:]

    def _step_call(self, events: list[ToolEvent]) -> None:
        buf = self._buf
        if self._name is None:
            m = _FUNC_RE.search(buf)
            close = buf.find(TOOL_CLOSE)
            if m is None or (0 <= close < m.start()):
                if close >= 0:  # a block without a function: give its text back as content
                    raw = buf[: close + len(TOOL_CLOSE)]
                    events.append(ContentDelta(self._ws_before + TOOL_OPEN + raw))
                    self._buf = buf[close + len(TOOL_CLOSE):]
                    self._in_call = False
                return
            self._name = m.group(1).strip()
            self.num_calls += 1
            events.append(ToolCallStart(self.num_calls - 1, f"call_{uuid.uuid4().hex[:24]}",
                                        self._name))
            self._buf = buf[m.end():]
            return
        m = _PARAM_RE.search(buf)
        end = _first(buf, _FUNC_CLOSE, TOOL_CLOSE)
        if m is not None and (end < 0 or m.start() < end):
            # the value ends at the first closing tag or the next parameter
            vstart = m.end()
            stop = _first(buf, _PARAM_CLOSE, _FUNC_CLOSE, TOOL_CLOSE, start=vstart)
            nxt = _PARAM_RE.search(buf, vstart)
            if nxt is not None and (stop < 0 or nxt.start() < stop):
                stop = nxt.start()
            if stop < 0:
                return  # value not complete yet
            self._add_param(m.group(1).strip(), buf[vstart:stop], events)
            self._buf = buf[stop:].removeprefix(_PARAM_CLOSE)
            return
        if end >= 0:
            self._close_call(events)
            if buf.startswith(TOOL_CLOSE, end):
                self._buf = buf[end + len(TOOL_CLOSE):]
            else:
                self._buf = buf[end + len(_FUNC_CLOSE):]
                self._after_func = True

    def _step_after_func(self) -> None:
        # `</function>` seen: drop the `</tool_call>` that should follow it.
        s = self._buf.lstrip()
        if s.startswith(TOOL_CLOSE):
            self._buf = s[len(TOOL_CLOSE):]
            self._after_func = False
        elif not TOOL_CLOSE.startswith(s):
            self._after_func = False  # malformed: no `</tool_call>`; go on with the text

    def _add_param(self, key: str, raw: str, events: list[ToolEvent]) -> None:
        schema = self._schemas.get(self._name or "", {}).get(key)
        value = convert_value(raw.removeprefix("\n").removesuffix("\n"), schema)
        sep = "{" if self._num_params == 0 else ", "
        self._num_params += 1
        events.append(ToolCallArgs(self.num_calls - 1,
                                   f"{sep}{json.dumps(key, ensure_ascii=False)}: "
                                   f"{json_text(value)}"))

    def _close_call(self, events: list[ToolEvent]) -> None:
        events.append(ToolCallArgs(self.num_calls - 1, "}" if self._num_params else "{}"))
        self._name = None
        self._num_params = 0
        self._in_call = False

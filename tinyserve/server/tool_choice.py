"""Forced tool calls without constrained decoding: `tool_choice` "required" or a function.

A forced call is the preamble the Qwen3.5 template writes for a call, put in the prompt after
the generation prompt: an empty think block closed when the prompt left it open, then
`<tool_call>\\n<function=` and, when the function is known, its name and `>\\n`. The model writes
the parameters; the response's parsers read the preamble first, as if generated.
"""

from __future__ import annotations

from typing import Any

from tinyserve.server.errors import APIError
from tinyserve.server.reasoning import THINK_CLOSE
from tinyserve.server.tool_parser import TOOL_OPEN

_CLOSE_THINK = f"\n{THINK_CLOSE}\n\n"  # after the prompt's `<think>\n`: the empty block


def forced_function(tool_choice: Any, tool_names: list[str]) -> str | None:
    """Which call `tool_choice` forces: None (none forced: "auto", "none" or unset), "" (any
    tool: "required" with several tools) or a function name. Raises a 400 naming tool_choice
    for an unknown value, a forced call without tools, or a function not in `tool_names`."""
    if tool_choice in (None, "auto", "none"):
        return None
    param = "tool_choice"
    if tool_choice == "required":
        if not tool_names:
            raise APIError(400, "tool_choice 'required' needs tools", param=param)
        return tool_names[0] if len(tool_names) == 1 else ""
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function"
            or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                       "{'type': 'function', 'function': {'name': ...}}", param=param)
    if fn["name"] not in tool_names:
        raise APIError(400, f"tool_choice names the function {fn['name']!r}, which is not in "
                       "tools", param=param)
    return fn["name"]


def continuation(reasoning_open: bool, text: str = "",
                 forced: str | None = None) -> tuple[str, str]:
    """What follows the generation prompt when the answer is begun for the model: `text` (an
    answer's start the client wrote) and/or the preamble of a forced call (`forced`, as
    `forced_function` returns it). Returns (text to append to the prompt, the part of it the
    response's parsers must read as generated). An open think block is closed empty first."""
    tool = ""
    if forced is not None:
        sep = "\n\n" if text.strip() else ""
        tool = f"{sep}{TOOL_OPEN}\n<function=" + (f"{forced}>\n" if forced else "")
    if not text and not tool:
        return "", ""
    return (_CLOSE_THINK if reasoning_open else "") + text + tool, tool.lstrip("\n")

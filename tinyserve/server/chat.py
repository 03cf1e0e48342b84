"""Chat messages -> prompt token ids through the checkpoint's own chat template.

The template (Qwen3.5's, read from the checkpoint's tokenizer) renders tools, reasoning of past
turns and tool responses; `enable_thinking` and any other variables come from the request's
`chat_template_kwargs`. Whether generation starts inside a `<think>` block is read from the
rendered prompt.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tinyserve.server.errors import APIError
from tinyserve.server.protocol import ChatCompletionRequest, ChatMessage
from tinyserve.server.reasoning import reasoning_open_in_prompt

_RESERVED_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                    "return_dict", "chat_template", "documents"}


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    ids: list[int]
    reasoning_open: bool  # generation starts inside <think> ... </think>


def _content_text(content: str | list[dict[str, Any]] | None) -> str | None:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content


def _tool_call_for_template(call: dict[str, Any], where: str) -> dict[str, Any]:
    call = dict(call)
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            raise APIError(400, "tool call arguments must be a JSON object",
                           param=f"{where}.function.arguments") from None
    if args is not None and not isinstance(args, dict):
        raise APIError(400, "tool call arguments must be a JSON object",
                       param=f"{where}.function.arguments")
    fn["arguments"] = args or {}
    call["function"] = fn
    return call


def message_for_template(msg: ChatMessage, index: int) -> dict[str, Any]:
    """One request message as the template expects it (developer -> system, text parts joined,
    tool-call arguments as mappings, `reasoning` accepted for `reasoning_content`)."""
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role,
                           "content": _content_text(msg.content) or ""}
    reasoning = msg.reasoning_content if msg.reasoning_content is not None else msg.reasoning
    if reasoning is not None:
        out["reasoning_content"] = reasoning
    if msg.tool_calls:
        out["tool_calls"] = [_tool_call_for_template(c, f"messages[{index}].tool_calls[{j}]")
                             for j, c in enumerate(msg.tool_calls)]
    for key in ("name", "tool_call_id"):
        if getattr(msg, key) is not None:
            out[key] = getattr(msg, key)
    return out


class ChatRenderer:
    """Renders chat requests with `tokenizer.apply_chat_template` and tokenizes the result."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render_messages(self, messages: list[dict[str, Any]], *,
                        tools: list[dict[str, Any]] | None = None,
                        **template_kwargs: Any) -> RenderedPrompt:
        """Render plain message dicts (the template's own input) to a prompt."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model has no chat template; use /v1/completions",
                           param="messages")
        kwargs = {k: v for k, v in template_kwargs.items() if k not in _RESERVED_KWARGS}
        try:
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools or None, add_generation_prompt=True, tokenize=False,
                **kwargs)
        except Exception as exc:  # jinja errors: raise_exception() in the template, bad input
            raise APIError(400, f"cannot render the chat template: {exc}",
                           param="messages") from None
        ids = encode_text(self.tokenizer, text, "messages")
        return RenderedPrompt(text=text, ids=ids,
                              reasoning_open=reasoning_open_in_prompt(text))

    def render(self, req: ChatCompletionRequest) -> RenderedPrompt:
        messages = [message_for_template(m, i) for i, m in enumerate(req.messages)]
        tools = ([t.model_dump(exclude_none=True) for t in req.tools]
                 if req.use_tools else None)
        return self.render_messages(messages, tools=tools, **req.template_kwargs())


def encode_text(tokenizer: Any, text: str, param: str) -> list[int]:
    """Token ids of `text` (no special tokens added). A string with a lone surrogate (a JSON
    `\\ud800` escape) is not valid Unicode and the tokenizer cannot take it: a 400 naming
    `param`."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} holds a lone surrogate (\\ud800-\\udfff), which is not "
                       "valid Unicode", param=param) from None
    return list(tokenizer.encode(text, add_special_tokens=False))

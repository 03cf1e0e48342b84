"""Chat messages -> prompt token ids through the checkpoint's own chat template.

Template variables come from the request's `chat_template_kwargs`; whether generation starts
inside `<think>` is read from the rendered prompt. Special-token strings the client sent stay
text (`prompt_ids`), and a prompt longer than the context is refused before it is tokenised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tinyserve.server.errors import APIError, ContextLengthError
from tinyserve.server.prompt_ids import PromptTooLong, encoder_for
from tinyserve.server.protocol import ChatCompletionRequest, ChatMessage, ToolCall
from tinyserve.server.reasoning import reasoning_open_in_prompt
from tinyserve.server.tool_choice import continuation

_RESERVED_KWARGS = {"messages", "tools", "add_generation_prompt", "tokenize", "conversation",
                    "return_dict", "chat_template", "documents"}


@dataclass(frozen=True)
class RenderedPrompt:
    text: str
    ids: list[int]
    reasoning_open: bool  # generation starts inside <think> ... </think>
    prefill: str = ""  # the end of `text` the response's parsers read first, as if generated


def _tool_call_for_template(call: ToolCall, where: str) -> dict[str, Any]:
    args = call.function.arguments
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except (ValueError, RecursionError):  # also too many digits, too deep a nesting
            args = None
    if not isinstance(args, dict):
        raise APIError(400, "tool call arguments must be a JSON object",
                       param=f"{where}.function.arguments")
    out: dict[str, Any] = {"type": "function",
                           "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def message_for_template(msg: ChatMessage, index: int) -> dict[str, Any]:
    """One request message as the template expects it (developer -> system, text parts joined,
    tool-call arguments as mappings, `reasoning` accepted for `reasoning_content`)."""
    content = msg.content
    if isinstance(content, list):
        content = "".join(part.text or "" for part in content)
    out: dict[str, Any] = {"role": "system" if msg.role == "developer" else msg.role,
                           "content": content or ""}
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


def render_chat(tokenizer: Any, req: ChatCompletionRequest, *, context: int | None = None,
                param: str = "messages", answer_prefix: str = "", forced: str | None = None
                ) -> RenderedPrompt:
    """`req`'s prompt through `tokenizer`'s chat template; every string the client sent is
    text, even where it spells a special token. With `context` (tokens of prompt + output), a
    prompt that leaves no room for output is a `ContextLengthError` naming `param`, raised
    before it is tokenised in full. The answer is begun for the model
    (`tool_choice.continuation`) with the client's `answer_prefix` and/or a `forced` tool
    call."""
    messages = [message_for_template(m, i) for i, m in enumerate(req.messages)]
    tools = req.tool_dicts()
    kwargs = {k: v for k, v in req.template_kwargs().items() if k not in _RESERVED_KWARGS}
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions", param=param)
    enc = encoder_for(tokenizer)
    try:
        text = tokenizer.apply_chat_template(
            enc.escape(messages), tools=enc.escape(tools) or None,
            add_generation_prompt=True, tokenize=False, **enc.escape(kwargs))
    except Exception as exc:  # jinja errors: raise_exception() in the template, bad input
        raise APIError(400, f"cannot render the chat template: {enc.unescape(str(exc))}",
                       param=param) from None
    suffix, prefill = continuation(reasoning_open_in_prompt(text), enc.escape(answer_prefix),
                                   enc.escape(forced))
    text += suffix
    check_unicode(text, param)
    try:
        ids = enc.encode_rendered(text, None if context is None else context - 1)
    except PromptTooLong as exc:
        raise too_long(exc, param) from None
    text = enc.unescape(text)
    return RenderedPrompt(text=text, ids=ids, reasoning_open=reasoning_open_in_prompt(text),
                          prefill=enc.unescape(prefill))


def check_unicode(text: str, param: str) -> None:
    """A 400 naming `param` for a lone surrogate (a JSON `\\ud800` escape): not Unicode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} holds a lone surrogate (\\ud800-\\udfff), which is not "
                       "valid Unicode", param=param) from None


def too_long(exc: PromptTooLong, param: str) -> ContextLengthError:
    """The 400 for a prompt that leaves no room for output (`exc.limit` + 1: the context)."""
    size = f"{exc.tokens}" if exc.exact else f"more than {exc.limit}"
    return ContextLengthError(size, exc.limit + 1, param)


def encode_text(tokenizer: Any, text: str, param: str, context: int) -> list[int]:
    """Token ids of raw `text` (`PromptEncoder.encode`); a 400 naming `param` for a lone
    surrogate or a text that leaves no room for output in `context` tokens."""
    check_unicode(text, param)
    try:
        return encoder_for(tokenizer).encode(text, context - 1)
    except PromptTooLong as exc:
        raise too_long(exc, param) from None

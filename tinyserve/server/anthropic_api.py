"""The Anthropic Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`) as a
translator onto the chat pipeline.

A request becomes a `ChatCompletionRequest`: `system` (a string or text blocks) the system
message; user turns' `tool_result` blocks tool messages (in block order, text blocks between
them user messages); assistant turns' `thinking` blocks `reasoning_content`, `text` blocks the
content and `tool_use` blocks tool calls; tools (`input_schema`) function tools; `tool_choice`
auto / any / tool / none the chat forms ("required" and a named function are forced by
prefilling the call, `server.tool_choice`); `stop_sequences` stop strings; `thinking`
enabled / adaptive / disabled the template's `enable_thinking` (absent: the template's
default). A final assistant turn of text is the start of the answer (Anthropic's prefill).
The template gets `preserve_thinking: true` unless the request's `chat_template_kwargs` (an
extension) says otherwise: Anthropic clients send the thinking blocks back.

`max_tokens` is required, as Anthropic requires it; one beyond what the context has left is
cut to it, and a response that ends there stops with `model_context_window_exceeded`. A
prompt the context cannot hold is a 400 "prompt is too long: N tokens > M maximum". Errors
are Anthropic error objects (`errors.error_body_for`). Accepted and without effect:
`metadata`, `service_tier`, `cache_control` on blocks, `context_management`,
`output_config.effort`, `thinking.budget_tokens` (not enforced). Refused with a 400: images
and documents, Anthropic's own tool types (web search, bash, text editor, ...), MCP servers,
containers and structured outputs.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from tinyserve.server.anthropic_events import MessagesFormatter
from tinyserve.server.errors import APIError
from tinyserve.server.generate import generate
from tinyserve.server.prepare import prepare_chat, render_prompt
from tinyserve.server.protocol import ChatCompletionRequest
from tinyserve.server.state import ServerState

_REJECTED_IF_SET = ("mcp_servers", "container", "output_format")


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class AnthropicTool(_Body):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent: a client tool; others are Anthropic's own


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(_Body):
    """The body of /v1/messages/count_tokens (and everything /v1/messages shares with it)."""

    model: str
    messages: list[AnthropicMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None


def _text_of(blocks: list[dict[str, Any]], where: str) -> str:
    """The text of text blocks (a tool result's content, the system prompt)."""
    parts = []
    for j, block in enumerate(blocks):
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here, got "
                           f"{block.get('type')!r}", param=f"{where}[{j}]")
        parts.append(block["text"])
    return "\n".join(parts)


def _user_messages(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "\n\n".join(text)})
            text.clear()

    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_result":
            flush()
            content = block.get("content")
            body = (_text_of(content, f"{where}[{j}].content") if isinstance(content, list)
                    else str(content or ""))
            if block.get("is_error") and not body.lower().startswith("error"):
                body = f"Error: {body}"
            out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"),
                        "content": body})
        else:
            raise APIError(400, f"{where}[{j}]: {kind!r} blocks are not supported in user "
                           "turns (text and tool_result are; this server serves a text model)",
                           param=f"{where}[{j}]")
    flush()
    return out


def _assistant_message(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    thinking, text, calls = [], [], []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "thinking":
            thinking.append(str(block.get("thinking", "")))
        elif kind == "redacted_thinking":
            continue  # opaque to this server: nothing to render
        elif kind == "tool_use":
            calls.append({"id": block.get("id"), "type": "function", "function": {
                "name": block.get("name"), "arguments": json.dumps(block.get("input") or {})}})
        else:
            raise APIError(400, f"{where}[{j}]: {kind!r} blocks are not supported in "
                           "assistant turns", param=f"{where}[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool]:
    """The chat form of Anthropic's tool_choice, and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    parallel = not choice.get("disable_parallel_tool_use", False)
    kind = choice.get("type")
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise APIError(400, "tool_choice.name is required with type 'tool'",
                           param="tool_choice.name")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    forms = {"auto": "auto", "any": "required", "none": "none"}
    if kind not in forms:
        raise APIError(400, "tool_choice.type must be 'auto', 'any', 'tool' or 'none'",
                       param="tool_choice.type")
    return forms[kind], parallel


def _check_supported(req: CountTokensRequest) -> None:
    extra = req.model_extra or {}
    for name in _REJECTED_IF_SET:
        if extra.get(name) not in (None, [], {}):
            raise APIError(400, f"{name} is not supported", param=name)
    if isinstance(extra.get("output_config"), dict) and extra["output_config"].get("format"):
        raise APIError(400, "output_config.format is not supported (no constrained decoding)",
                       param="output_config.format")
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom"):
            raise APIError(400, f"tools[{i}]: Anthropic's {tool.type!r} tool is not supported; "
                           "only custom tools (name, description, input_schema) are",
                           param=f"tools[{i}].type")
    if req.thinking is not None:
        kind = req.thinking.get("type")
        if kind not in ("enabled", "disabled", "adaptive"):
            raise APIError(400, "thinking.type must be 'enabled', 'adaptive' or 'disabled'",
                           param="thinking.type")
        budget = req.thinking.get("budget_tokens")
        if kind == "enabled" and (not isinstance(budget, int) or budget < 1024):
            raise APIError(400, "thinking.budget_tokens must be an integer >= 1024",
                           param="thinking.budget_tokens")
    if not req.messages:
        raise APIError(400, "messages must be a non-empty list", param="messages")


def to_chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, str]:
    """The chat request `req` stands for, and the answer's start (a final assistant turn)."""
    _check_supported(req)
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text_of(req.system, "system")
        messages.append({"role": "system", "content": system})
    prefix = ""
    last = req.messages[-1]
    turns = req.messages
    if last.role == "assistant":
        blocks = ([{"type": "text", "text": last.content}] if isinstance(last.content, str)
                  else last.content)
        where = f"messages[{len(turns) - 1}].content"
        prefix = _text_of(blocks, where)
        if prefix != prefix.rstrip():
            raise APIError(400, "final assistant content cannot end with trailing whitespace",
                           param=where)
        turns = turns[:-1]
    for i, msg in enumerate(turns):
        blocks = ([{"type": "text", "text": msg.content}] if isinstance(msg.content, str)
                  else msg.content)
        where = f"messages[{i}].content"
        if msg.role == "user":
            messages += _user_messages(blocks, where)
        else:
            messages.append(_assistant_message(blocks, where))
    tool_choice, parallel = _tool_choice(req.tool_choice)
    tools = [{"type": "function", "function": {
        "name": t.name, "description": t.description,
        "parameters": t.input_schema or {"type": "object", "properties": {}}}}
        for t in req.tools or []]
    body: dict[str, Any] = {
        "messages": messages, "tools": tools or None, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel,
        "chat_template_kwargs": {"preserve_thinking": True, **(req.chat_template_kwargs or {})}}
    if req.thinking is not None:
        kind = req.thinking.get("type")
        body["thinking"] = {"type": "disabled" if kind == "disabled" else "enabled"}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stop=req.stop_sequences or None, stream=req.stream)
        for j, stop in enumerate(req.stop_sequences or []):
            if not stop:
                raise APIError(400, "stop_sequences must be non-empty strings",
                               param=f"stop_sequences[{j}]")
    return ChatCompletionRequest.model_validate(body), prefix


def _too_long(prompt_tokens: int, context: int) -> str:
    return f"prompt is too long: {prompt_tokens} tokens > {context - 1} maximum"


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /v1/messages and POST /v1/messages/count_tokens on `app`."""

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Response:
        state.require_engine()
        state.check_model(req.model)
        chat, prefix = to_chat_request(req)
        prep = await prepare_chat(state, chat, max_param="max_tokens", clamp=True,
                                  answer_prefix=prefix, too_long=_too_long)
        fmt = MessagesFormatter(state.config.served_model_name,
                                prep.assembler(chat.parallel_tool_calls),
                                prompt_tokens=len(prep.prompt.ids), clamped=prep.clamped)
        return await generate(state, request, [fmt], prep.prompt.ids, prep.params,
                              stream=req.stream, include_usage=True)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict[str, Any]:
        state.require_engine()
        state.check_model(req.model)
        chat, prefix = to_chat_request(req)
        prompt, _ = await render_prompt(state, chat, answer_prefix=prefix)
        return {"input_tokens": len(prompt.ids)}

"""The Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`) translated
onto the chat pipeline.

`system` becomes the system message; user turns' `tool_result` blocks tool messages; assistant
turns' `thinking` / `text` / `tool_use` blocks reasoning, content and tool calls; `tool_choice`
auto / any / tool / none the chat forms; `thinking` the template's `enable_thinking`. A final
assistant turn of text is the start of the answer (Anthropic's prefill). `max_tokens` beyond
the context's room is cut to it (the answer then stops with `model_context_window_exceeded`);
a prompt the context cannot hold is "prompt is too long: N tokens > M maximum".

The bodies are validated as the OpenAI ones are (`protocol.StrictModel`); a block of a kind
this server does not take (image, document, a server tool's) is refused naming it. Accepted
without effect: `metadata`, `service_tier`, `cache_control`, `citations`,
`context_management`, `output_config.effort`, `thinking.budget_tokens` and `signature`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, field_validator, model_validator

from tinyserve.server.anthropic_events import MessagesFormatter
from tinyserve.server.errors import APIError, ContextLengthError
from tinyserve.server.generate import generate
from tinyserve.server.prepare import prepare_chat, render_prompt
from tinyserve.server.protocol import (
    MAX_STOP,
    ChatCompletionRequest,
    RequestBody,
    StrictModel,
    by_type,
    chat_request,
    function_tool,
)
from tinyserve.server.state import ServerState
from tinyserve.server.tool_parser import json_text


class _Cacheable(StrictModel):
    cache_control: dict[str, Any] | None = None  # prompt caching hints: no effect here


class TextBlock(_Cacheable):
    type: Literal["text"]
    text: str
    citations: list[dict[str, Any]] | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # not checked


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(_Cacheable):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


TextOrOther = by_type({"text": TextBlock})


class ToolResultBlock(_Cacheable):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextOrOther] | None = None
    is_error: bool | None = None


Block = by_type({"text": TextBlock, "thinking": ThinkingBlock,
                 "redacted_thinking": RedactedThinkingBlock, "tool_use": ToolUseBlock,
                 "tool_result": ToolResultBlock})


class AnthropicTool(_Cacheable):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent: a client tool; Anthropic's own are refused

    @field_validator("type")
    @classmethod
    def _custom_only(cls, kind: str | None) -> str | None:
        if kind not in (None, "custom"):
            raise ValueError(f"Anthropic's {kind!r} tool is not supported; only custom tools "
                             "(name, description, input_schema) are")
        return kind


class AnthropicToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> AnthropicToolChoice:
        if self.type == "tool" and self.name is None:
            raise ValueError("tool_choice.name is required with type 'tool'")
        return self


class ThinkingParam(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)  # not enforced

    @model_validator(mode="after")
    def _budget(self) -> ThinkingParam:
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("thinking.budget_tokens is required with type 'enabled' "
                             "(an integer >= 1024)")
        return self


class OutputConfig(StrictModel):
    effort: Literal["low", "medium", "high", "max"] | None = None  # no effect
    format: dict[str, Any] | None = None  # refused: structured outputs


class AnthropicMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class CountTokensRequest(RequestBody):
    """The body of /v1/messages/count_tokens (and everything /v1/messages shares with it)."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "mcp_servers": "mcp_servers is not supported: this server connects to no MCP servers",
        "container": "container is not supported: this server runs no code containers",
        "output_format": "output_format is not supported (structured outputs need "
                         "constrained decoding)",
    }

    model: str
    messages: Annotated[list[AnthropicMessage], Field(min_length=1)]
    system: str | list[TextOrOther] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingParam | None = None
    context_management: dict[str, Any] | None = None  # no effect
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1)]],
                              Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    metadata: dict[str, Any] | None = None  # no effect
    service_tier: str | None = None  # no effect


def _text_of(blocks: list[Any], where: str) -> str:
    """The text of text blocks (a tool result's content, the system prompt)."""
    parts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, TextBlock):
            raise APIError(400, f"{where}[{j}]: only text blocks are supported here, got "
                           f"{block.type!r}", param=f"{where}[{j}]")
        parts.append(block.text)
    return "\n".join(parts)


def _user_messages(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    text: list[str] = []

    def flush() -> None:
        if text:
            out.append({"role": "user", "content": "\n\n".join(text)})
            text.clear()

    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ToolResultBlock):
            flush()
            content = block.content
            body = (_text_of(content, f"{where}[{j}].content") if isinstance(content, list)
                    else content or "")
            if block.is_error and not body.lower().startswith("error"):
                body = f"Error: {body}"
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": body})
        else:
            raise APIError(400, f"{where}[{j}]: {block.type!r} blocks are not supported in user "
                           "turns (text and tool_result are; this server serves a text model)",
                           param=f"{where}[{j}]")
    flush()
    return out


def _assistant_message(blocks: list[Any], where: str) -> dict[str, Any]:
    thinking, text, calls = [], [], []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            text.append(block.text)
        elif isinstance(block, ThinkingBlock):
            thinking.append(block.thinking)
        elif isinstance(block, RedactedThinkingBlock):
            continue  # opaque to this server: nothing to render
        elif isinstance(block, ToolUseBlock):
            arguments = json_text(block.input)
            if arguments is None:  # NaN or Infinity: not JSON
                raise APIError(400, f"{where}[{j}].input must be a JSON object (no NaN or "
                               "Infinity)", param=f"{where}[{j}].input")
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": arguments}})
        else:
            raise APIError(400, f"{where}[{j}]: {block.type!r} blocks are not supported in "
                           "assistant turns", param=f"{where}[{j}]")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
    if thinking:
        msg["reasoning_content"] = "\n\n".join(thinking)
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tool_choice(choice: AnthropicToolChoice | None) -> tuple[Any, bool]:
    """The chat form of Anthropic's tool_choice, and whether parallel calls are allowed."""
    if choice is None:
        return None, True
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "tool":
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def _blocks(content: str | list[Any]) -> list[Any]:
    return [TextBlock(type="text", text=content)] if isinstance(content, str) else content


def to_chat_request(req: CountTokensRequest) -> tuple[ChatCompletionRequest, str]:
    """The chat request `req` stands for, and the answer's start (a final assistant turn)."""
    if req.output_config is not None and req.output_config.format:
        raise APIError(400, "output_config.format is not supported (no constrained decoding)",
                       param="output_config.format")
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else _text_of(req.system, "system")
        messages.append({"role": "system", "content": system})
    prefix = ""
    turns = req.messages
    if turns[-1].role == "assistant":
        where = f"messages[{len(turns) - 1}].content"
        prefix = _text_of(_blocks(turns[-1].content), where)
        if prefix != prefix.rstrip():
            raise APIError(400, "final assistant content cannot end with trailing whitespace",
                           param=where)
        turns = turns[:-1]
    for i, msg in enumerate(turns):
        where = f"messages[{i}].content"
        if msg.role == "user":
            messages += _user_messages(_blocks(msg.content), where)
        else:
            messages.append(_assistant_message(_blocks(msg.content), where))
    tool_choice, parallel = _tool_choice(req.tool_choice)
    tools = [function_tool(t.name, t.description, t.input_schema) for t in req.tools or []]
    body: dict[str, Any] = {"messages": messages, "tools": tools or None,
                            "tool_choice": tool_choice, "parallel_tool_calls": parallel}
    if req.thinking is not None:
        body["thinking"] = {"type": "disabled" if req.thinking.type == "disabled" else "enabled"}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                    top_k=req.top_k, stop=req.stop_sequences or None, stream=req.stream)
    return chat_request(body, req.chat_template_kwargs), prefix


def add_anthropic_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /v1/messages and POST /v1/messages/count_tokens on `app`."""

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, request: Request) -> Response:
        state.check_model(req.model)
        chat, prefix = to_chat_request(req)
        try:
            prep = await prepare_chat(state, chat, max_param="max_tokens", clamp=True,
                                      answer_prefix=prefix)
        except ContextLengthError as exc:  # in Anthropic's words
            raise APIError(400, f"prompt is too long: {exc.size} tokens > {exc.context - 1} "
                           "maximum", param=exc.param, code=exc.code) from None
        fmt = MessagesFormatter(state.config.served_model_name, prep.assembler(),
                                prompt_tokens=len(prep.prompt.ids), clamped=prep.clamped)
        return await generate(state, request, [fmt], prep.prompt.ids, prep.params,
                              stream=req.stream, include_usage=True)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(req: CountTokensRequest) -> dict[str, Any]:
        state.check_model(req.model)
        chat, prefix = to_chat_request(req)
        prompt = await render_prompt(state, chat, answer_prefix=prefix)
        return {"input_tokens": len(prompt.ids)}

"""The OpenAI Responses API (`POST /v1/responses`), as Codex CLI and the openai SDK use it,
translated onto the chat pipeline.

`instructions` and system / developer messages become the one system message; a `reasoning`
item the `reasoning_content` of the assistant turn it starts, `function_call` items that
turn's tool calls, `function_call_output` items tool messages; `reasoning.effort` "none" turns
thinking off. The server keeps no state: the client sends the whole conversation (`store:
false`), and gets its reasoning back as `encrypted_content` when it includes
"reasoning.encrypted_content", so that it can return the model's earlier thinking.

The body is validated as chat/completions' is (`protocol.StrictModel`); items are typed by
their `type` (a message when it has none), and one of a kind this server does not take (item
references, images, files) is refused naming it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field, field_validator

from tinyserve.server.errors import APIError
from tinyserve.server.generate import generate
from tinyserve.server.prepare import prepare_chat
from tinyserve.server.protocol import (
    ChatCompletionRequest,
    OpenAIBody,
    Probability,
    StrictModel,
    by_type,
    chat_request,
    function_tool,
)
from tinyserve.server.responses_events import ResponsesFormatter, decode_reasoning
from tinyserve.server.state import ServerState

ENCRYPTED_INCLUDE = "reasoning.encrypted_content"

_STATELESS = "is not supported (this server keeps no state and runs no background work)"


class TextPart(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # what an echoed output_text part carries
    logprobs: list[Any] | None = None


Part = by_type({"input_text": TextPart, "output_text": TextPart, "text": TextPart})


class _Item(StrictModel):
    id: str | None = None  # what an echoed output item carries
    status: str | None = None


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(_Item):
    type: Literal["reasoning"]
    summary: list[ReasoningText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


Item = by_type({"message": MessageItem, "reasoning": ReasoningItem,
                "function_call": FunctionCallItem,
                "function_call_output": FunctionCallOutputItem}, default="message")


class FunctionTool(StrictModel):
    type: str
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("type")
    @classmethod
    def _function_only(cls, kind: str) -> str:
        if kind != "function":
            hint = " (in Codex: web_search = \"disabled\")" if kind == "web_search" else ""
            raise ValueError(f"the {kind!r} tool is not supported; only function tools "
                             f"are{hint}")
        return kind


class FunctionChoice(StrictModel):
    type: Literal["function"]
    name: str


class ReasoningParam(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no effect
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # no effect


class TextFormat(StrictModel):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextParam(StrictModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect


class ResponsesStreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # no effect: events are not padded


class ResponsesRequest(OpenAIBody):
    UNSUPPORTED: ClassVar[dict[str, str]] = {
        "previous_response_id": f"previous_response_id {_STATELESS}",
        "conversation": f"conversation {_STATELESS}",
        "background": f"background {_STATELESS}",
        "prompt": f"prompt {_STATELESS}",
        "context_management": f"context_management {_STATELESS}",
        "max_tool_calls": "max_tool_calls is not supported",
        "top_logprobs": "top_logprobs is not supported",
    }

    model: str | None = None
    input: str | list[Item]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: Probability | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    reasoning: ReasoningParam | None = None
    include: list[str] | None = None
    text: TextParam | None = None
    truncation: Literal["auto", "disabled"] | None = None
    client_metadata: dict[str, Any] | None = None  # no effect
    prompt_cache_retention: str | None = None  # no effect
    chat_template_kwargs: dict[str, Any] | None = None  # extension

    def check_supported(self) -> None:
        if self.store:
            raise APIError(400, "store: true is not supported: this server keeps no responses; "
                           "send the whole conversation with store: false", param="store")
        for i, item in enumerate(self.include or []):
            if item != ENCRYPTED_INCLUDE:
                raise APIError(400, f"include {item!r} is not supported (only "
                               f"{ENCRYPTED_INCLUDE!r})", param=f"include[{i}]")
        fmt = self.text.format.type if self.text and self.text.format else "text"
        if fmt != "text":
            raise APIError(400, f"text.format {fmt!r} is not supported (no constrained "
                           "decoding)", param="text.format")
        if self.truncation not in (None, "disabled"):
            raise APIError(400, "truncation must be 'disabled'", param="truncation")
        for i, tool in enumerate(self.tools or []):
            if tool.strict:
                raise APIError(400, "strict function calling needs constrained decoding, which "
                               "is not supported; send strict: false",
                               param=f"tools[{i}].strict")


def _text_parts(content: str | list[Any], where: str) -> str:
    if isinstance(content, str):
        return content
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise APIError(400, f"{where}[{j}]: {part.type!r} parts are not supported (text "
                           "only; this server serves a text model)", param=f"{where}[{j}]")
        out.append(part.text)
    return "".join(out)


class _Turns:
    """Input items -> chat messages: assistant items of one turn (reasoning, message,
    function calls) are gathered into one assistant message."""

    def __init__(self) -> None:
        self.system: list[str] = []
        self.messages: list[dict[str, Any]] = []
        self._assistant: dict[str, Any] | None = None

    def _turn(self, new: bool = False) -> dict[str, Any]:
        if self._assistant is None or new:
            self._assistant = {"role": "assistant", "content": ""}
            self.messages.append(self._assistant)
        return self._assistant

    def add(self, item: Any, where: str) -> None:
        if isinstance(item, MessageItem):
            text = _text_parts(item.content, f"{where}.content")
            if item.role in ("system", "developer"):
                self.system.append(text)
            elif item.role == "user":
                self._assistant = None
                self.messages.append({"role": "user", "content": text})
            else:
                turn = self._assistant
                if turn is None or turn["content"] or turn.get("tool_calls"):
                    turn = self._turn(new=True)
                turn["content"] = text
        elif isinstance(item, ReasoningItem):
            text = decode_reasoning(item.model_dump(exclude_none=True))
            turn = self._turn(new=True)
            if text:
                turn["reasoning_content"] = text
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            self._turn().setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            self._assistant = None
            self.messages.append({"role": "tool", "tool_call_id": item.call_id,
                                  "content": _text_parts(item.output, f"{where}.output")})
        else:
            raise APIError(400, f"{where}: {item.type!r} items are not supported (messages, "
                           "reasoning, function_call and function_call_output are; this "
                           "server keeps no state)", param=f"{where}.type")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `req` stands for."""
    req.check_supported()
    turns = _Turns()
    if req.instructions:
        turns.system.append(req.instructions)
    if isinstance(req.input, str):
        turns.add(MessageItem(role="user", content=req.input), "input")
    else:
        for i, item in enumerate(req.input):
            turns.add(item, f"input[{i}]")
    messages = ([{"role": "system", "content": "\n\n".join(turns.system)}] if turns.system
                else []) + turns.messages
    if not turns.messages:
        raise APIError(400, "input must hold at least one message", param="input")
    tool_choice: Any = req.tool_choice
    if isinstance(tool_choice, FunctionChoice):
        tool_choice = {"type": "function", "function": {"name": tool_choice.name}}
    tools = [function_tool(t.name, t.description, t.parameters) for t in req.tools or []]
    body: dict[str, Any] = {
        "messages": messages, "tools": tools or None, "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream}
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        body["thinking"] = {"type": "disabled" if effort == "none" else "enabled"}
    return chat_request(body, req.chat_template_kwargs)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /v1/responses on `app`."""

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        tokenizer = state.check_model(req.model).tokenizer
        chat = to_chat_request(req)
        prep = await prepare_chat(state, chat, prompt_param="input",
                                  max_param="max_output_tokens")
        fmt = ResponsesFormatter(
            state.config.served_model_name, prep.assembler(),
            echo=req, with_encrypted=ENCRYPTED_INCLUDE in (req.include or ()),
            count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
        return await generate(state, request, [fmt], prep.prompt.ids, prep.params,
                              stream=req.stream, include_usage=True)

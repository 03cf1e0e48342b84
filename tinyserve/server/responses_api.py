"""The OpenAI Responses API (`POST /v1/responses`), as far as Codex CLI and the openai SDK use
it, as a translator onto the chat pipeline.

A request becomes a `ChatCompletionRequest`: `instructions` and every system / developer
message the one system message (the chat template takes it only first); user and assistant
messages (`input_text` / `output_text` parts) chat messages; a `reasoning` item the
`reasoning_content` of the assistant turn it starts; `function_call` items that turn's tool
calls; `function_call_output` items tool messages; function tools chat tools; `tool_choice`
"required" or `{"type": "function", "name"}` a forced call (`server.tool_choice`);
`reasoning.effort` "none" turns thinking off (other efforts: the template's default, on).
The template gets `preserve_thinking: true` unless the request's `chat_template_kwargs` (an
extension) says otherwise.

The server keeps no state: the client sends the whole conversation each time (as Codex does,
with `store: false`). Reasoning comes back to a client that asks for
`include: ["reasoning.encrypted_content"]` as `encrypted_content` (this server's own opaque
encoding of the text), so a client that returns its reasoning items that way, as Codex does,
keeps the model's earlier thinking. Refused with a 400 naming the field: `store: true`,
`previous_response_id`, `conversation`, `background`, `prompt`, item references, built-in and
custom tools (web search, file search, shell, ...), images and files, structured outputs
(`text.format` other than text), `truncation: "auto"`, logprobs and `max_tool_calls`.
Accepted without effect: `metadata`, `user`, `prompt_cache_key`, `service_tier`,
`safety_identifier`, `client_metadata`, `reasoning.summary` and `text.verbosity`.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field

from tinyserve.server.errors import APIError
from tinyserve.server.generate import generate
from tinyserve.server.prepare import prepare_chat
from tinyserve.server.protocol import ChatCompletionRequest
from tinyserve.server.responses_events import (
    ENCRYPTED_INCLUDE,
    ResponsesFormatter,
    decode_reasoning,
)
from tinyserve.server.state import ServerState

_REJECTED_IF_SET = ("previous_response_id", "conversation", "background", "prompt",
                    "max_tool_calls", "top_logprobs", "context_management")
_INCLUDABLE = (ENCRYPTED_INCLUDE,)


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    store: bool | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # extension

    def check_supported(self) -> None:
        extra = self.model_extra or {}
        for name in _REJECTED_IF_SET:
            if extra.get(name) not in (None, False, "", [], {}):
                raise APIError(400, f"{name} is not supported (this server keeps no state and "
                               "runs no background work)" if name != "max_tool_calls" else
                               f"{name} is not supported", param=name)
        if self.store:
            raise APIError(400, "store: true is not supported: this server keeps no responses; "
                           "send the whole conversation with store: false", param="store")
        for i, item in enumerate(self.include or []):
            if item not in _INCLUDABLE:
                raise APIError(400, f"include {item!r} is not supported (only "
                               f"{ENCRYPTED_INCLUDE!r})", param=f"include[{i}]")
        fmt = ((self.text or {}).get("format") or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"text.format {fmt!r} is not supported (no constrained "
                           "decoding)", param="text.format")
        if self.truncation not in (None, "disabled"):
            raise APIError(400, "truncation must be 'disabled'", param="truncation")
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type")
            if kind != "function":
                hint = " (in Codex: web_search = \"disabled\")" if kind == "web_search" else ""
                raise APIError(400, f"tools[{i}]: the {kind!r} tool is not supported; only "
                               f"function tools are{hint}", param=f"tools[{i}].type")
            if not isinstance(tool.get("name"), str):
                raise APIError(400, f"tools[{i}].name is required", param=f"tools[{i}].name")
        effort = (self.reasoning or {}).get("effort")
        if effort not in (None, "none", "minimal", "low", "medium", "high", "xhigh"):
            raise APIError(400, "reasoning.effort must be none, minimal, low, medium, high or "
                           "xhigh", param="reasoning.effort")


def _text_parts(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"{where} must be a string or a list of parts", param=where)
    out = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text",
                                                                   "text"):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise APIError(400, f"{where}[{j}]: {kind!r} parts are not supported (text only; "
                           "this server serves a text model)", param=f"{where}[{j}]")
        out.append(str(part.get("text", "")))
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

    def add(self, item: dict[str, Any], where: str) -> None:
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            text = _text_parts(item.get("content"), f"{where}.content")
            if role in ("system", "developer"):
                self.system.append(text)
            elif role == "user":
                self._assistant = None
                self.messages.append({"role": "user", "content": text})
            elif role == "assistant":
                turn = self._assistant
                if turn is None or turn["content"] or turn.get("tool_calls"):
                    turn = self._turn(new=True)
                turn["content"] = text
            else:
                raise APIError(400, f"{where}.role must be user, assistant, system or developer",
                               param=f"{where}.role")
        elif kind == "reasoning":
            text = decode_reasoning(item)
            turn = self._turn(new=True)
            if text:
                turn["reasoning_content"] = text
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": item.get("arguments") or "{}"}}
            self._turn().setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            self._assistant = None
            self.messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                                  "content": _text_parts(item.get("output", ""),
                                                         f"{where}.output")})
        else:
            raise APIError(400, f"{where}: {kind!r} items are not supported (messages, "
                           "reasoning, function_call and function_call_output are; this "
                           "server keeps no state)", param=f"{where}.type")


def to_chat_request(req: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request `req` stands for."""
    req.check_supported()
    turns = _Turns()
    if req.instructions:
        turns.system.append(req.instructions)
    if isinstance(req.input, str):
        turns.add({"type": "message", "role": "user", "content": req.input}, "input")
    else:
        for i, item in enumerate(req.input):
            turns.add(item, f"input[{i}]")
    messages = ([{"role": "system", "content": "\n\n".join(turns.system)}] if turns.system
                else []) + turns.messages
    if not turns.messages:
        raise APIError(400, "input must hold at least one message", param="input")
    tool_choice = req.tool_choice
    if isinstance(tool_choice, dict):
        if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
            raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or "
                           "{'type': 'function', 'name': ...}", param="tool_choice")
        tool_choice = {"type": "function", "function": {"name": tool_choice["name"]}}
    tools = [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description"),
        "parameters": t.get("parameters") or {"type": "object", "properties": {}}}}
        for t in req.tools or []]
    body: dict[str, Any] = {
        "messages": messages, "tools": tools or None, "tool_choice": tool_choice,
        "parallel_tool_calls": req.parallel_tool_calls, "max_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
        "chat_template_kwargs": {"preserve_thinking": True, **(req.chat_template_kwargs or {})}}
    effort = (req.reasoning or {}).get("effort")
    if effort is not None:
        body["thinking"] = {"type": "disabled" if effort == "none" else "enabled"}
    return ChatCompletionRequest.model_validate(body)


def add_responses_routes(app: FastAPI, state: ServerState) -> None:
    """Register POST /v1/responses on `app`."""

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, request: Request) -> Response:
        state.require_engine()
        state.check_model(req.model)
        chat = to_chat_request(req)
        prep = await prepare_chat(state, chat, prompt_param="input",
                                  max_param="max_output_tokens")
        tokenizer = state.renderer.tokenizer
        fmt = ResponsesFormatter(
            state.config.served_model_name, prep.assembler(chat.parallel_tool_calls),
            echo=req, with_encrypted=ENCRYPTED_INCLUDE in (req.include or ()),
            count_tokens=lambda text: len(tokenizer.encode(text, add_special_tokens=False)))
        return await generate(state, request, [fmt], prep.prompt.ids, prep.params,
                              stream=req.stream, include_usage=True)

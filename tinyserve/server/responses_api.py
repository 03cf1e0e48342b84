"""The OpenAI Responses API (`POST /v1/responses`), as Codex CLI and the openai SDK use it,
translated onto the chat pipeline.

`instructions` and system / developer messages become the one system message; a `reasoning`
item the `reasoning_content` of the assistant turn it starts, `function_call` items that
turn's tool calls, `function_call_output` items tool messages; `reasoning.effort` "none" turns
thinking off. The server keeps no state: the client sends the whole conversation (`store:
false`), and gets its reasoning back as `encrypted_content` when it includes
"reasoning.encrypted_content", so that it can return the model's earlier thinking.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from tinyserve.server.errors import APIError
from tinyserve.server.generate import generate
from tinyserve.server.prepare import prepare_chat
from tinyserve.server.protocol import ChatCompletionRequest, chat_request, function_tool
from tinyserve.server.responses_events import ResponsesFormatter, decode_reasoning
from tinyserve.server.responses_protocol import (
    ENCRYPTED_INCLUDE,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionChoice,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextPart,
)
from tinyserve.server.state import ServerState


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

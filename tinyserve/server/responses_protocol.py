"""Request body of the OpenAI Responses API, validated as chat/completions' is.

Input items are typed by their `type` (a message when it has none); an item or part of
another kind (item references, images, files) is an `OtherKind` that `responses_api` refuses
naming it.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from tinyserve.server.errors import APIError
from tinyserve.server.protocol import OpenAIBody, Probability, StrictModel, by_type

ENCRYPTED_INCLUDE = "reasoning.encrypted_content"

_INCLUDABLE = (ENCRYPTED_INCLUDE,)
_STATELESS = "is not supported (this server keeps no state and runs no background work)"


class TextPart(StrictModel):
    type: Literal["input_text", "output_text", "text"]
    text: str
    annotations: list[Any] | None = None  # what an echoed output_text part carries
    logprobs: list[Any] | None = None


Part = by_type({"input_text": TextPart, "output_text": TextPart, "text": TextPart})


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]
    id: str | None = None
    status: str | None = None


class ReasoningText(StrictModel):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningText] | None = None
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]
    id: str | None = None
    status: str | None = None


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
            if item not in _INCLUDABLE:
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

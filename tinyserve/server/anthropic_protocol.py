"""Request bodies of the Anthropic Messages API, validated as the OpenAI ones are.

Content blocks are typed by their `type`; a block of another kind (image, document, a server
tool's) is an `OtherKind` that `anthropic_api` refuses naming it. Accepted without effect:
`metadata`, `service_tier`, `cache_control`, `citations`, `context_management`,
`output_config.effort`, `thinking.budget_tokens` and thinking blocks' `signature`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from tinyserve.server.protocol import MAX_STOP, RequestBody, StrictModel, by_type


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

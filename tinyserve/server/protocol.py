"""Request bodies of the OpenAI API (pydantic) and what they ask of the sampler.

`StrictModel` bodies are strict (no coercion: `max_tokens: "3"` or `stream: 1` are refused),
refuse unknown fields as OpenAI does, and declare OpenAI's ranges (the served schema shows
them); `errors.validation_error` turns a failure into a 400 naming the parameter. Fields that
would change the output but are not supported are refused by name (`UNSUPPORTED`); what the
types cannot say is checked by `check_supported`. The other APIs' bodies build on these.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from tinyserve.core import MAX_TOP_LOGPROBS, SamplingParams
from tinyserve.server.errors import APIError, validation_error
from tinyserve.server.tool_choice import forced_function

MAX_CHOICES = 16  # the most choices (`n`) one request may ask for
MAX_STOP = 16  # the most stop strings
COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when it is omitted or null

# OpenAI (and vLLM) fields that would change the output if they were ignored: refused by name
# when set (null, false, empty and `HARMLESS` values are as good as absent)
UNSUPPORTED = {
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "web_search_options": "web search is not supported",
    "structured_outputs": "structured outputs are not supported",
    **dict.fromkeys(("functions", "function_call"),
                    "functions/function_call are deprecated; use tools"),
    **dict.fromkeys(("guided_json", "guided_regex", "guided_choice", "guided_grammar"),
                    "guided decoding is not supported"),
    **{k: f"{k} is not supported" for k in ("verbosity", "min_tokens",
                                             "include_stop_str_in_output")},
}
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")

Probability = Annotated[float, Field(ge=0, le=1)]
Penalty = Annotated[float, Field(ge=-2, le=2)]
TokenId = Annotated[int, Field(ge=0)]


class StrictModel(BaseModel):
    """A request body or part of one: strict types, finite numbers, no unknown fields."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class RequestBody(StrictModel):
    """A top-level body. `UNSUPPORTED`: its API's fields refused by name with the reason when
    set (`errors.validation_error`), dropped when empty or `HARMLESS`."""

    UNSUPPORTED: ClassVar[dict[str, str]] = {}
    HARMLESS: ClassVar[dict[str, Any]] = {}

    @model_validator(mode="before")
    @classmethod
    def _drop_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not any(k in cls.UNSUPPORTED for k in data):
            return data
        return {k: v for k, v in data.items()
                if k not in cls.UNSUPPORTED or not _unset(v, cls.HARMLESS.get(k))}


def _unset(value: Any, harmless: Any) -> bool:
    if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
        return True
    return type(value) is type(harmless) and value == harmless


class OpenAIBody(RequestBody):
    """An OpenAI body: its metadata fields are accepted and change nothing."""

    UNSUPPORTED: ClassVar[dict[str, str]] = UNSUPPORTED
    HARMLESS: ClassVar[dict[str, Any]] = {"min_tokens": 0}

    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None


class OtherKind(BaseModel):
    """A block, item or part of a kind this server does not take: kept as it came (any fields),
    so that the translator that meets it refuses it naming its `type`."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str


def by_type(kinds: dict[str, type[BaseModel]], default: str | None = None) -> Any:
    """A union of models picked by the value's `type` (`kinds`: type -> model; `default`: the
    type of a value without one); a value of any other type is an `OtherKind`."""
    other = OtherKind.__name__
    names = {kind: model.__name__ for kind, model in kinds.items()}

    def pick(value: Any) -> str:
        kind = (value.get("type", default) if isinstance(value, dict)
                else getattr(value, "type", default))
        return names.get(kind, other) if isinstance(kind, str) else other

    # NOTE: the tags are the models' names, which `errors.validation_error` leaves out of a
    # parameter's path (`messages[0].content[2].text`)
    members = [Annotated[m, Tag(m.__name__)] for m in dict.fromkeys([*kinds.values(), OtherKind])]
    return Annotated[Union[tuple(members)], Discriminator(pick)]  # noqa: UP007


class StreamOptions(StrictModel):
    include_usage: bool = False


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class FunctionDef(StrictModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(StrictModel):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionCall(StrictModel):
    name: str
    arguments: str | dict[str, Any] = ""  # OpenAI sends a JSON string; an object is taken too


class ToolCall(StrictModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # clients that merged streamed deltas keep it


class ContentPart(StrictModel):
    """A content part; only `{"type": "text", "text": ...}` is supported (`check_supported`
    names the others)."""

    type: str
    text: str | None = None
    image_url: Any = None
    input_audio: Any = None
    file: Any = None
    refusal: Any = None


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # what an OpenAI client echoes back of an earlier response's message
    refusal: None = None
    annotations: list[dict[str, Any]] | None = None
    audio: None = None
    function_call: None = None


class ThinkingConfig(StrictModel):
    type: Literal["enabled", "disabled"]


class _Sampling(OpenAIBody):
    """Sampling fields shared by chat and completions (top_k, min_p, repetition_penalty,
    stop_token_ids and ignore_eos are the usual extensions of local servers)."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: Probability | None = None  # 0: only the most likely token (greedy)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off
    min_p: Probability | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(None, ge=1, le=MAX_CHOICES)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None, json_schema_extra={"propertyNames": {"pattern": "^[0-9]{1,10}$"}})
    response_format: ResponseFormat | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        seen: set[int] = set()
        for key in value or {}:
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"keys must be token ids (decimal digits), got {key[:40]!r}")
            if int(key) in seen:
                raise ValueError(f"lists token {int(key)} twice")
            seen.add(int(key))
        return value

    def _unsupported_common(self) -> None:
        fmt = self.response_format.type if self.response_format is not None else "text"
        if fmt != "text":
            raise APIError(400, f"response_format {fmt!r} is not supported (no constrained "
                           "decoding); use 'text'", param="response_format")

    @property
    def top_k_logprobs(self) -> int | None:
        """How many alternatives per token the request's logprobs ask for (None: none)."""
        return None

    def choice_params(self, *, max_tokens: int, stop_token_ids: tuple[int, ...] = ()
                      ) -> list[SamplingParams]:
        """The SamplingParams of each of the `n` choices, the seed (when given) advanced by the
        choice's index so that seeded choices differ. ParamError names a field out of range."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "seed"):
            if getattr(self, name) is not None:
                kw[name] = getattr(self, name)
        if kw.get("top_k") == -1:
            kw["top_k"] = 0
        if kw.get("top_p") == 0:  # nothing but the most likely token: greedy
            kw.update(top_p=1.0, temperature=0.0)
        stops = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else stop_token_ids)
        first = SamplingParams(max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
                               stop_token_ids=tuple(dict.fromkeys(stops)),
                               logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
                               logprobs=self.top_k_logprobs, **kw)
        n = self.n or 1
        if n == 1 or first.seed is None:
            return [first] * n
        return [dataclasses.replace(first, seed=first.seed + i) for i in range(n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    thinking: ThinkingConfig | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    modalities: list[str] | None = None

    def check_supported(self) -> None:
        self._unsupported_common()
        if self.modalities not in (None, ["text"]):
            raise APIError(400, "only the text modality is supported", param="modalities")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        self.forced_call()  # a 400 for an unusable tool_choice
        for i, tool in enumerate(self.tools or ()):
            if tool.function.strict:
                raise APIError(400, "strict function calling needs constrained decoding, which "
                               "is not supported; send strict: false",
                               param=f"tools[{i}].function.strict")
        for i, msg in enumerate(self.messages):
            if isinstance(msg.content, list):
                for part in msg.content:
                    if part.type != "text" or part.text is None:
                        raise APIError(400, "only text content parts are supported",
                                       param=f"messages[{i}].content")

    @property
    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    @property
    def top_k_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def forced_call(self) -> str | None:
        """The call `tool_choice` forces (`tool_choice.forced_function`)."""
        return forced_function(self.tool_choice, [t.function.name for t in self.tools or ()])

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools the template shows the model (None: none, or tool_choice "none")."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (enable_thinking and the caller's own)."""
        kw = dict(self.chat_template_kwargs or {})
        if "enable_thinking" not in kw:
            if self.thinking is not None:
                kw["enable_thinking"] = self.thinking.type == "enabled"
            elif self.reasoning_effort is not None:
                kw["enable_thinking"] = self.reasoning_effort != "none"
        return kw


class CompletionRequest(_Sampling):
    prompt: (str | Annotated[list[str], Field(min_length=1)] | list[TokenId]
             | Annotated[list[list[TokenId]], Field(min_length=1)])
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)

    def check_supported(self) -> None:
        self._unsupported_common()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")

    @property
    def requested_max_tokens(self) -> int:
        return COMPLETION_MAX_TOKENS if self.max_tokens is None else self.max_tokens

    @property
    def top_k_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_input(self) -> str | list[int]:
        """The one prompt: text or token ids (a batch of several prompts is rejected)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, "one prompt per request is supported", param="prompt")
            p = p[0]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return p


def function_tool(name: str, description: str | None, parameters: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """A chat function tool (from another API's tool definition)."""
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": parameters or {"type": "object", "properties": {}}}}


def chat_request(body: dict[str, Any], template_kwargs: dict[str, Any] | None
                 ) -> ChatCompletionRequest:
    """The chat request another API's translator built (`anthropic_api`, `responses_api`). The
    template gets `preserve_thinking: true` unless `template_kwargs` says otherwise: those
    clients send the thinking back. A value that API's own model let through but a chat
    request refuses is a 400 naming the parameter as the chat request names it."""
    body["chat_template_kwargs"] = {"preserve_thinking": True, **(template_kwargs or {})}
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise validation_error(list(exc.errors()), OpenAIBody.UNSUPPORTED) from None

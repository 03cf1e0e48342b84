"""Request bodies of the OpenAI-compatible API (pydantic), and what they ask of the sampler.

Every field is either honoured or rejected with a 400 naming it (`unsupported_fields`).
Unknown fields are ignored, as OpenAI's own metadata fields (`user`, `metadata`, `store`)
carry nothing for generation. Responses are plain dicts built in `server.responses`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyserve.core import MAX_TOP_LOGPROBS, ParamError, SamplingParams
from tinyserve.server.errors import APIError
from tinyserve.server.tool_choice import forced_function

MAX_CHOICES = 16  # the most choices (`n`) one request may ask for

# Fields other servers accept that would change the output here if they were ignored.
_REJECTED_IF_SET = ("audio", "prediction", "web_search_options", "guided_json", "guided_regex",
                    "guided_choice", "guided_grammar", "structured_outputs", "min_tokens",
                    "include_stop_str_in_output", "best_of")
_HARMLESS = {"min_tokens": 0, "best_of": 1}


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class _Sampling(_Body):
    """Sampling fields shared by chat and completions (top_k, min_p, repetition_penalty and
    ignore_eos are the usual extensions of local servers)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    def _unsupported_common(self) -> None:
        extra = self.model_extra or {}
        for name in _REJECTED_IF_SET:
            value = extra.get(name)
            if value not in (None, False, "", [], {}) and value != _HARMLESS.get(name):
                raise APIError(400, f"{name} is not supported", param=name)
        modalities = extra.get("modalities")
        if modalities not in (None, ["text"]):
            raise APIError(400, "only the text modality is supported", param="modalities")
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise APIError(400, f"n must be in [1, {MAX_CHOICES}]", param="n")
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise APIError(400, "stop takes at most 16 strings", param="stop")

    def sampling_params(self, *, max_tokens: int, stop_token_ids: tuple[int, ...] = ()
                        ) -> SamplingParams:
        """The SamplingParams of this request (ParamError names a field out of range)."""
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "seed"):
            value = getattr(self, name)
            if value is not None:
                kw[name] = value
        stops = tuple(self.stop_token_ids or ()) + (() if self.ignore_eos else stop_token_ids)
        return SamplingParams(max_tokens=max_tokens, stop=self.stop, ignore_eos=self.ignore_eos,
                              stop_token_ids=tuple(dict.fromkeys(stops)),
                              logit_bias=self._logit_bias(), logprobs=self.top_k_logprobs,
                              **kw)

    @property
    def top_k_logprobs(self) -> int | None:
        """How many alternatives per token the request's logprobs ask for (None: none)."""
        return None

    def _logit_bias(self) -> dict[int, float]:
        """`logit_bias` with its JSON keys (strings) read as token ids."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            text = key.strip()
            if not text.isdigit():
                raise ParamError("logit_bias", f"keys must be token ids, got {key!r}")
            if int(text) in bias:
                raise ParamError("logit_bias", f"lists token {int(text)} twice")
            bias[int(text)] = value
        return bias

    def choice_params(self, *, max_tokens: int, stop_token_ids: tuple[int, ...] = ()
                      ) -> list[SamplingParams]:
        """The SamplingParams of each of the `n` choices: the request's, with the seed (when
        given) advanced by the choice's index so that seeded choices differ."""
        first = self.sampling_params(max_tokens=max_tokens, stop_token_ids=stop_token_ids)
        n = self.n or 1
        if n == 1 or first.seed is None:
            return [first] * n
        return [dataclasses.replace(first, seed=first.seed + i) for i in range(n)]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None

    def check_supported(self) -> None:
        self._unsupported_common()
        if not self.messages:
            raise APIError(400, "messages must be a non-empty list", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}]",
                           param="top_logprobs")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise APIError(400, f"response_format {fmt!r} is not supported (no constrained "
                           "decoding); use 'text'", param="response_format")
        if self.functions or self.function_call:
            raise APIError(400, "functions/function_call are deprecated; use tools",
                           param="functions" if self.functions else "function_call")
        forced_function(self.tool_choice, self.tools)  # a 400 for an unusable tool_choice
        if self.reasoning_effort not in (None, "none", "minimal", "low", "medium", "high"):
            raise APIError(400, "reasoning_effort must be none, minimal, low, medium or high",
                           param="reasoning_effort")
        if self.thinking and self.thinking.get("type") not in ("enabled", "disabled"):
            raise APIError(400, "thinking.type must be 'enabled' or 'disabled'",
                           param="thinking")
        for i, msg in enumerate(self.messages):
            if isinstance(msg.content, list):
                for part in msg.content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
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

    @property
    def use_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def template_kwargs(self) -> dict[str, Any]:
        """Extra variables for the chat template (enable_thinking and the caller's own)."""
        kw = dict(self.chat_template_kwargs or {})
        if "enable_thinking" not in kw:
            if self.thinking is not None:
                kw["enable_thinking"] = self.thinking.get("type") == "enabled"
            elif self.reasoning_effort is not None:
                kw["enable_thinking"] = self.reasoning_effort != "none"
        return kw


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check_supported(self) -> None:
        self._unsupported_common()
        if self.echo:
            raise APIError(400, "echo is not supported", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")

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
        if (isinstance(p, str) and not p) or (isinstance(p, list) and not p):
            raise APIError(400, "prompt must not be empty", param="prompt")
        return p

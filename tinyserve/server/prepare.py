"""A chat request on its way to the engine, the steps every chat-shaped API shares: the prompt
through the chat template, the answer's start when a tool call is forced or the client began
it (`tool_choice.continuation`), the fit in the context and the sampling parameters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio

from tinyserve.core import ParamError, SamplingParams
from tinyserve.server.chat import RenderedPrompt, render_chat
from tinyserve.server.errors import APIError, ContextLengthError
from tinyserve.server.protocol import ChatCompletionRequest
from tinyserve.server.responses import ChatAssembler
from tinyserve.server.state import ServerState


@dataclass(frozen=True)
class PreparedChat:
    """prompt: the rendered prompt, continuation included. params: one SamplingParams per
    choice. clamped: max_tokens was cut to what the context has left."""

    req: ChatCompletionRequest
    prompt: RenderedPrompt
    params: list[SamplingParams]
    clamped: bool = False

    def assembler(self) -> ChatAssembler:
        """A fresh parser of one choice's generated text (tool calls are parsed when the
        prompt showed the model tools)."""
        return ChatAssembler(reasoning_open=self.prompt.reasoning_open,
                             tools=self.req.tool_dicts(),
                             parallel_tool_calls=self.req.parallel_tool_calls,
                             prefill=self.prompt.prefill)


def context_length(engine: Any) -> int:
    """What a request may use (prompt + output): the real KV capacity, at most the model's
    position limit."""
    limit = getattr(engine.model_config, "max_position_embeddings", None)
    return int(min(engine.max_context, limit)) if limit else int(engine.max_context)


def fit_params(state: ServerState, req: Any, prompt_len: int, max_tokens: int | None,
               context: int, *, prompt_param: str, max_param: str) -> list[SamplingParams]:
    """`req`'s sampling parameters, one per choice, with `max_tokens` (None: all the room the
    context has left). A 400 naming the field when the request cannot fit in `context` or a
    value is out of range."""
    if prompt_len >= context:
        raise ContextLengthError(str(prompt_len), context, prompt_param)
    if max_tokens is None:
        max_tokens = context - prompt_len
    elif prompt_len + max_tokens > context:
        raise APIError(400, f"this server's context holds {context} tokens, but "
                       f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                       f"{max_tokens} in the output)", param=max_param,
                       code="context_length_exceeded")
    try:
        return req.choice_params(max_tokens=max_tokens, stop_token_ids=state.stop_token_ids)
    except ParamError as exc:
        param = max_param if exc.param == "max_tokens" else exc.param
        raise APIError(400, str(exc).replace(exc.param, param, 1), param=param) from None


async def render_prompt(state: ServerState, req: ChatCompletionRequest, *,
                        prompt_param: str = "messages", answer_prefix: str = "",
                        context: int | None = None) -> RenderedPrompt:
    """The prompt of `req`, continuation included (`chat.render_chat`)."""
    forced = req.forced_call()  # a 400 for a forced call of no tool
    tokenizer = state.require_engine().tokenizer
    return await anyio.to_thread.run_sync(lambda: render_chat(
        tokenizer, req, context=context, param=prompt_param, answer_prefix=answer_prefix,
        forced=forced))


async def prepare_chat(state: ServerState, req: ChatCompletionRequest, *,
                       prompt_param: str = "messages", max_param: str | None = None,
                       clamp: bool = False, answer_prefix: str = "") -> PreparedChat:
    """Render `req`, check that it fits and build its sampling parameters (400s name
    `prompt_param` / `max_param`, by default the request's max_tokens field; a prompt the
    context cannot hold is a `ContextLengthError`). `clamp`: cut a max_tokens beyond the
    context's room instead of refusing it. `answer_prefix`: the answer's start, written by the
    client."""
    ctx = context_length(state.require_engine())
    # NOTE: every message renders to >= 2 tokens; refuse a huge list before the template
    # spends seconds of CPU on it
    if 2 * len(req.messages) >= ctx:
        raise APIError(400, f"{len(req.messages)} messages cannot fit in this server's "
                       f"context of {ctx} tokens", param=prompt_param,
                       code="context_length_exceeded")
    prompt = await render_prompt(state, req, prompt_param=prompt_param,
                                 answer_prefix=answer_prefix, context=ctx)
    want, name = req.requested_max_tokens
    max_param = max_param or name
    room = ctx - len(prompt.ids)  # when none is left, fit_params refuses the prompt
    clamped = clamp and want is not None and want > room
    params = fit_params(state, req, len(prompt.ids), room if clamped else want, ctx,
                        prompt_param=prompt_param, max_param=max_param)
    return PreparedChat(req, prompt, params, clamped)

"""The generation driver shared by /v1/chat/completions and /v1/completions.

Submits to the engine, then either streams SSE chunks (keep-alive comments while nothing
arrives, one error event if generation fails after the stream started) or collects one body
while watching the client. Whenever the client goes away before the request finishes, the
request is aborted in the engine, which frees its KV pages and state slot.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tinyserve.core import ParamError, SamplingParams
from tinyserve.log import get_logger
from tinyserve.server.errors import APIError, error_body
from tinyserve.server.formatters import Formatter
from tinyserve.server.state import ServerState
from tinyserve.server.streaming import DONE, KEEPALIVE, SSE_HEADERS, OutputPump, sse

log = get_logger(__name__)


def check_fits(prompt_len: int, max_tokens: int | None, max_context: int, *,
               prompt_param: str, max_param: str) -> int:
    """The max_tokens to use; raises a 400 with the numbers when the request cannot fit."""
    if prompt_len >= max_context:
        raise APIError(400, f"the prompt is {prompt_len} tokens, but this server's context "
                       f"holds {max_context} tokens (prompt + output)", param=prompt_param,
                       code="context_length_exceeded")
    if max_tokens is None:
        return max_context - prompt_len
    if max_tokens < 1:
        raise APIError(400, f"{max_param} must be >= 1", param=max_param)
    if prompt_len + max_tokens > max_context:
        raise APIError(400, f"this server's context holds {max_context} tokens, but "
                       f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                       f"{max_tokens} in the output)", param=max_param,
                       code="context_length_exceeded")
    return max_tokens


def make_params(build: Any, max_param: str) -> SamplingParams:
    """Call `build()` (a request's sampling_params); range errors become 400s."""
    try:
        return build()
    except ParamError as exc:
        param = max_param if exc.param == "max_tokens" else exc.param
        raise APIError(400, str(exc).replace(exc.param, param, 1), param=param) from None


async def generate(state: ServerState, request: Request, fmt: Formatter,
                   prompt_ids: list[int], params: SamplingParams, *, stream: bool,
                   include_usage: bool) -> Response:
    engine = state.require_engine()
    t0 = time.monotonic()
    try:
        handle = engine.submit(prompt_ids, params, request_id=fmt.id)
    except ParamError as exc:  # a parameter the engine checks (logit_bias ids)
        state.metrics.request_done(fmt.endpoint, "rejected")
        raise APIError(400, str(exc), param=exc.param) from None
    except ValueError as exc:  # RequestRejected: can never fit, with the numbers
        state.metrics.request_done(fmt.endpoint, "rejected")
        raise APIError(400, str(exc), param=getattr(exc, "param", None) or fmt.prompt_param,
                       code="context_length_exceeded") from None
    except RuntimeError as exc:  # the engine is shutting down
        raise APIError(503, f"the engine is not accepting requests: {exc}") from None
    run = _Run(state, fmt, handle, len(prompt_ids), t0)
    if stream:
        usage = include_usage or state.config.always_include_usage
        return StreamingResponse(run.stream(usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return await run.collect(request)


def _failure(out: Any) -> APIError:
    """The error for a request the engine ended by itself (a failure, or its shutdown)."""
    if out.finish_reason == "abort":
        return APIError(503, f"the request was stopped: {out.error or 'engine shutdown'}")
    return APIError(500, f"generation failed: {out.error}")


class _Run:
    """One submitted request on its way back to the client."""

    def __init__(self, state: ServerState, fmt: Formatter, handle: Any, prompt_len: int,
                 t0: float) -> None:
        self.state, self.fmt, self.handle, self.t0 = state, fmt, handle, t0
        self.prompt_tokens = prompt_len
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finished = False
        self._last_token_t: float | None = None

    def _account(self, out: Any) -> None:
        n_new = len(getattr(out, "token_ids", ()) or ())
        self.prompt_tokens = getattr(out, "prompt_tokens", None) or self.prompt_tokens
        self.cached_tokens = getattr(out, "cached_tokens", None) or self.cached_tokens
        self.completion_tokens = getattr(out, "completion_tokens", None) or (
            self.completion_tokens + n_new)
        if n_new:
            t = time.monotonic()
            if self._last_token_t is None:
                self.state.metrics.observe_ttft(t - self.t0)
            else:
                self.state.metrics.observe_itl((t - self._last_token_t) / n_new)
            self._last_token_t = t

    def _done(self, outcome: str) -> None:
        self.finished = True
        self.state.metrics.request_done(self.fmt.endpoint, outcome, self.prompt_tokens,
                                        self.completion_tokens, time.monotonic() - self.t0)

    def _abort(self) -> None:
        if self.finished:
            return
        self.finished = True
        try:
            self.state.engine.abort(self.fmt.id)
        except Exception:  # the engine may already have dropped it
            log.debug("abort of %s failed", self.fmt.id, exc_info=True)
        self.state.metrics.request_done(self.fmt.endpoint, "abort", self.prompt_tokens,
                                        self.completion_tokens, time.monotonic() - self.t0)

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        pump = OutputPump(self.handle)
        fmt = self.fmt
        try:
            for chunk in fmt.start():
                yield sse(chunk)
            while True:
                try:
                    out = await pump.next(self.state.config.keepalive_s)
                except StopAsyncIteration:
                    self._done("error")
                    yield sse(error_body("generation ended without a result", "server_error"))
                    return
                if out is None:
                    yield KEEPALIVE
                    continue
                self._account(out)
                for chunk in fmt.on_text(out.text or "", getattr(out, "logprobs", ())):
                    yield sse(chunk)
                if not out.finished:
                    continue
                if out.finish_reason in ("error", "abort"):  # abort here: engine shutdown
                    self._done(out.finish_reason)
                    yield sse(_failure(out).body())
                    return
                chunks = fmt.on_finish(out.finish_reason)
                self._done(fmt.finish_reason or "stop")
                for chunk in chunks:
                    yield sse(chunk)
                if include_usage:
                    yield sse(fmt.usage_chunk(self.prompt_tokens, self.completion_tokens,
                                              self.cached_tokens))
                yield DONE
                return
        except Exception as exc:
            log.exception("stream %s failed", fmt.id)
            self._abort()
            yield sse(error_body(f"internal error: {type(exc).__name__}", "server_error"))
        finally:
            pump.close()
            self._abort()  # a no-op once finished; otherwise the client went away

    async def collect(self, request: Request) -> Response:
        pump = OutputPump(self.handle)
        fmt = self.fmt
        try:
            while True:
                try:
                    out = await pump.next(self.state.config.disconnect_poll_s)
                except StopAsyncIteration:
                    self._done("error")
                    raise APIError(500, "generation ended without a result") from None
                if out is None:
                    if await request.is_disconnected():
                        self._abort()
                        return Response(status_code=499)
                    continue
                self._account(out)
                fmt.on_text(out.text or "", getattr(out, "logprobs", ()))
                if out.finished:
                    break
            if out.finish_reason in ("error", "abort"):
                self._done(out.finish_reason)
                raise _failure(out)
            fmt.on_finish(out.finish_reason)
            self._done(fmt.finish_reason or "stop")
            return JSONResponse(fmt.body(self.prompt_tokens, self.completion_tokens,
                                         self.cached_tokens))
        except asyncio.CancelledError:
            self._abort()
            raise
        finally:
            pump.close()
            self._abort()

"""The generation driver shared by every generating route.

Submits to the engine, then streams SSE events (keep-alive comments while nothing arrives; a
failure after the stream started ends it as its API ends a failed stream: the formatter's
`error_event`) or collects one body while watching the client. When the client goes away
first, the request is aborted in the engine, which frees its KV pages and state slot.
`OutputPump` reads the choices' handles, each in its own task, so that the handler can wait
with a timeout without cancelling a handle's iterator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tinyserve.core import ParamError, SamplingParams
from tinyserve.log import get_logger
from tinyserve.server.errors import APIError
from tinyserve.server.formatters import Formatter, TokenCounts
from tinyserve.server.state import ServerState

log = get_logger(__name__)
KEEPALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def generate(state: ServerState, request: Request, fmts: Sequence[Formatter],
                   prompt_ids: list[int], params: Sequence[SamplingParams], *, stream: bool,
                   include_usage: bool) -> Response:
    """Submit one engine request per choice (`fmts[i]` formats choice i, sampled with
    `params[i]`) and answer with their stream or one body."""
    engine = state.require_engine()
    t0 = time.monotonic()
    rids = [fmts[0].id] if len(params) == 1 else [f"{fmts[0].id}-{i}" for i in range(len(params))]
    handles: list[Any] = []
    try:
        for rid, p in zip(rids, params, strict=True):  # the choices share seats as one group
            handles.append(engine.submit(prompt_ids, p, request_id=rid, group=fmts[0].id))
    except (ValueError, RuntimeError) as exc:
        for rid in rids[:len(handles)]:  # the choices already queued go too
            engine.abort(rid)
        if isinstance(exc, RuntimeError):  # the engine is shutting down
            raise APIError(503, f"the engine is not accepting requests: {exc}") from None
        state.metrics.request_done(fmts[0].endpoint, "rejected")
        if isinstance(exc, ParamError):  # a parameter the engine checks (logit_bias ids)
            raise APIError(400, str(exc), param=exc.param) from None
        # RequestRejected: can never fit, with the numbers
        raise APIError(400, str(exc), param=fmts[0].prompt_param,
                       code="context_length_exceeded") from None
    run = _Run(state, fmts, handles, rids, len(prompt_ids), t0)
    if stream:
        usage = include_usage or state.config.always_include_usage
        return StreamingResponse(run.stream(usage), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    return await run.collect(request)


_END = object()  # a handle is exhausted


class OutputPump:
    """The outputs of the request handles of one HTTP request's choices, in one queue.
    `await next(timeout)`: the next `(choice index, output)`, None when `timeout` passed
    first; StopAsyncIteration once every handle is exhausted (or a handle's exception)."""

    def __init__(self, handles: Sequence[Any]) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._open = len(handles)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._run(i, h)) for i, h in enumerate(handles)]

    async def _run(self, index: int, handle: Any) -> None:
        try:
            async for out in handle:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # surfaced to the handler as the next item
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_END)

    async def next(self, timeout: float | None) -> tuple[int, Any] | None:
        while True:
            if not self._open:
                raise StopAsyncIteration
            try:
                item = await asyncio.wait_for(self._queue.get(), timeout)
            except asyncio.TimeoutError:
                return None
            if item is _END:
                self._open -= 1
                continue
            if isinstance(item, Exception):
                raise item
            return item

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()


class _Run:
    """One HTTP request's choices (engine requests) on their way back to the client."""

    def __init__(self, state: ServerState, fmts: Sequence[Formatter], handles: list[Any],
                 rids: list[str], prompt_len: int, t0: float) -> None:
        self.state, self.fmts, self.handles, self.t0 = state, list(fmts), handles, t0
        self.rids = rids  # the choices' engine request ids
        self.fmt = self.fmts[0]  # the response's id, endpoint and envelope
        self.prompt_tokens = prompt_len
        self.completion = [0] * len(handles)  # completion tokens per choice
        self.cached_tokens = 0
        self.open = set(range(len(handles)))  # choices not finished yet
        self.finished = False
        self._last_token_t: float | None = None

    @property
    def counts(self) -> TokenCounts:
        return TokenCounts(self.prompt_tokens, sum(self.completion), self.cached_tokens)

    def _account(self, i: int, out: Any) -> None:
        n_new = len(out.token_ids)
        self.prompt_tokens = out.prompt_tokens or self.prompt_tokens
        self.cached_tokens = out.cached_tokens or self.cached_tokens
        self.completion[i] = out.completion_tokens or self.completion[i] + n_new
        if n_new:
            t = time.monotonic()
            first = self._last_token_t is None
            gap = t - self.t0 if first else (t - self._last_token_t) / n_new
            self.state.metrics.observe_latency(gap, first_token=first)
            self._last_token_t = t

    def _done(self, outcome: str) -> None:
        self.finished = True
        self.state.metrics.request_done(self.fmt.endpoint, outcome, self.prompt_tokens,
                                        sum(self.completion), time.monotonic() - self.t0)

    def _abort(self) -> None:
        if not self.finished:
            self._abort_open()
            self._done("abort")

    def _abort_open(self) -> None:
        for i in self.open:
            try:
                self.state.engine.abort(self.rids[i])
            except Exception:  # the engine may already have dropped it
                log.debug("abort of %s failed", self.rids[i], exc_info=True)
        self.open.clear()

    def _finish_reason(self) -> str:
        reasons = [f.finish_reason for f in self.fmts]
        return next((r for r in reasons if r and r != "stop"), reasons[0] or "stop")

    async def _next(self, pump: OutputPump, timeout: float) -> tuple[int, Any] | None:
        try:
            return await pump.next(timeout)
        except StopAsyncIteration:
            self._done("error")
            raise APIError(500, "generation ended without a result") from None

    def _take(self, i: int, out: Any) -> tuple[Formatter, list[dict[str, Any]], APIError | None]:
        """One engine output of choice `i`: its formatter, its chunks, and the error when the
        engine ended the request by itself (a failure, or its shutdown)."""
        fmt = self.fmts[i]
        self._account(i, out)
        chunks = fmt.on_text(out.text, out.logprobs)
        if not out.finished:
            return fmt, chunks, None
        self.open.discard(i)
        if out.finish_reason in ("error", "abort"):
            self._abort_open()  # the other choices are not wanted any more
            self._done(out.finish_reason)
            if out.finish_reason == "abort":
                msg = out.error or "engine shutdown"
                return fmt, chunks, APIError(503, f"the request was stopped: {msg}")
            return fmt, chunks, APIError(500, f"generation failed: {out.error}")
        chunks += fmt.on_finish(out.finish_reason, out.stop_str)
        return fmt, chunks, None

    async def stream(self, include_usage: bool) -> AsyncIterator[str]:
        pump = OutputPump(self.handles)
        try:
            for fmt in self.fmts:
                for chunk in fmt.start():
                    yield fmt.encode(chunk)
            while self.open:
                item = await self._next(pump, self.state.config.keepalive_s)
                if item is None:
                    yield KEEPALIVE
                    continue
                fmt, chunks, err = self._take(*item)
                for chunk in chunks:
                    yield fmt.encode(chunk)
                if err is not None:
                    yield self.fmt.error_event(err)
                    return
            self._done(self._finish_reason())
            for event in self.fmt.stream_end(self.counts, include_usage):
                yield event
        except APIError as err:
            yield self.fmt.error_event(err)
        except Exception as exc:
            log.exception("stream %s failed", self.fmt.id)
            self._abort()
            yield self.fmt.error_event(APIError(500, f"internal error: {type(exc).__name__}"))
        finally:
            pump.close()
            self._abort()  # a no-op once finished; otherwise the client went away

    async def collect(self, request: Request) -> Response:
        pump = OutputPump(self.handles)
        try:
            while self.open:
                item = await self._next(pump, self.state.config.disconnect_poll_s)
                if item is None:
                    if await request.is_disconnected():
                        self._abort()
                        return Response(status_code=499)
                    continue
                _, _, err = self._take(*item)
                if err is not None:
                    raise err
            self._done(self._finish_reason())
            return JSONResponse(self.fmt.body(self.counts))
        except asyncio.CancelledError:
            self._abort()
            raise
        finally:
            pump.close()
            self._abort()

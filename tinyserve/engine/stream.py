"""Per-request output streams: `RequestOutput` items handed from the engine thread to a consumer
iterating synchronously (`for out in handle`) or asynchronously (`async for out in handle`)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

from tinyserve.core import TokenLogprobs


@dataclass(frozen=True)
class RequestOutput:
    """New output of one request since the previous item.

    text: UTF-8-safe, stop strings (and tails that may begin one) held back. finish_reason: "stop"
    | "length" | "abort" | "error" on the last item. cached_tokens: prompt tokens from the prefix
    cache. stop_str: the stop string that ended the request (None for EOS or a stop token).
    """

    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_str: str | None = None


class RequestHandle:
    """The stream of one request: iterate it once (sync or async) up to the item with
    `finished=True`. `put` (the engine thread) never waits for the consumer."""

    def __init__(self, request_id: str, prompt_tokens: int,
                 abort: Callable[[str], None]) -> None:
        self.request_id = request_id
        self.prompt_tokens = prompt_tokens
        self._abort = abort
        self._items: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waker: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self.finished = False

    def abort(self) -> None:
        self._abort(self.request_id)

    def put(self, out: RequestOutput) -> None:
        """Called by the engine thread (any thread)."""
        with self._lock:
            if self.finished:
                return
            self.finished = out.finished
            self._items.put(out)
        waker = self._waker
        if waker is not None:
            loop, event = waker
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:  # the consumer's event loop is closed: nobody is listening
                pass

    def get(self, timeout: float | None = None) -> RequestOutput:
        """The next item (blocking). Raises TimeoutError after `timeout` seconds."""
        try:
            return self._items.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no output from {self.request_id} in {timeout} s") from None

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            out = self.get()
            yield out
            if out.finished:
                return

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        event = asyncio.Event()
        self._waker = (asyncio.get_running_loop(), event)
        while True:
            try:
                out = self._items.get_nowait()
            except queue.Empty:
                # NOTE: a put() after the get_nowait() above schedules event.set() on this
                # loop, which runs only once this coroutine awaits: after the clear().
                event.clear()
                await event.wait()
                continue
            yield out
            if out.finished:
                return

    def result(self, timeout: float | None = None) -> RequestOutput:
        """Wait for the end and merge every item into one (all tokens, all text)."""
        ids: list[int] = []
        text: list[str] = []
        logprobs: list[TokenLogprobs] = []
        while True:
            out = self.get(timeout)
            ids += out.token_ids
            text.append(out.text)
            logprobs += out.logprobs
            if out.finished:
                return RequestOutput(self.request_id, ids, "".join(text), True,
                                     out.finish_reason, out.error, out.prompt_tokens,
                                     out.completion_tokens, out.cached_tokens, logprobs)

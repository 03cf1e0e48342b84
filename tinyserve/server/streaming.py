"""Server-Sent Events framing, and `OutputPump`: engine request handles -> one queue, each
drained by its own task, so the handler can wait with a timeout (keep-alives, disconnects)
without cancelling a handle's iterator.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict[str, Any], event: str | None = None) -> str:
    """One SSE event carrying `obj` as strict JSON (NaN raises ValueError), named `event`
    when given."""
    text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return f"data: {text}\n\n" if event is None else f"event: {event}\ndata: {text}\n\n"


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

"""Server-Sent Events framing and the bridge from an engine request to the event loop.

`OutputPump` drains a `RequestHandle` (async iteration) into a queue in its own task, so the
handler can wait for the next output with a timeout (to send `: keep-alive` comments during a
long prefill and to notice a client that went away) without ever cancelling the handle's own
iterator.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

DONE = "data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(obj: dict[str, Any]) -> str:
    """One SSE event carrying `obj` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _End:
    pass


_END = _End()


class OutputPump:
    """Reads a request handle's outputs in a background task.

    `await next(timeout)` returns the next output, `None` when `timeout` passed first, and
    raises StopAsyncIteration once the handle is exhausted (or re-raises its exception).
    """

    def __init__(self, handle: Any) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._run(handle))

    async def _run(self, handle: Any) -> None:
        try:
            async for out in handle:
                self._queue.put_nowait(out)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # surfaced to the handler as the next item
            self._queue.put_nowait(exc)
        finally:
            self._queue.put_nowait(_END)

    async def next(self, timeout: float | None) -> Any:
        try:
            item = await asyncio.wait_for(self._queue.get(), timeout)
        except asyncio.TimeoutError:
            return None
        if item is _END:
            self._queue.put_nowait(_END)
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    def close(self) -> None:
        self._task.cancel()

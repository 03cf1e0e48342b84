"""ASGI middlewares: the API key (every route but /health) and the body size limit. Plain ASGI,
so streaming responses and disconnect detection pass through untouched.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from tinyserve.server.errors import APIError

OPEN_PATHS = frozenset({"/health"})


async def _send_error(send: Any, path: str, err: APIError,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(err.body_for(path)).encode()
    await send({"type": "http.response.start", "status": err.status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode())] + (headers or [])})
    await send({"type": "http.response.body", "body": payload})


def key_matches(given: str, keys: tuple[str, ...]) -> bool:
    """Constant-time comparison against every configured key (all of them compared)."""
    return any([hmac.compare_digest(given.encode(), key.encode()) for key in keys])


class APIKeyMiddleware:
    """Require `Authorization: Bearer <key>` (or `x-api-key: <key>`) when keys are set."""

    def __init__(self, app: Any, keys: tuple[str, ...]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"").decode("latin-1")
        given = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        given = given or headers.get(b"x-api-key", b"").decode("latin-1").strip()
        if given and key_matches(given, self.keys):
            return await self.app(scope, receive, send)
        message = ("missing API key: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
                   if not given else "incorrect API key")
        await _send_error(send, scope["path"], APIError(401, message, code="invalid_api_key"),
                          [(b"www-authenticate", b"Bearer")])


class BodyLimitMiddleware:
    """Answer 413 to a body over `max_bytes` (by Content-Length, or while it streams in)."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        path = scope["path"]
        too_big = APIError(413, f"request body larger than {self.max_bytes} bytes",
                           code="request_too_large")
        try:
            if length is not None and int(length) > self.max_bytes:
                return await _send_error(send, path, too_big)
        except ValueError:
            return await _send_error(send, path, APIError(400, "invalid Content-Length"))
        seen, refused = 0, False

        async def limited_receive() -> dict:
            nonlocal seen, refused
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    # NOTE: answer 413 here; the app sees a disconnect and what it sends after
                    # that is dropped
                    if not refused:
                        refused = True
                        await _send_error(send, path, too_big)
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: dict) -> None:
            if not refused:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)

"""Error objects: OpenAI's `{"error": {"message", "type", "param", "code"}}`, and Anthropic's
`{"type": "error", "error": {"type", "message"}}` on the Anthropic routes.

`install_error_handlers(app)` turns `APIError`, validation errors (422 -> 400), HTTP errors
and anything unexpected (500, logged) into the object the route's clients expect.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from tinyserve.log import get_logger

log = get_logger(__name__)

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether a request to `path` gets Anthropic's error objects (/v1/messages and below)."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


class APIError(Exception):
    """An error answered with `status` and the error object of the route's API."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = "invalid_request_error" if status < 500 else "server_error"

    def body(self) -> dict[str, Any]:
        """OpenAI's error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        """Anthropic's error object; its `type` follows the HTTP status as Anthropic's API does."""
        kind = ANTHROPIC_TYPES.get(self.status,
                                   "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def body_for(self, path: str) -> dict[str, Any]:
        """The error object for a request to `path`: Anthropic's on the Anthropic routes (the
        field a message names is in its text), OpenAI's everywhere else."""
        return self.anthropic_body() if is_anthropic_path(path) else self.body()


class ContextLengthError(APIError):
    """A 400 for a prompt that leaves no room for output in a `context` of tokens. `size`:
    its tokens ("1234", or "more than 999" when it was refused before it was tokenised in
    full), for the APIs that word the message their own way."""

    def __init__(self, size: str, context: int, param: str | None) -> None:
        super().__init__(400, f"the prompt is {size} tokens, but this server's context holds "
                         f"{context} tokens (prompt + output)", param=param,
                         code="context_length_exceeded")
        self.size = size
        self.context = context


# pydantic's names of union members and validators in an error's location (not fields):
# `str`, `list[Part]`, `literal['a','b']`, `function-after[...]`, a model's name
_MEMBER = re.compile(r"(?:[a-z][a-z0-9-]*\[.*\]|function-.*|constrained-.*|str|int|float|bool"
                     r"|none|bytes|[A-Z][A-Za-z0-9]*)", re.S)


def _loc_to_param(loc: tuple | list) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path")]
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif _MEMBER.fullmatch(str(p)):
            continue
        elif not str(p).isidentifier():  # a dict's key: the error is the dict's
            break
        else:
            out += ("." if out else "") + str(p)
    return out or None


def _deepest_alternative(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The first error, or when it is one member's of a union (`str | list[Part]`) the deepest
    error of any member of that union: the member the value was meant for got furthest."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    cut = next((i for i, p in enumerate(loc) if isinstance(p, str) and _MEMBER.fullmatch(p)),
               None)
    if cut is None:
        return first
    same = [e for e in errors if tuple(e.get("loc", ()))[:cut] == loc[:cut]]
    return max(same, key=lambda e: len(e.get("loc", ())))


def validation_error(errors: list[dict[str, Any]], unsupported: Mapping[str, str]) -> APIError:
    """FastAPI/pydantic validation errors -> one 400 APIError naming the first bad field.

    An unknown field is refused as OpenAI refuses it ("unrecognized request argument"), or
    with the reason when it is a top-level field known not to be supported (`unsupported`:
    name -> reason, the body model's `UNSUPPORTED`)."""
    if not errors:
        return APIError(400, "invalid request body")
    first = _deepest_alternative(errors)
    kind = first.get("type")
    if kind == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('msg', '')}".rstrip(": "))
    loc = tuple(first.get("loc", ()))
    param = _loc_to_param(loc)
    if kind == "missing":
        return APIError(400, f"{param} is required", param=param)
    if param is None and kind in ("model_attributes_type", "dict_type", "model_type"):
        return APIError(400, "the request body must be a JSON object")
    if kind == "extra_forbidden":
        name, parent = str(loc[-1]), _loc_to_param(loc[:-1])
        if not name.isidentifier():  # quoted, with any odd character escaped
            name = json.dumps(name)
        param = f"{parent}.{name}" if parent else name
        if parent is None and name in unsupported:
            return APIError(400, unsupported[name], param=param)
        return APIError(400, f"unrecognized request argument: {param}", param=param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: Any) -> None:
    """Register handlers so every error the app returns is its API's error object."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    def as_api_error(request: Any, exc: Exception) -> APIError:
        if isinstance(exc, APIError):
            return exc
        if isinstance(exc, RequestValidationError):  # UNSUPPORTED: the route body model's
            field = getattr(request.scope.get("route"), "body_field", None)
            model = getattr(getattr(field, "field_info", None), "annotation", None)
            return validation_error(list(exc.errors()), getattr(model, "UNSUPPORTED", None) or {})
        if isinstance(exc, HTTPException) and exc.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}",
                            code="not_found")
        if isinstance(exc, HTTPException):
            return APIError(exc.status_code, str(exc.detail))
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}")

    async def handle(request: Any, exc: Exception) -> JSONResponse:
        err = as_api_error(request, exc)
        headers = exc.headers if isinstance(exc, HTTPException) else None
        return JSONResponse(err.body_for(request.url.path), status_code=err.status,
                            headers=headers)

    for kind in (APIError, RequestValidationError, HTTPException, Exception):
        app.add_exception_handler(kind, handle)

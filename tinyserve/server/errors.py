"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` for every failure.

`APIError` is raised anywhere in a request handler; `install_error_handlers(app)` turns it,
FastAPI's validation errors (422 -> 400), HTTP errors and anything unexpected (500, logged)
into that shape.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinyserve.log import get_logger

log = get_logger(__name__)


class APIError(Exception):
    """An error answered with an OpenAI error object and `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


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


def _union_member(p: Any) -> bool:
    return isinstance(p, str) and bool(_MEMBER.fullmatch(p))


def _deepest_alternative(errors: list[dict[str, Any]]) -> dict[str, Any]:
    """The first error, or when it is one member's of a union (`str | list[Part]`) the deepest
    error of any member of that union: the member the value was meant for got furthest."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    cut = next((i for i, p in enumerate(loc) if _union_member(p)), None)
    if cut is None:
        return first
    same = [e for e in errors if tuple(e.get("loc", ()))[:cut] == loc[:cut]]
    return max(same, key=lambda e: len(e.get("loc", ())))


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """FastAPI/pydantic validation errors -> one 400 APIError naming the first bad field.

    An unknown field is refused as OpenAI refuses it ("unrecognized request argument"), or
    with the reason when it is a top-level field known not to be supported
    (`protocol.UNSUPPORTED`)."""
    from tinyserve.server.protocol import UNSUPPORTED

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
        if parent is None and name in UNSUPPORTED:
            return APIError(400, UNSUPPORTED[name], param=param)
        return APIError(400, f"unrecognized request argument: {param}", param=param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return APIError(400, f"{param}: {msg}" if param else msg, param=param)


def install_error_handlers(app: Any) -> None:
    """Register handlers so every error the app returns is an OpenAI error object."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def on_api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def on_validation(request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status)

    async def on_http(request, exc: HTTPException):
        if exc.status_code == 404:
            err = APIError(404, f"no route {request.method} {request.url.path}",
                           code="not_found")
        else:
            err = APIError(exc.status_code, str(exc.detail))
        return JSONResponse(err.body(), status_code=err.status, headers=exc.headers)

    async def on_any(request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        err = APIError(500, f"internal error: {type(exc).__name__}")
        return JSONResponse(err.body(), status_code=500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_any)

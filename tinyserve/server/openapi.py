"""The OpenAPI schema served at `GET /openapi.json`, corrected to what the server answers: no
422 (validation errors are 400s), each route's error statuses with its API's error object,
the event streams of the generating routes, and the API key's headers when one is set.
"""

from __future__ import annotations

from typing import Any

from tinyserve.server.errors import ANTHROPIC_TYPES, is_anthropic_path

ERROR_SCHEMA = {
    "type": "object", "required": ["error"], "additionalProperties": False,
    "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"},
                       "type": {"type": "string",
                                "enum": ["invalid_request_error", "server_error"]},
                       "param": {"type": ["string", "null"]},
                       "code": {"type": ["string", "null"]}}}}}

ANTHROPIC_ERROR_SCHEMA = {
    "type": "object", "required": ["type", "error"], "additionalProperties": False,
    "properties": {"type": {"type": "string", "enum": ["error"]}, "error": {
        "type": "object", "required": ["type", "message"],
        "properties": {"type": {"type": "string",
                                "enum": sorted(set(ANTHROPIC_TYPES.values()) | {"api_error"})},
                       "message": {"type": "string"}}}}}

_WHY = {
    "400": "invalid request: the parameter is named in `error.param`",
    "401": "missing or wrong API key (only when the server has one)",
    "404": "unknown model or route",
    "413": "request body larger than the server's limit",
    "500": "generation failed",
    "503": "the model is still loading or the server is shutting down",
}
_GENERATE = ("400", "401", "404", "413", "500", "503")
_ERRORS = {  # the statuses each route may answer besides 200
    "/v1/chat/completions": _GENERATE, "/v1/completions": _GENERATE,
    "/v1/messages": _GENERATE, "/v1/responses": _GENERATE,
    "/v1/messages/count_tokens": ("400", "401", "404", "413", "503"),
    "/v1/models": ("401", "503"), "/v1/models/{model_id}": ("401", "404", "503"),
    "/metrics": ("401",), "/health": ("503",),
}
_OPENAI_STREAM = "`data:` chunks ending with `data: [DONE]` (after an error event too)"
_STREAMING = {  # what a streamed answer of each generating route is
    "/v1/chat/completions": _OPENAI_STREAM, "/v1/completions": _OPENAI_STREAM,
    "/v1/messages": "events named by their type: `message_start` ... `message_stop`, or an "
                    "`error` event after a failure",
    "/v1/responses": "events named by their type and numbered: `response.created` ... "
                     "`response.completed` (or `response.incomplete`), or `response.failed` "
                     "after a failure",
}


def openapi_schema(app: Any, *, with_key: bool, model: str | None = None) -> dict[str, Any]:
    """The corrected schema of `app` (`with_key`: the server requires an API key; `model`:
    the model id it serves, given as the example of every `model` field)."""
    from fastapi.openapi.utils import get_openapi

    schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                         description="OpenAI-compatible API of tinyserve (and the "
                                     "Anthropic Messages API)")
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    schemas["ErrorResponse"] = ERROR_SCHEMA
    schemas["AnthropicErrorResponse"] = ANTHROPIC_ERROR_SCHEMA
    for body in schemas.values():
        field = body.get("properties", {}).get("model")
        if model is not None and field is not None:
            field["examples"] = [model]
    if with_key:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
        schema["security"] = [{"bearer": []}, {"apiKey": []}]  # either header
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            ref = {"$ref": "#/components/schemas/" + ("AnthropicErrorResponse"
                                                      if is_anthropic_path(path)
                                                      else "ErrorResponse")}
            for status in _ERRORS.get(path, ("401",) if with_key else ()):
                if status == "401" and not with_key:
                    continue
                responses[status] = {"description": _WHY[status],
                                     "content": {"application/json": {"schema": ref}}}
            if path in _STREAMING:
                ok = responses.setdefault("200", {"description": "Successful Response"})
                ok.setdefault("content", {})["text/event-stream"] = {"schema": {
                    "type": "string",
                    "description": f"server-sent events (`stream: true`): {_STREAMING[path]}"}}
            if path == "/health" and with_key:
                op["security"] = []
    return schema

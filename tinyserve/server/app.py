"""The FastAPI app: the OpenAI routes (the Anthropic and Responses routes come from their own
modules). `state.engine` may be set later: `/health` answers 503 with the load progress until
then. `/openapi.json` is behind the API key like every route but `/health`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from tinyserve.server.anthropic_api import add_anthropic_routes
from tinyserve.server.auth import APIKeyMiddleware, BodyLimitMiddleware
from tinyserve.server.chat import encode_text
from tinyserve.server.errors import APIError, install_error_handlers
from tinyserve.server.formatters import ChatFormatter, CompletionFormatter
from tinyserve.server.generate import generate
from tinyserve.server.openapi import openapi_schema
from tinyserve.server.prepare import context_length, fit_params, prepare_chat
from tinyserve.server.protocol import ChatCompletionRequest, CompletionRequest
from tinyserve.server.responses_api import add_responses_routes
from tinyserve.server.state import ServerState

_CREATED = int(time.time())


def model_card(state: ServerState) -> dict[str, Any]:
    n = context_length(state.require_engine())
    return {"id": state.config.served_model_name, "object": "model", "created": _CREATED,
            "owned_by": "tinyserve", "max_model_len": n, "context_length": n}


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="tinyserve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.tinyserve = state
    install_error_handlers(app)
    cfg = state.config

    @functools.cache
    def schema() -> dict[str, Any]:
        return openapi_schema(app, with_key=bool(cfg.api_keys), model=cfg.served_model_name)

    app.openapi = schema
    app.add_middleware(BodyLimitMiddleware, max_bytes=cfg.max_body_bytes)
    app.add_middleware(APIKeyMiddleware, keys=cfg.api_keys)
    if cfg.cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(cfg.cors_origins),
                           allow_methods=["*"], allow_headers=["*"])

    @app.get("/health")
    async def health() -> Response:
        if state.engine is not None and not state.shutting_down:
            return JSONResponse({"status": "ok"})
        if state.load_error:
            return JSONResponse({"status": "error", "message": state.load_error},
                                status_code=503)
        status = "shutting_down" if state.shutting_down else "loading"
        return JSONResponse({"status": status, "progress": round(state.load_progress, 4),
                             "stage": state.load_stage}, status_code=503)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> Response:
        return JSONResponse(app.openapi())

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(state)]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict[str, Any]:
        state.check_model(model_id)
        return model_card(state)

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = state.engine.stats() if state.engine is not None else None
        except Exception:  # metrics must never fail the scrape
            stats = None
        return PlainTextResponse(state.metrics.render(stats),
                                 media_type="text/plain; version=0.0.4")

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(req.model)
        req.check_supported()
        prep = await prepare_chat(state, req)
        fmts = _choices(state, req, prep.params, lambda **kw: ChatFormatter(
            state.config.served_model_name, prep.assembler(), **kw))
        return await generate(state, request, fmts, prep.prompt.ids, prep.params,
                              stream=req.stream, include_usage=req.include_usage)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        engine = state.check_model(req.model)
        req.check_supported()
        prompt = req.prompt_input()
        context = context_length(engine)
        if isinstance(prompt, str):
            ids = await anyio.to_thread.run_sync(
                lambda: encode_text(engine.tokenizer, prompt, "prompt", context))
        else:  # token ids, each >= 0 (the request's type)
            vocab = len(engine.tokenizer)
            if any(t >= vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            ids = list(prompt)
        params = fit_params(state, req, len(ids), req.requested_max_tokens, context,
                            prompt_param="prompt", max_param="max_tokens")
        fmts = _choices(state, req, params,
                        lambda **kw: CompletionFormatter(state.config.served_model_name, **kw))
        return await generate(state, request, fmts, ids, params, stream=req.stream,
                              include_usage=req.include_usage)

    add_anthropic_routes(app, state)
    add_responses_routes(app, state)
    return app


def _choices(state: ServerState, req: Any, params: list[Any], new: Callable[..., Any]
             ) -> list[Any]:
    """One formatter per choice (`new(**kw)` makes one), sharing the first one's id."""
    token_text = state.token_text if params[0].logprobs is not None else None
    fmts: list[Any] = []
    for _ in params:
        fmts.append(new(usage_null=req.include_usage, token_text=token_text,
                        first=fmts[0] if fmts else None))
    return fmts

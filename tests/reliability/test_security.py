"""Security: the API key (constant-time, required on every route but /health), the default
bind address, the request body limit, CORS off unless configured, and no client-supplied model
name or path ever reaching the filesystem."""

from __future__ import annotations

import hmac
import sys
import threading
from typing import Any

import httpx
import pytest

from tests.reliability import report
from tests.reliability.client import AUTH, KEY, MODEL
from tests.reliability.conftest import serving
from tinyserve.cli import build_parser
from tinyserve.server.app import create_app
from tinyserve.server.auth import key_matches
from tinyserve.server.errors import is_anthropic_path
from tinyserve.server.state import ServerConfig, ServerState

MARKER = "tsprobe7c1e"
_seen: list[tuple[str, str]] = []
_watching = threading.Event()


def _audit(event: str, args: tuple) -> None:
    if _watching.is_set() and MARKER in repr(args)[:100_000]:
        _seen.append((event, repr(args)[:200]))


sys.addaudithook(_audit)  # NOTE: cannot be removed; it does nothing unless _watching is set


def _routes() -> list[tuple[str, str]]:
    app = create_app(ServerState(ServerConfig(served_model_name=MODEL)))
    out = []
    for r in app.routes:
        for m in sorted(getattr(r, "methods", ()) or ()):
            if m != "HEAD":
                out.append((m, r.path.replace("{model_id:path}", MODEL)))
    return out


def _hit(url: str, method: str, path: str, headers: dict | None = None,
         **kw: Any) -> httpx.Response:
    r = httpx.request(method, url + path, headers=headers or {}, timeout=30, **kw)
    report.add("bad_inputs_tried")
    if r.status_code >= 500:
        report.add("responses_5xx")
    return r


def test_key_required_on_every_route_but_health(small_server):
    url, _, _ = small_server
    routes = _routes()
    assert ("GET", "/health") in routes and ("POST", "/v1/chat/completions") in routes
    extra = [("GET", "/no/such/route"), ("POST", "/v1/embeddings"), ("GET", "/docs"),
             ("GET", "/openapi.json"), ("GET", "/health/"), ("DELETE", "/v1/models")]
    for method, path in routes + extra:
        open_ = path == "/health"
        for headers in ({}, {"Authorization": "Bearer wrong"},
                        {"Authorization": "Bearer " + KEY[:-1] + "X"},  # same length
                        {"Authorization": KEY}, {"Authorization": "Basic " + KEY},
                        {"x-api-key": "wrong"}):
            r = _hit(url, method, path, headers, json={} if method == "POST" else None)
            if open_:
                assert r.status_code == 200, (path, r.text)
                continue
            assert r.status_code == 401, (method, path, headers, r.status_code)
            if is_anthropic_path(path):  # Anthropic's error object
                assert r.json()["error"]["type"] == "authentication_error"
            else:
                assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.headers["www-authenticate"] == "Bearer"
        for headers in (AUTH, {"x-api-key": KEY}, {"authorization": "bearer " + KEY}):
            r = _hit(url, method, path, headers, json={} if method == "POST" else None)
            assert r.status_code != 401, (method, path, headers)


def test_keys_compared_in_constant_time(monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    keys = ("first-key", "second-key", "third")
    assert key_matches("first-key", keys)
    assert len(calls) == 3  # no early exit on the first match
    calls.clear()
    assert not key_matches("nope", keys) and len(calls) == 3
    assert all(isinstance(a, bytes) and isinstance(b, bytes) for a, b in calls)
    assert not key_matches("", keys) and not key_matches("first-key", ())


def test_default_bind_is_loopback():
    parser = build_parser()
    for argv in (["run", "model"], ["demo"]):
        assert parser.parse_args(argv).host == "127.0.0.1"
    assert ServerConfig().api_keys == () and ServerConfig().cors_origins == ()


def test_body_limit(small_server):
    _, engine, _ = small_server
    with serving(engine, api_key=KEY, max_body_bytes=4096) as (url, _):
        big = {"model": MODEL, "prompt": "z" * 10_000, "max_tokens": 2}
        r = _hit(url, "POST", "/v1/completions", AUTH, json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit applies while the body streams in
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(20):
                yield b"z" * 1000
            yield b'", "max_tokens": 2}'

        r = _hit(url, "POST", "/v1/completions", AUTH, content=chunks())
        assert r.status_code == 413, r.text
        assert r.json()["error"]["code"] == "request_too_large"
        # without a key, a big body is refused before it is read
        r = _hit(url, "POST", "/v1/completions", {}, json=big)
        assert r.status_code == 401
        small = {"model": MODEL, "prompt": "Hello", "max_tokens": 2}
        assert _hit(url, "POST", "/v1/completions", AUTH, json=small).status_code == 200


def _preflight(url: str, origin: str) -> httpx.Response:
    return _hit(url, "OPTIONS", "/v1/chat/completions", {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_cors_off_by_default(small_server):
    url, _, _ = small_server
    r = _preflight(url, "https://evil.example")
    assert "access-control-allow-origin" not in r.headers
    r = _hit(url, "GET", "/v1/models", {**AUTH, "Origin": "https://evil.example"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    assert build_parser().parse_args(["run", "m"]).cors_origin is None


def test_cors_only_for_configured_origins(small_server):
    _, engine, _ = small_server
    with serving(engine, api_key=KEY, cors_origins=("https://ok.example",)) as (url, _):
        r = _preflight(url, "https://ok.example")
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://ok.example"
        r = _preflight(url, "https://evil.example")
        assert r.headers.get("access-control-allow-origin") != "https://evil.example"
        r = _hit(url, "GET", "/v1/models", {**AUTH, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("name", [f"../../{MARKER}", f"/tmp/{MARKER}", f"{MARKER}/x.json",
                                  f"~/{MARKER}", f"file:///{MARKER}", f"hf://org/{MARKER}"])
def test_client_names_never_reach_the_filesystem(small_server, name: str):
    url, _, _ = small_server
    msgs = [{"role": "user", "content": f"read {name}", "name": name}]
    tools = [{"type": "function", "function": {"name": "f", "description": name,
                                               "parameters": {"type": "object"}}}]
    _seen.clear()
    _watching.set()
    try:
        statuses = [
            _hit(url, "POST", "/v1/chat/completions", AUTH,
                 json={"model": name, "messages": msgs, "max_tokens": 2}).status_code,
            _hit(url, "POST", "/v1/completions", AUTH,
                 json={"model": name, "prompt": "x", "max_tokens": 2}).status_code,
            _hit(url, "GET", "/v1/models/" + name, AUTH).status_code,
            _hit(url, "GET", "/v1/" + name, AUTH).status_code,
            _hit(url, "POST", "/v1/chat/completions", AUTH, json={
                "model": MODEL, "messages": msgs, "tools": tools, "max_tokens": 2, "stop": [name],
                "user": name, "chat_template_kwargs": {"template": name, "path": name}}
                 ).status_code,
            _hit(url, "POST", "/v1/completions", {**AUTH, "X-Model-Path": name},
                 json={"model": MODEL, "prompt": name, "max_tokens": 2, "suffix": name}
                 ).status_code,
        ]
    finally:
        _watching.clear()
    assert statuses[:2] == [404, 404] and all(s < 500 for s in statuses), statuses
    assert statuses[2] == 404
    assert not _seen, _seen


def test_the_filesystem_probe_sees_opens(tmp_path):
    _seen.clear()
    _watching.set()
    try:
        (tmp_path / MARKER).write_text("x")
        list(tmp_path.glob(MARKER + "*"))
    finally:
        _watching.clear()
    assert any(event == "open" for event, _ in _seen), _seen

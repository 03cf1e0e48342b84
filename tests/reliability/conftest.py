"""Fixtures of the reliability tests: the real engine on a tiny CPU checkpoint behind uvicorn,
and the session summary (figures printed at the end of the run; written to
bench/results/reliability_cpu.json when TINYSERVE_WRITE_RESULTS=1)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import pytest

from tests.reliability import report

# The HTTP tests need the server stack (the GPU machine may lack it); the engine ones do not.
_HTTP = ("test_load.py", "test_bad_input.py", "test_security.py", "test_fuzz.py")
collect_ignore = [] if all(importlib.util.find_spec(m) for m in ("fastapi", "uvicorn", "httpx")) \
    else list(_HTTP)
if importlib.util.find_spec("schemathesis") is None:
    collect_ignore.append("test_fuzz.py")


@pytest.hookimpl
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> None:
    if "tests/reliability/" in item.nodeid.replace("\\", "/") and call.when == "call":
        report.record_test(item.nodeid, "failed" if call.excinfo else "passed")


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not report.touched():
        return
    written = report.write()
    terminalreporter.section("tinyserve reliability")
    for line in report.lines(report.summary(), written):
        terminalreporter.write_line(line)


def build(ckpt: Any, **overrides: Any) -> Any:
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    kw = dict(model=str(ckpt), device="cpu", max_context=512, max_seqs=16,
              max_num_batched_tokens=96, num_kv_pages=160)
    kw.update(overrides)
    return build_engine(EngineConfig(**kw)).start()


@contextlib.contextmanager
def serving(engine: Any, **config: Any) -> Iterator[tuple[str, Any]]:
    """uvicorn on an ephemeral port over `engine`; yields (url, ServerState)."""
    from tests.reliability.client import MODEL
    from tests.server.fakes import serve
    from tinyserve.server.app import create_app
    from tinyserve.server.state import ServerConfig, ServerState

    state = ServerState(ServerConfig(**{"served_model_name": MODEL, **config}), engine)
    with serve(create_app(state)) as url:
        yield url, state


@pytest.fixture(scope="session")
def rel_ckpt(tiny_checkpoint):
    # the checkpoint tests/server uses, so a whole-suite run builds it once
    return tiny_checkpoint(max_position_embeddings=2048)


@pytest.fixture(scope="module")
def load_server(rel_ckpt):
    """(url, engine): 16 sequences at once, 160 KV pages (so a full load preempts), chunked
    prefill of 96 tokens, prefix cache on, API key KEY."""
    from tests.reliability.client import KEY

    engine = build(rel_ckpt)
    try:
        with serving(engine, api_key=KEY) as (url, _):
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def small_server(rel_ckpt):
    """(url, engine, state): a 64-token context so that any generated request ends fast."""
    engine = build(rel_ckpt, max_context=64, max_seqs=4, num_kv_pages=32,
                   max_num_batched_tokens=64)
    from tests.reliability.client import KEY

    try:
        with serving(engine, api_key=KEY, max_body_bytes=1 << 20) as (url, state):
            yield url, engine, state
    finally:
        engine.shutdown()

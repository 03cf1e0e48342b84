"""Schemathesis against the server's own OpenAPI schema (bounded, derandomized, fixed seed):
no request may get a 5xx, every 4xx is an OpenAI error object, and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, seed, settings
from schemathesis import GenerationMode

from tests.reliability import report
from tests.reliability.client import AUTH, MODEL
from tests.reliability.test_bad_input import assert_error_object, assert_still_serving
from tinyserve.server.app import create_app
from tinyserve.server.state import ServerConfig, ServerState

EXAMPLES = 25  # per operation
SLOW_EXAMPLES = 300
STATUSES: dict[int, int] = {}


def _schema(phases: list[str]) -> schemathesis.BaseSchema:
    app = create_app(ServerState(ServerConfig(served_model_name=MODEL)))
    schema = schemathesis.openapi.from_dict(app.openapi())
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    schema.config.phases.update(phases=phases)
    return schema


schema = _schema(["examples", "fuzzing"])
# the coverage phase adds a few hundred boundary cases per operation: the slow run has them
full_schema = _schema(["examples", "coverage", "fuzzing"])


def check_case(case, url: str) -> None:
    kwargs = case.as_transport_kwargs(base_url=url, headers=AUTH)
    if isinstance(kwargs.get("data"), (bytes, str)):
        kwargs["content"] = kwargs.pop("data")
    keep = ("method", "url", "params", "headers", "json", "content", "data", "files")
    r = httpx.request(**{k: v for k, v in kwargs.items() if k in keep}, timeout=60)
    report.add("bad_inputs_tried")
    STATUSES[r.status_code] = STATUSES.get(r.status_code, 0) + 1
    if r.status_code >= 500:
        report.add("responses_5xx")
    assert r.status_code < 500, (case.as_curl_command(), r.status_code, r.text[:500])
    if 400 <= r.status_code < 500:
        assert_error_object(r)


@schema.parametrize()
@seed(20261129)
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_schema_fuzz(case, small_server):
    check_case(case, small_server[0])


@pytest.mark.slow
@full_schema.parametrize()
@seed(1129)
@settings(max_examples=SLOW_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_schema_fuzz_long(case, small_server):
    check_case(case, small_server[0])


def test_still_serving_after_fuzz(small_server):
    url, engine, _ = small_server
    assert_still_serving(url, engine)
    # the fuzzer reached both the validation errors and the engine
    assert STATUSES.get(200, 0) > 0 and STATUSES.get(400, 0) > 0, STATUSES

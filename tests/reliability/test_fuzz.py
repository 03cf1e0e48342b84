"""Fuzzing the HTTP API on the real engine (tiny model, 64-token context): no request may get a
5xx, every 4xx is the API's error object (OpenAI's, Anthropic's on /v1/messages), every 200 is
strict JSON (or SSE of strict JSON ending as the API ends a stream), and the server keeps
serving.

- Schemathesis against the schema the app serves at GET /openapi.json (fetched through the
  app with the key; the cases go to the real server; bounded, derandomized, fixed seed),
  valid and invalid bodies.
- A hypothesis property over valid requests built from the OpenAI ranges (every sampling
  parameter, tools, logprobs, n, stop strings, special-token strings and odd Unicode in the
  text, streamed or not), on an engine with room for the tools prompt: each one must
  generate. The same over the Anthropic Messages and OpenAI Responses ranges.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from tests.reliability import report
from tests.reliability.client import AUTH, MODEL
from tests.reliability.test_bad_input import assert_error_object, assert_still_serving

EXAMPLES = 25  # per operation
SLOW_EXAMPLES = 300
STATUSES: dict[int, int] = {}
GENERATED: dict[str, int] = {"requests": 0, "tokens": 0}


def _served_schema(phases: list[str]) -> Any:
    """The schema as GET /openapi.json serves it (with the key), through the app itself."""
    from tests.reliability.client import KEY
    from tinyserve.server.app import create_app
    from tinyserve.server.state import ServerConfig, ServerState

    app = create_app(ServerState(ServerConfig(served_model_name=MODEL, api_key=KEY)))
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers=AUTH)
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    schema.config.phases.update(phases=phases)
    return schema


@pytest.fixture(scope="module")
def gen_server(rel_ckpt):
    """(url, engine): a 1024-token context, so that any valid request fits."""
    from tests.reliability.client import KEY
    from tests.reliability.conftest import build, serving

    engine = build(rel_ckpt, max_context=1024, max_seqs=8, num_kv_pages=256,
                   max_num_batched_tokens=256)
    try:
        with serving(engine, api_key=KEY) as (url, _):
            yield url, engine
    finally:
        engine.shutdown()


schema = _served_schema(["examples", "fuzzing"])
# the coverage phase adds a few hundred boundary cases per operation: the slow run has them
full_schema = _served_schema(["examples", "coverage", "fuzzing"])


def strict_json(text: str) -> Any:
    def refuse(token: str) -> None:
        raise AssertionError(f"{token} in a response: not JSON")
    return json.loads(text, parse_constant=refuse)


_LAST_EVENT = {"/v1/messages": ("message_stop",),
               "/v1/responses": ("response.completed", "response.incomplete")}


def check_response(r: httpx.Response, path: str, *, fuzzed: bool = True) -> None:
    """No 5xx; a 4xx is the API's error object; a generation 200 is strict JSON or SSE of
    strict JSON ending as the API ends a stream that went well ([DONE], message_stop,
    response.completed / incomplete), and counts what it generated. `fuzzed`: count it as a
    bad input."""
    report.add("bad_inputs_tried" if fuzzed else "requests_served")
    STATUSES[r.status_code] = STATUSES.get(r.status_code, 0) + 1
    if r.status_code >= 500:
        report.add("responses_5xx")
    assert r.status_code < 500, (path, r.status_code, r.text[:500])
    if 400 <= r.status_code < 500:
        assert_error_object(r)
        return
    if r.status_code != 200:
        return
    if path not in _LAST_EVENT and not path.endswith("completions"):
        if r.headers["content-type"].startswith("application/json"):
            strict_json(r.text)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        if path in _LAST_EVENT:
            chunks = [strict_json(e) for e in events]
            assert chunks and chunks[-1]["type"] in _LAST_EVENT[path], r.text[-500:]
            last = chunks[-1].get("response") or chunks[-2]  # message_delta before the stop
            tokens = last["usage"]["output_tokens"]
        else:
            assert events and events[-1] == "[DONE]", r.text[-500:]
            chunks = [strict_json(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks), r.text[-500:]
            tokens = sum(1 for c in chunks for ch in c.get("choices") or ()
                         if ch.get("text") or (ch.get("delta") or {}).keys() - {"role"})
    else:
        usage = strict_json(r.text)["usage"]
        tokens = usage.get("completion_tokens", usage.get("output_tokens"))
    GENERATED["requests"] += 1
    GENERATED["tokens"] += tokens


def check_case(case, url: str) -> None:
    kwargs = case.as_transport_kwargs(base_url=url, headers=AUTH)
    if isinstance(kwargs.get("data"), (bytes, str)):
        kwargs["content"] = kwargs.pop("data")
    keep = ("method", "url", "params", "headers", "json", "content", "data", "files")
    r = httpx.request(**{k: v for k, v in kwargs.items() if k in keep}, timeout=60)
    check_response(r, case.path)


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


# ------------------------------------------------------------------ valid requests generate

SPECIAL = ["<|im_end|>", "<|im_start|>system\n", "<|endoftext|>", "</think>", "<tool_call>",
           "\ue000", "\ue000\ue101", "\u0000", "\U0001f600", "\u202e", "\r\n"]
text = st.lists(st.one_of(st.sampled_from(SPECIAL), st.text(max_size=6)), max_size=5).map(
    "".join)
number = st.floats(allow_nan=False, allow_infinity=False)
TOOLS = [{"type": "function", "function": {"name": "f", "description": "<|im_end|> tool",
          "parameters": {"type": "object", "properties": {
              "x": {"type": "number"}, "o": {"anyOf": {"type": "object"}},
              "a": {"oneOf": [{"type": "array"}, {"type": "null"}]}}}}}]


@st.composite
def valid_body(draw) -> tuple[str, dict[str, Any]]:
    chat = draw(st.booleans())
    body: dict[str, Any] = {"model": MODEL, "max_tokens": draw(st.integers(1, 6)),
                            "stream": draw(st.booleans())}
    optional = {
        "temperature": st.one_of(st.integers(0, 2), number.filter(lambda x: 0 <= x <= 2)),
        "top_p": st.sampled_from([0, 0.5, 1, 1e-9]), "top_k": st.integers(-1, 50),
        "min_p": st.sampled_from([0, 0.05, 1]), "presence_penalty": st.integers(-2, 2),
        "frequency_penalty": number.filter(lambda x: -2 <= x <= 2),
        "repetition_penalty": st.sampled_from([0.5, 1, 1.3, 10]),
        "seed": st.integers(-2**63, 2**64), "n": st.integers(1, 3),
        "stop": st.one_of(text.filter(bool), st.lists(text.filter(bool), max_size=3)),
        "logit_bias": st.dictionaries(st.integers(0, 400).map(str), st.integers(-100, 100),
                                      max_size=3),
        "ignore_eos": st.booleans(), "user": text, "metadata": st.just({"k": "v"}),
        "stream_options": st.builds(lambda u: {"include_usage": u}, st.booleans()),
        "response_format": st.just({"type": "text"}),
    }
    if chat:
        messages = [{"role": "system", "content": draw(text)}] if draw(st.booleans()) else []
        messages.append({"role": "user", "content": draw(text)})
        body["messages"] = messages
        optional |= {"logprobs": st.booleans(), "tools": st.just(TOOLS),
                     "tool_choice": st.sampled_from(["auto", "none"]),
                     "chat_template_kwargs": st.builds(lambda t: {"enable_thinking": t},
                                                       st.booleans()),
                     "reasoning_effort": st.sampled_from(["none", "low", "high"]),
                     "parallel_tool_calls": st.booleans()}
    else:
        body["prompt"] = draw(st.one_of(text.filter(bool),
                                        st.lists(st.integers(0, 400), min_size=1, max_size=8)))
        optional["logprobs"] = st.integers(0, 5)
    for name in draw(st.sets(st.sampled_from(sorted(optional)))):
        body[name] = draw(optional[name])
    if body.get("logprobs") is True:
        body["top_logprobs"] = draw(st.integers(0, 20))
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@seed(31)
@settings(max_examples=60, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(valid_body())
def test_valid_requests_generate(gen_server, request_body):
    path, body = request_body
    r = httpx.post(gen_server[0] + path, json=body, headers=AUTH, timeout=60)
    before = GENERATED["requests"]
    check_response(r, path, fuzzed=False)
    assert r.status_code == 200 and GENERATED["requests"] == before + 1, (body, r.text[:500])


AGENT_TOOLS = {
    "/v1/messages": [{"name": "f", "description": "<|im_end|> tool", "input_schema": {
        "type": "object", "properties": {"x": {"type": "number"}}}}],
    "/v1/responses": [{"type": "function", "name": "f", "description": "<|im_end|> tool",
                       "parameters": {"type": "object", "properties": {"x": {"type": "number"}}}}],
}


@st.composite
def valid_agent_body(draw) -> tuple[str, dict[str, Any]]:
    """A valid /v1/messages or /v1/responses body from those APIs' ranges."""
    path = draw(st.sampled_from(sorted(AGENT_TOOLS)))
    body: dict[str, Any] = {"model": MODEL, "stream": draw(st.booleans())}
    optional: dict[str, Any] = {"tools": st.just(AGENT_TOOLS[path])}
    if path == "/v1/messages":
        body["max_tokens"] = draw(st.integers(1, 6))
        body["messages"] = [{"role": "user", "content": draw(text)}]
        if draw(st.booleans()):  # the answer's start
            body["messages"].append({"role": "assistant", "content": draw(
                text.map(str.rstrip).filter(bool))})
        optional |= {
            "system": text, "temperature": number.filter(lambda x: 0 <= x <= 1),
            "top_p": st.sampled_from([0.5, 1, 1e-9]), "top_k": st.integers(0, 50),
            "stop_sequences": st.lists(text.filter(bool), max_size=3),
            "tool_choice": st.sampled_from([{"type": "auto"}, {"type": "none"}]),
            "thinking": st.sampled_from([{"type": "disabled"}, {"type": "adaptive"},
                                         {"type": "enabled", "budget_tokens": 1024}]),
            "metadata": st.just({"user_id": "u"})}
    else:
        body["max_output_tokens"] = draw(st.integers(1, 6))
        body["input"] = draw(st.one_of(text, st.builds(
            lambda t: [{"role": "user", "content": [{"type": "input_text", "text": t}]}], text)))
        optional |= {
            "instructions": text, "temperature": number.filter(lambda x: 0 <= x <= 2),
            "top_p": st.sampled_from([0, 0.5, 1]),
            "tool_choice": st.sampled_from(["auto", "none"]),
            "reasoning": st.sampled_from([{"effort": "none"}, {"effort": "low"}]),
            "store": st.just(False), "include": st.just(["reasoning.encrypted_content"])}
    for name in draw(st.sets(st.sampled_from(sorted(optional)))):
        body[name] = draw(optional[name])
    if "tool_choice" in body and "tools" not in body:
        body["tools"] = AGENT_TOOLS[path]
    return path, body


@seed(3131)
@settings(max_examples=30, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(valid_agent_body())
def test_valid_agent_requests_generate(gen_server, request_body):
    path, body = request_body
    r = httpx.post(gen_server[0] + path, json=body, headers=AUTH, timeout=60)
    before = GENERATED["requests"]
    check_response(r, path, fuzzed=False)
    assert r.status_code == 200 and GENERATED["requests"] == before + 1, (body, r.text[:500])


def test_still_serving_after_fuzz(small_server, gen_server):
    url, engine, _ = small_server
    assert_still_serving(url, engine)
    assert_still_serving(*gen_server)
    # the fuzzers reached both the validation errors and generation
    assert STATUSES.get(200, 0) > 0 and STATUSES.get(400, 0) > 0, STATUSES
    assert GENERATED["requests"] >= 90 and GENERATED["tokens"] > 90, GENERATED

"""The HTTP layer against a scripted engine: shapes, streaming order, errors, auth, disconnects."""

from __future__ import annotations

import functools
import json
import threading
import time

import httpx
import openai
import pytest

from tests.server.fakes import scripted_server

MODEL = "tiny-test"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"},
        "metric": {"type": "boolean"}}}}}]
REASONING = ["Let", " me", " think", ".\n", "</think>", "\n\n", "Hello", " world", "!"]
TOOL_REPLY = ["Check", "ing.\n", "</think>", "\n\n", "<tool_call>", "\n<function=get_weather>",
              "\n<parameter=city>\nPar", "is\n</parameter>\n<parameter=days>\n3\n</parameter>",
              "\n<parameter=metric>\ntrue\n</parameter>\n</function>\n", "</tool_call>"]


def _script(tokenizer):
    def script(prompt_ids, params):
        text = tokenizer.decode(prompt_ids)
        if "ERROR" in text:
            return ["partial", RuntimeError("device lost")]
        if "TOOL" in text:
            return TOOL_REPLY
        if "LONG" in text:
            return [f" w{i}" for i in range(400)]
        return REASONING
    return script


@pytest.fixture
def make_server(qwen_tokenizer):
    return functools.partial(scripted_server, qwen_tokenizer, _script(qwen_tokenizer), MODEL)


@pytest.fixture
def server(make_server):
    with make_server() as s:
        yield s


def _client(url: str, key: str = "none") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_chat_reasoning_split_stream_equals_nonstream(server):
    url, engine, _ = server
    client = _client(url)
    full = client.chat.completions.create(model=MODEL, messages=_msgs("Hi"), temperature=0)
    msg = full.choices[0].message
    assert msg.content == "Hello world!"
    assert msg.model_extra["reasoning_content"] == "Let me think."
    assert msg.model_extra["reasoning"] == "Let me think."
    assert full.choices[0].finish_reason == "stop"
    assert full.usage.completion_tokens == len(REASONING)
    assert full.usage.prompt_tokens == len(engine.submitted[-1][0])

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=_msgs("Hi"), stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content", "")
                        for c in chunks if c.choices)
    assert (content, reasoning) == ("Hello world!", "Let me think.")
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == full.usage.total_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_thinking_off_is_all_content(server):
    url, engine, _ = server
    r = _client(url).chat.completions.create(
        model=MODEL, messages=_msgs("Hi"),
        extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Let me think.\n</think>\n\nHello world!"
    assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
    prompt = engine.tokenizer.decode(engine.submitted[-1][0])
    assert prompt.endswith("<think>\n\n</think>\n\n")


def test_tool_calls_nonstream_and_stream(server):
    url, engine, _ = server
    client = _client(url)
    r = client.chat.completions.create(model=MODEL, messages=_msgs("TOOL please"), tools=TOOLS)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.model_extra["reasoning_content"] == "Checking."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3, "metric": True}
    assert "<tools>" in engine.tokenizer.decode(engine.submitted[-1][0])

    chunks = list(client.chat.completions.create(model=MODEL, messages=_msgs("TOOL please"),
                                                 tools=TOOLS, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    args = "".join(d.function.arguments or "" for d in deltas)
    assert json.loads(args) == {"city": "Paris", "days": 3, "metric": True}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(c.choices[0].delta.content for c in chunks[1:])


def test_tool_choice_none_leaves_text_and_tools_out(server):
    url, engine, _ = server
    r = _client(url).chat.completions.create(model=MODEL, messages=_msgs("TOOL please"),
                                             tools=TOOLS, tool_choice="none")
    assert "<tool_call>" in r.choices[0].message.content
    assert r.choices[0].finish_reason == "stop"
    assert "<tools>" not in engine.tokenizer.decode(engine.submitted[-1][0])


def test_sampling_params_reach_engine(server):
    url, engine, _ = server
    _client(url).chat.completions.create(
        model=MODEL, messages=_msgs("Hi"), max_completion_tokens=5, temperature=0.5, top_p=0.9,
        seed=7, stop=["xyz"], presence_penalty=0.5, frequency_penalty=0.25,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    p = engine.submitted[-1][1]
    assert (p.max_tokens, p.temperature, p.top_p, p.seed, p.stop) == (5, 0.5, 0.9, 7, ("xyz",))
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, 0.25)
    assert (p.top_k, p.min_p, p.repetition_penalty) == (20, 0.05, 1.1)
    assert 248046 in p.stop_token_ids  # <|im_end|>
    _client(url).chat.completions.create(model=MODEL, messages=_msgs("Hi"),
                                         extra_body={"ignore_eos": True})
    p = engine.submitted[-1][1]
    assert p.ignore_eos and not p.stop_token_ids
    assert p.max_tokens == engine.max_context - len(engine.submitted[-1][0])


def test_finish_length_and_completions(server):
    url, engine, _ = server
    client = _client(url)
    r = client.chat.completions.create(model=MODEL, messages=_msgs("LONG"), max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    c = client.completions.create(model=MODEL, prompt="LONG text", max_tokens=4)
    assert c.choices[0].text == " w0 w1 w2 w3" and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(engine.tokenizer.encode("LONG text"))
    chunks = list(client.completions.create(model=MODEL, prompt="LONG", max_tokens=4,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == " w0 w1 w2 w3"
    assert chunks[-1].usage.completion_tokens == 4
    c = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2)
    assert engine.submitted[-1][0] == [1, 2, 3] and c.usage.prompt_tokens == 3


def _err(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param is not None:
        assert err["param"] == param, err
    return err


BAD_BODIES = {
    "n_zero": ({"n": 0}, "n"),
    "n_many": ({"n": 17}, "n"),
    "logit_bias_key": ({"logit_bias": {"a1": 5}}, "logit_bias"),
    "logit_bias_range": ({"logit_bias": {"1": -101}}, "logit_bias"),
    "logit_bias_twice": ({"logit_bias": {"1": 5, "01": 3}}, "logit_bias"),
    "top_logprobs_alone": ({"top_logprobs": 2}, "top_logprobs"),
    "top_logprobs_range": ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "json_schema": ({"response_format": {"type": "json_schema", "json_schema": {}}},
                    "response_format"),
    "tool_choice_required_no_tools": ({"tool_choice": "required"}, "tool_choice"),
    "tool_choice_unknown_function": ({"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    "tool_choice_bad_form": ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    "functions": ({"functions": [{"name": "f"}]}, "functions"),
    "temperature_range": ({"temperature": -1}, "temperature"),
    "top_p_range": ({"top_p": 1.5}, "top_p"),
    "temperature_above_2": ({"temperature": 2.5}, "temperature"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "max_completion_tokens_big": ({"max_completion_tokens": 10**6}, "max_completion_tokens"),
    "temperature_type": ({"temperature": "hot"}, "temperature"),
    "empty_messages": ({"messages": []}, "messages"),
    "bad_role": ({"messages": [{"role": "wizard", "content": "x"}]}, None),
    "no_user_turn": ({"messages": [{"role": "system", "content": "x"}]}, "messages"),
    "image_part": ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    "stop_type": ({"stop": 5}, None),
    "guided_json": ({"guided_json": {"type": "object"}}, "guided_json"),
    "min_tokens": ({"min_tokens": 5}, "min_tokens"),
    "audio_modality": ({"modalities": ["text", "audio"]}, "modalities"),
    "empty_stop_string": ({"stop": [""]}, "stop"),
    # no coercion of wrong types
    "max_tokens_true": ({"max_tokens": True}, "max_tokens"),
    "max_tokens_string": ({"max_tokens": "3"}, "max_tokens"),
    "max_tokens_float": ({"max_tokens": 3.0}, "max_tokens"),
    "temperature_string": ({"temperature": "0.5"}, "temperature"),
    "stream_one": ({"stream": 1}, "stream"),
    "logprobs_one": ({"logprobs": 1}, "logprobs"),
    "n_string": ({"n": "2"}, "n"),
    "include_usage_string": ({"stream": True, "stream_options": {"include_usage": "yes"}},
                             "stream_options.include_usage"),
    "content_number": ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    # unknown fields, as OpenAI answers them
    "unknown_field": ({"frobnicate": 1}, "frobnicate"),
    "unknown_field_odd_name": ({"my-field": 1}, '"my-field"'),
    "content_part_unknown_key": ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "cache_control": {}}]}]},
        "messages[0].content[0].cache_control"),
    "unknown_message_field": ({"messages": [{"role": "user", "content": "x", "weird": 1}]},
                              "messages[0].weird"),
    "unknown_stream_option": ({"stream_options": {"continuous_usage_stats": True}},
                              "stream_options.continuous_usage_stats"),
    "unknown_tool_field": ({"tools": [{"type": "function", "function": {"name": "f"},
                                       "cache_control": {}}]}, "tools[0].cache_control"),
    "audio": ({"audio": {"voice": "x"}}, "audio"),
    "strict_tool": ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]},
                    "tools[0].function.strict"),
    "thinking_budget": ({"thinking": {"type": "enabled", "budget_tokens": 5}},
                        "thinking.budget_tokens"),
    # logit_bias keys that str.isdigit() takes and int() does not (or should not)
    "logit_bias_superscript": ({"logit_bias": {"\u00b2": 5}}, "logit_bias"),
    "logit_bias_arabic_digits": ({"logit_bias": {"\u0661\u0662": 5}}, "logit_bias"),
    "logit_bias_long_key": ({"logit_bias": {"1" * 5000: 5}}, "logit_bias"),
    "logit_bias_space": ({"logit_bias": {" 5": 5}}, "logit_bias"),
    # chat history the template cannot take
    "tool_call_function_string": ({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": "f"}]}]},
        "messages[1].tool_calls[0].function"),
    "tool_call_not_object": ({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": ["f"]}]},
        "messages[1].tool_calls[0]"),
    "tool_call_args_huge_number": ({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": '{"a": ' + "9" * 5000 + "}"}}]}]},
        "messages[1].tool_calls[0].function.arguments"),
    "tool_call_args_deep": ({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"}}]}]},
        "messages[1].tool_calls[0].function.arguments"),
    "tool_call_args_list": ({"messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "f", "arguments": "[1, 2]"}}]}]},
        "messages[1].tool_calls[0].function.arguments"),
}


@pytest.mark.parametrize("name", sorted(BAD_BODIES))
def test_bad_requests_are_400(server, name):
    url, engine, _ = server
    extra, param = BAD_BODIES[name]
    body = {"model": MODEL, "messages": _msgs("Hi"), **extra}
    n_before = len(engine.submitted)
    err = _err(httpx.post(url + "/v1/chat/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"
    assert len(engine.submitted) == n_before


def test_other_error_classes(server):
    url, engine, _ = server
    post = lambda path, **kw: httpx.post(url + path, **kw)  # noqa: E731
    err = _err(post("/v1/chat/completions", content=b"{not json",
                    headers={"content-type": "application/json"}), 400)
    assert "JSON" in err["message"]
    _err(post("/v1/chat/completions", json=[1, 2]), 400)
    nan = b'{"model": "tiny-test", "messages": [{"role": "user", "content": "x"}], "top_p": NaN}'
    _err(post("/v1/chat/completions", content=nan,
              headers={"content-type": "application/json"}), 400, "top_p")
    _err(post("/v1/chat/completions", json={"model": MODEL}), 400, "messages")
    _err(post("/v1/chat/completions", json={"model": "gpt-4", "messages": _msgs("x")}), 404,
         "model")
    _err(httpx.get(url + "/v1/models/gpt-4"), 404, "model")
    _err(httpx.get(url + "/v1/nope"), 404)
    long = "hello " * 5000
    err = _err(post("/v1/chat/completions", json={"model": MODEL, "messages": _msgs(long)}),
               400, "messages")
    assert str(engine.max_context) in err["message"] and "5" in err["message"]
    _err(post("/v1/completions", json={"model": MODEL, "prompt": "x", "echo": True}), 400,
         "echo")
    _err(post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]}), 400, "prompt")
    _err(post("/v1/completions", json={"model": MODEL, "prompt": [10**9]}), 400, "prompt")
    _err(post("/v1/chat/completions", content=b"x" * (17 * 2**20),
              headers={"content-type": "application/json"}), 413)
    # the server survived all of it
    assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_models_and_health(server):
    url, engine, _ = server
    models = _client(url).models.list()
    (card,) = models.data
    assert card.id == MODEL
    assert card.model_extra["context_length"] == engine.max_context
    assert card.model_extra["max_model_len"] == engine.max_context
    assert _client(url).models.retrieve(MODEL).id == MODEL


def test_loading_state(make_server):
    with make_server(loaded=False) as (url, engine, state):
        state.set_progress(0.25, "weights")
        r = httpx.get(url + "/health")
        assert r.status_code == 503
        assert r.json() == {"status": "loading", "progress": 0.25, "stage": "weights"}
        _err(httpx.post(url + "/v1/chat/completions",
                        json={"model": MODEL, "messages": _msgs("x")}), 503)
        state.set_engine(engine)
        assert httpx.get(url + "/health").json() == {"status": "ok"}


def test_api_key(make_server):
    with make_server(api_key="sekret") as (url, _, _):
        with pytest.raises(openai.AuthenticationError):
            _client(url, "wrong").models.list()
        err = _err(httpx.get(url + "/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        _err(httpx.get(url + "/metrics"), 401)
        assert httpx.get(url + "/health").status_code == 200
        r = _client(url, "sekret").chat.completions.create(model=MODEL, messages=_msgs("Hi"))
        assert r.choices[0].message.content == "Hello world!"


def test_cors_off_by_default_and_on_when_asked(make_server):
    hdr = {"Origin": "http://example.com"}
    with make_server() as (url, _, _):
        assert "access-control-allow-origin" not in httpx.get(url + "/v1/models", headers=hdr
                                                               ).headers
    with make_server(cors_origins=("http://example.com",)) as (url, _, _):
        r = httpx.get(url + "/v1/models", headers=hdr)
        assert r.headers["access-control-allow-origin"] == "http://example.com"


def _raw_stream(url: str, body: dict, timeout: float = 30) -> list[str]:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        assert r.status_code == 200
        return [line for line in r.iter_lines() if line]


def test_keepalive_during_prefill_and_error_event(make_server):
    with make_server(engine_kw={"prefill_s": 0.6}, keepalive_s=0.1) as (url, _, _):
        lines = _raw_stream(url, {"model": MODEL, "messages": _msgs("Hi"), "stream": True})
        assert lines.count(": keep-alive") >= 2
        assert lines[-1] == "data: [DONE]"
    with make_server() as (url, _, state):
        lines = _raw_stream(url, {"model": MODEL, "messages": _msgs("ERROR"), "stream": True})
        assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
        last = json.loads(lines[-2].removeprefix("data: "))  # the error event, then [DONE]
        assert last["error"]["type"] == "server_error" and "device lost" in last["error"]["message"]
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": _msgs("ERROR")})
        _err(r, 500)
        assert httpx.get(url + "/health").status_code == 200


def _wait(cond, timeout=5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.02)
    return False


def test_disconnect_aborts_stream_and_nonstream(make_server):
    with make_server(engine_kw={"tick_s": 0.01}) as (url, engine, _):
        body = {"model": MODEL, "messages": _msgs("LONG"), "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 5:
                    break
        assert _wait(lambda: len(engine.aborted) == 1)
        assert _wait(lambda: engine.stats().num_running == 0)
    # streamed, client gives up during a long prefill (only the role chunk has arrived)
    with make_server(engine_kw={"prefill_s": 30}, keepalive_s=0.05) as (url, engine, _):
        body = {"model": MODEL, "messages": _msgs("Hi"), "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith(": keep-alive"):
                    break
        assert _wait(lambda: len(engine.aborted) == 1)
        assert engine.stats().num_running == 0
    # non-streamed, client gives up during a long prefill
    with make_server(engine_kw={"prefill_s": 30}) as (url, engine, _):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": _msgs("Hi")}, timeout=0.5)
        assert _wait(lambda: len(engine.aborted) == 1)
        assert engine.stats().num_running == 0
        metrics = httpx.get(url + "/metrics").text
        assert 'tinyserve:requests_total{endpoint="chat",outcome="abort"} 1' in metrics


def test_n_choices_end_together(make_server):
    # a client that leaves aborts every choice; one choice failing ends the others
    with make_server(engine_kw={"tick_s": 0.01}) as (url, engine, _):
        body = {"model": MODEL, "messages": _msgs("LONG"), "stream": True, "n": 3}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
            for i, _line in enumerate(r.iter_lines()):
                if i > 8:
                    break
        assert _wait(lambda: len(engine.aborted) == 3)
        assert len(set(engine.aborted)) == 3
        assert _wait(lambda: engine.stats().num_running == 0)
    with make_server() as (url, engine, _):
        r = httpx.post(url + "/v1/chat/completions",
                       json={"model": MODEL, "messages": _msgs("Hi"), "n": 2})
        body = r.json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["completion_tokens"] == 2 * len(REASONING)
        lines = _raw_stream(url, {"model": MODEL, "messages": _msgs("ERROR"), "stream": True,
                                  "n": 2})
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert last["error"]["type"] == "server_error"
        assert _wait(lambda: engine.stats().num_running == 0)


def test_metrics(server):
    url, _, _ = server
    _client(url).chat.completions.create(model=MODEL, messages=_msgs("Hi"))
    text = httpx.get(url + "/metrics").text
    assert 'tinyserve:requests_total{endpoint="chat",outcome="stop"} 1' in text
    assert f"tinyserve:generation_tokens_total {len(REASONING)}" in text
    assert "tinyserve:time_to_first_token_seconds_count 1" in text
    assert f"tinyserve:inter_token_latency_seconds_count {len(REASONING) - 1}" in text
    assert "tinyserve:kv_pages_total 64" in text
    assert "tinyserve:num_requests_running 0" in text
    assert "tinyserve:gdn_state_slots_used 0" in text
    assert "tinyserve:gdn_state_slots_total 64" in text
    assert "# TYPE tinyserve:preemptions_total counter\ntinyserve:preemptions_total 0" in text


def test_engine_side_abort_is_503(make_server):
    with make_server(engine_kw={"prefill_s": 30}) as (url, engine, _):
        result = {}

        def call() -> None:
            result["r"] = httpx.post(url + "/v1/chat/completions", timeout=30,
                                     json={"model": MODEL, "messages": _msgs("Hi")})

        t = threading.Thread(target=call)
        t.start()
        assert _wait(lambda: engine.stats().num_running == 1)
        engine.abort(next(iter(engine._active)))  # as the engine does when it shuts down
        t.join(10)
        _err(result["r"], 503)


def test_always_include_usage(make_server):
    with make_server(always_include_usage=True) as (url, _, _):
        chunks = list(_client(url).chat.completions.create(model=MODEL, messages=_msgs("Hi"),
                                                           stream=True))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(REASONING)
    with make_server() as (url, _, _):
        chunks = list(_client(url).chat.completions.create(model=MODEL, messages=_msgs("Hi"),
                                                           stream=True))
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert all(c.usage is None for c in chunks)


def test_what_openai_accepts_is_accepted(server):
    url, engine, _ = server
    post = lambda path, body: httpx.post(url + path, json={"model": MODEL, **body})  # noqa: E731
    echoed = {"role": "assistant", "content": None, "refusal": None, "annotations": [],
              "audio": None, "function_call": None, "tool_calls": [
                  {"id": "call_1", "index": 0, "type": "function",
                   "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    body = {"messages": [*_msgs("Hi"), echoed, {"role": "tool", "tool_call_id": "call_1",
                                                "content": "18C"}, *_msgs("thanks")],
            "temperature": 1, "top_p": 0, "user": "u1", "metadata": {"k": "v"}, "store": False,
            "service_tier": "auto", "prompt_cache_key": "x", "safety_identifier": "s",
            "audio": None, "functions": None, "function_call": None, "min_tokens": 0,
            "parallel_tool_calls": None, "response_format": {"type": "text"},
            "modalities": ["text"], "stream_options": None}
    r = post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    p = engine.submitted[-1][1]
    assert (p.temperature, p.top_p) == (0.0, 1.0)  # top_p 0: only the most likely token
    # /v1/completions: max_tokens null is as omitted (16); response_format as on chat
    for extra in ({}, {"max_tokens": None}):
        r = post("/v1/completions", {"prompt": "LONG", **extra})
        assert r.status_code == 200 and engine.submitted[-1][1].max_tokens == 16, r.text
    r = post("/v1/completions", {"prompt": "x", "response_format": {"type": "text"}})
    assert r.status_code == 200, r.text
    for path, extra in (("/v1/completions", {"prompt": "x"}),
                        ("/v1/chat/completions", {"messages": _msgs("x")})):
        err = _err(post(path, {**extra, "response_format": {"type": "json_object"}}), 400,
                   "response_format")
        assert "not supported" in err["message"]
    err = _err(post("/v1/completions", {"prompt": "x", "frobnicate": 1}), 400, "frobnicate")
    assert err["message"] == "unrecognized request argument: frobnicate"


def test_openapi_schema_is_served_and_says_what_the_server_answers(make_server):
    with make_server(api_key="sekret") as (url, _, _):
        assert httpx.get(url + "/openapi.json").status_code == 401
        r = httpx.get(url + "/openapi.json", headers={"Authorization": "Bearer sekret"})
        assert r.status_code == 200
        schema = r.json()
    assert "422" not in json.dumps(schema["paths"])
    assert "HTTPValidationError" not in json.dumps(schema)
    err = schema["components"]["schemas"]["ErrorResponse"]
    assert err["properties"]["error"]["required"] == ["message", "type", "param", "code"]
    for path in ("/v1/chat/completions", "/v1/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert {"200", "400", "401", "404", "413", "503"} <= set(responses), path
        for status in ("400", "401", "404", "413", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref.endswith("/ErrorResponse")
        assert "text/event-stream" in responses["200"]["content"]
        body = schema["paths"][path]["post"]["requestBody"]["content"]
        name = body["application/json"]["schema"]["$ref"].rsplit("/", 1)[1]
        model = schema["components"]["schemas"][name]
        assert model["additionalProperties"] is False  # unknown fields are refused
        temperature = model["properties"]["temperature"]["anyOf"][0]
        assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert schema["security"] == [{"bearer": []}, {"apiKey": []}]  # either header
    assert schema["paths"]["/health"]["get"]["security"] == []

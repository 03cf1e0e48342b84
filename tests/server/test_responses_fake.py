"""/v1/responses against a scripted engine, the official `openai` SDK as the client: events,
stream == body, items in and out (reasoning coming back), forced calls, errors."""

from __future__ import annotations

import functools
import json

import httpx
import openai
import pytest

from tests.server.fakes import REASONING, TOOL_REPLY, agent_script, scripted_server
from tinyserve.server.responses_events import decode_reasoning, encode_reasoning

MODEL = "tiny-test"
TOOLS = [{"type": "function", "name": "get_weather", "description": "Get weather",
          "parameters": {"type": "object", "properties": {
              "city": {"type": "string"}, "days": {"type": "integer"}}}}]


@pytest.fixture
def make_server(qwen_tokenizer):
    return functools.partial(scripted_server, qwen_tokenizer, agent_script(qwen_tokenizer), MODEL)


@pytest.fixture
def server(make_server):
    with make_server() as s:
        yield s


def _client(url: str, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=30)


def test_text_stream_equals_body(server):
    url, engine, _ = server
    client = _client(url)
    r = client.responses.create(model=MODEL, input="Hi", instructions="Be brief.")
    assert r.status == "completed" and r.output_text == "Hello world!"
    assert [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == "Let me think." and r.output[0].encrypted_content is None
    assert r.usage.input_tokens == len(engine.submitted[-1][0])
    assert r.usage.output_tokens == len(REASONING)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
    with client.responses.stream(model=MODEL, input="Hi", instructions="Be brief.") as stream:
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert "response.reasoning_text.delta" in types and "response.output_text.done" in types
    skip = {"id", "created_at", "output"}
    assert final.model_dump(exclude=skip) == r.model_dump(exclude=skip)
    assert [(i.type, i.status) for i in final.output] == [(i.type, i.status) for i in r.output]
    assert final.output_text == r.output_text


def test_raw_events_are_named_and_numbered(server):
    url, _, _ = server
    events = []
    with httpx.stream("POST", url + "/v1/responses", timeout=30, json={
            "model": MODEL, "input": "TOOL", "tools": TOOLS, "stream": True}) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name
                events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
    assert added == ["reasoning", "function_call"]
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(done[0]["arguments"]) == {"city": "Paris", "days": 3}
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["output_tokens"] == len(TOOL_REPLY)


def test_multi_turn_tool_conversation_items(server, qwen_tokenizer):
    url, engine, _ = server
    client = _client(url)
    kw = dict(model=MODEL, tools=TOOLS, include=["reasoning.encrypted_content"], store=False)
    first = client.responses.create(input=[{"role": "user", "content": "TOOL"}], **kw)
    reasoning, call = first.output
    assert call.type == "function_call" and call.call_id.startswith("call_")
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris", "days": 3})
    assert decode_reasoning(reasoning.model_dump()) == "Checking."
    # what Codex sends back: the reasoning item without its text content, the call, the output
    back = reasoning.model_dump(exclude_none=True, exclude={"content", "id", "status"})
    second = client.responses.create(input=[
        {"role": "developer", "content": "Use tools."},
        {"role": "user", "content": [{"type": "input_text", "text": "TOOL"}]},
        back, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}], **kw)
    assert second.output_text == "Hello world!"
    prompt = qwen_tokenizer.decode(engine.submitted[-1][0])
    assert "Use tools.<|im_end|>" in prompt
    assert "<think>\nChecking.\n</think>\n\n<tool_call>\n<function=get_weather>" in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_forced_call(server, qwen_tokenizer):
    url, engine, _ = server
    r = _client(url).responses.create(model=MODEL, input="Hi", tools=TOOLS,
                                      tool_choice={"type": "function", "name": "get_weather"})
    assert qwen_tokenizer.decode(engine.submitted[-1][0]).endswith(
        "<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n")
    (call,) = r.output
    assert json.loads(call.arguments) == {"city": "Oslo"}


def test_effort_none_and_max_output_tokens(server, qwen_tokenizer):
    url, engine, _ = server
    r = _client(url).responses.create(model=MODEL, input="Hi", reasoning={"effort": "none"},
                                      max_output_tokens=3)
    assert qwen_tokenizer.decode(engine.submitted[-1][0]).endswith("<think>\n\n</think>\n\n")
    assert engine.submitted[-1][1].max_tokens == 3
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_encrypted_reasoning_round_trip():
    text = "step 1\nstep 2 — ünïcode"
    assert decode_reasoning({"encrypted_content": encode_reasoning(text)}) == text
    assert decode_reasoning({"encrypted_content": "gAAAA-foreign",
                             "summary": [{"type": "summary_text", "text": "s"}]}) == "s"


BAD = {
    "previous_response_id": ({"previous_response_id": "resp_1"}, "previous_response_id"),
    "store": ({"store": True}, "store"),
    "builtin_tool": ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    "custom_tool": ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools[0].type"),
    "image": ({"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    "item_reference": ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    "json_schema": ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {}}}},
                    "text.format"),
    "include": ({"include": ["message.output_text.logprobs"]}, "include[0]"),
    "background": ({"background": True}, "background"),
    "tool_choice": ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
                    "tool_choice"),
    "max_output_tokens": ({"max_output_tokens": 10**7}, "max_output_tokens"),
    "no_input": ({"input": []}, "input"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_unsupported_is_a_400_naming_it(server, name):
    url, engine, _ = server
    extra, param = BAD[name]
    r = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "Hi", **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == \
        "invalid_request_error"
    assert not engine.submitted


def test_failure_and_auth(make_server):
    with make_server(api_key="k") as (url, _, _):
        with pytest.raises(openai.AuthenticationError):
            _client(url, "bad").responses.create(model=MODEL, input="Hi")
        with pytest.raises(openai.NotFoundError):
            _client(url, "k").responses.create(model="gpt-5", input="Hi")
        events = list(_client(url, "k").responses.create(model=MODEL, input="ERROR",
                                                         stream=True))
        assert events[-1].type == "response.failed"
        assert "device lost" in events[-1].response.error.message

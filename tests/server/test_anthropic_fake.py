"""/v1/messages against a scripted engine, the official `anthropic` SDK as the client: event
order, stream == body, translation of multi-turn tool conversations, errors, auth."""

from __future__ import annotations

import functools
import json

import httpx
import pytest

from tests.server.fakes import REASONING, TOOL_REPLY, agent_script, scripted_server
from tinyserve.server.anthropic_api import MessagesRequest, to_chat_request

anthropic = pytest.importorskip("anthropic")

MODEL = "tiny-test"
TOOLS = [{"name": "get_weather", "description": "Get weather", "input_schema": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}]
@pytest.fixture
def make_server(qwen_tokenizer):
    return functools.partial(scripted_server, qwen_tokenizer, agent_script(qwen_tokenizer), MODEL)


@pytest.fixture
def server(make_server):
    with make_server() as s:
        yield s


def _client(url: str, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=kw.pop("api_key", "x"), max_retries=0,
                               timeout=30, **kw)


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _events(url: str, body: dict) -> list[tuple[str, dict]]:
    """The raw SSE events of a streamed request: (event name, data)."""
    out = []
    with httpx.stream("POST", url + "/v1/messages", json={**body, "stream": True},
                      timeout=30) as r:
        assert r.status_code == 200
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
                assert data["type"] == name  # every event is named by its type
                out.append((name, data))
    return out


def test_text_stream_equals_body(server):
    url, engine, _ = server
    client = _client(url)
    kw = dict(model=MODEL, max_tokens=64, messages=_user("Hi"))
    msg = client.messages.create(**kw)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == "Let me think." and msg.content[0].signature
    assert msg.content[1].text == "Hello world!"
    assert msg.stop_reason == "end_turn" and msg.stop_sequence is None
    assert msg.id.startswith("msg_") and msg.model == MODEL and msg.role == "assistant"
    prompt_len = len(engine.submitted[-1][0])
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == prompt_len
    assert msg.usage.output_tokens == len(REASONING)
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == msg.model_dump(exclude={"id"})
    assert client.messages.count_tokens(model=MODEL, messages=_user("Hi")).input_tokens == \
        prompt_len


def test_event_sequence_as_anthropic_sends_it(server):
    url, _, _ = server
    events = _events(url, {"model": MODEL, "max_tokens": 64, "messages": _user("TOOL"),
                           "tools": TOOLS})
    names = [n for n, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 0 and start["usage"]["output_tokens"] == 0
    blocks = [d for n, d in events if n == "content_block_start"]
    assert [b["content_block"]["type"] for b in blocks] == ["thinking", "tool_use"]
    assert [b["index"] for b in blocks] == [0, 1]
    assert blocks[1]["content_block"]["id"].startswith("toolu_")
    assert blocks[1]["content_block"]["input"] == {}
    kinds = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert kinds.index("signature_delta") < kinds.index("input_json_delta")
    stops = [i for i, n in enumerate(names) if n == "content_block_stop"]
    assert len(stops) == 2 and names[stops[0] - 1] == "content_block_delta"
    partial = "".join(d["delta"].get("partial_json", "") for n, d in events
                      if n == "content_block_delta" and d["index"] == 1)
    assert json.loads(partial) == {"city": "Paris", "days": 3}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(TOOL_REPLY)


def test_tool_use_and_multi_turn_translation(server, qwen_tokenizer):
    url, engine, _ = server
    client = _client(url)
    first = client.messages.create(model=MODEL, max_tokens=64, messages=_user("TOOL"),
                                   tools=TOOLS)
    (use,) = [b for b in first.content if b.type == "tool_use"]
    assert (use.name, use.input, first.stop_reason) == ("get_weather",
                                                        {"city": "Paris", "days": 3}, "tool_use")
    messages = _user("TOOL") + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in first.content]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
            {"type": "text", "text": "Be brief."}]}]
    second = client.messages.create(model=MODEL, max_tokens=64, messages=messages,
                                    tools=TOOLS, system=[{"type": "text", "text": "Be nice."}])
    assert second.stop_reason == "end_turn" and second.content[-1].text == "Hello world!"
    prompt = qwen_tokenizer.decode(engine.submitted[-1][0])
    assert "Be nice.<|im_end|>" in prompt
    assert ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call><|im_end|>") in prompt
    assert "<tool_response>\nsunny, 21 C\n</tool_response><|im_end|>" in prompt
    assert "<|im_start|>user\nBe brief.<|im_end|>" in prompt


def test_preserve_thinking_passed_to_the_template():
    req = MessagesRequest(model="m", max_tokens=5, messages=[
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "t1", "signature": "s"},
                                          {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"}], thinking={"type": "disabled"})
    chat, prefix = to_chat_request(req)
    assert chat.template_kwargs() == {"preserve_thinking": True, "enable_thinking": False}
    assert chat.messages[1].reasoning_content == "t1" and prefix == ""
    req = MessagesRequest(model="m", max_tokens=5, messages=_user("a"),
                          chat_template_kwargs={"preserve_thinking": False})
    assert to_chat_request(req)[0].template_kwargs() == {"preserve_thinking": False}


def test_tool_choice_forces_the_call(server, qwen_tokenizer):
    url, engine, _ = server
    client = _client(url)
    msg = client.messages.create(model=MODEL, max_tokens=64, messages=_user("Hi"), tools=TOOLS,
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert qwen_tokenizer.decode(engine.submitted[-1][0]).endswith(
        "assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=get_weather>\n")
    assert [(b.type, b.input) for b in msg.content] == [("tool_use", {"city": "Oslo"})]
    assert msg.stop_reason == "tool_use"
    client.messages.create(model=MODEL, max_tokens=64, messages=_user("Hi"), tools=TOOLS,
                           tool_choice={"type": "any"})  # one tool: named like "tool"
    assert qwen_tokenizer.decode(engine.submitted[-1][0]).endswith("<function=get_weather>\n")
    client.messages.create(model=MODEL, max_tokens=64, messages=_user("Hi"), tools=TOOLS,
                           tool_choice={"type": "none"})
    prompt = qwen_tokenizer.decode(engine.submitted[-1][0])
    assert "<tools>" not in prompt and prompt.endswith("<think>\n")


def test_prefill_continues_the_answer(server, qwen_tokenizer):
    url, engine, _ = server
    msg = _client(url).messages.create(model=MODEL, max_tokens=64, messages=_user("Hi") + [
        {"role": "assistant", "content": "The answer is"}])
    assert qwen_tokenizer.decode(engine.submitted[-1][0]).endswith(
        "<think>\n\n</think>\n\nThe answer is")
    # the continuation only (here the script's whole text, read as an answer)
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text.startswith("Let me think.")


def test_length_and_context_window(make_server):
    with make_server(engine_kw={"max_context": 300}) as (url, engine, _):
        client = _client(url)
        msg = client.messages.create(model=MODEL, max_tokens=5, messages=_user("LONG"))
        assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 5
        # beyond the context's room: cut to it, and the stop says why
        msg = client.messages.create(model=MODEL, max_tokens=100_000, messages=_user("LONG"))
        room = engine.max_context - len(engine.submitted[-1][0])
        assert engine.submitted[-1][1].max_tokens == room
        assert msg.stop_reason == "model_context_window_exceeded"
        with pytest.raises(anthropic.BadRequestError) as exc:
            client.messages.create(model=MODEL, max_tokens=5, messages=_user("x " * 700))
        assert exc.value.body["error"]["message"].startswith("prompt is too long: ")
        assert "> 299 maximum" in exc.value.body["error"]["message"]


BAD = {
    "no_max_tokens": ({"max_tokens": None}, "max_tokens"),
    "max_tokens_zero": ({"max_tokens": 0}, "max_tokens"),
    "temperature_range": ({"temperature": 1.5}, "temperature"),
    "image": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]}, "image"),
    "server_tool": ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
                    "web_search_20250305"),
    "tool_choice_unknown": ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "x"}},
                            "'x'"),
    "tool_choice_type": ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    "thinking_budget": ({"thinking": {"type": "enabled", "budget_tokens": 10}}, "1024"),
    "mcp": ({"mcp_servers": [{"type": "url", "url": "x", "name": "y"}]}, "mcp_servers"),
    "prefill_space": ({"messages": _user("Hi") + [{"role": "assistant", "content": "a "}]},
                      "trailing whitespace"),
    "bad_role": ({"messages": [{"role": "system", "content": "x"}]}, "role"),
    "empty": ({"messages": []}, "messages"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_requests_are_anthropic_400s(server, name):
    url, engine, _ = server
    extra, needle = BAD[name]
    body = {"model": MODEL, "max_tokens": 16, "messages": _user("Hi"), **extra}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(url + "/v1/messages", json=body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert needle in err["error"]["message"]
    assert not engine.submitted


def test_error_shapes_and_auth(make_server):
    with make_server(api_key="k1") as (url, engine, _):
        for headers in ({"x-api-key": "k1"}, {"authorization": "Bearer k1"}):
            r = httpx.post(url + "/v1/messages?beta=true", headers=headers, json={
                "model": MODEL, "max_tokens": 8, "messages": _user("Hi")})
            assert r.status_code == 200 and r.json()["type"] == "message"
        with pytest.raises(anthropic.AuthenticationError) as exc:
            _client(url, api_key="bad").messages.create(model=MODEL, max_tokens=8,
                                                        messages=_user("Hi"))
        assert exc.value.body["error"]["type"] == "authentication_error"
        bearer = anthropic.Anthropic(base_url=url, auth_token="k1", max_retries=0)
        assert bearer.messages.create(model=MODEL, max_tokens=8,
                                      messages=_user("Hi")).stop_reason == "max_tokens"
        client = _client(url, api_key="k1")
        with pytest.raises(anthropic.NotFoundError) as exc:
            client.messages.create(model="claude-x", max_tokens=8, messages=_user("Hi"))
        assert exc.value.body == {"type": "error", "error": {
            "type": "not_found_error", "message": exc.value.body["error"]["message"]}}
        r = httpx.post(url + "/v1/messages", content=b"{bad", headers={"x-api-key": "k1"})
        assert r.status_code == 400 and r.json()["type"] == "error"
        # the OpenAI routes keep OpenAI's shape
        r = httpx.post(url + "/v1/chat/completions", json={"model": "claude-x"},
                       headers={"x-api-key": "bad"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_failure_after_the_stream_started(server):
    url, _, _ = server
    events = _events(url, {"model": MODEL, "max_tokens": 64, "messages": _user("ERROR")})
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"
    assert "device lost" in events[-1][1]["error"]["message"]
    with pytest.raises(anthropic.APIStatusError):
        with _client(url).messages.stream(model=MODEL, max_tokens=64,
                                          messages=_user("ERROR")) as stream:
            stream.get_final_message()


class _Template:
    """A tokenizer with another chat template (Qwen3.6's `preserve_thinking` gate)."""

    def __init__(self, tokenizer, template: str) -> None:
        self._tok, self.chat_template = tokenizer, template

    def apply_chat_template(self, messages, **kw):
        return self._tok.apply_chat_template(messages, chat_template=self.chat_template, **kw)

    def encode(self, text, **kw):
        return self._tok.encode(text, **kw)


def test_earlier_thinking_follows_the_templates_option(qwen_tokenizer):
    # Qwen3.6's template keeps every turn's thinking with preserve_thinking; the Anthropic
    # route asks for it by default, and a request's chat_template_kwargs turns it off
    from tinyserve.server.chat import render_chat

    gate = "{%- if loop.index0 > ns.last_query_index %}"
    assert gate in qwen_tokenizer.chat_template
    qwen36 = qwen_tokenizer.chat_template.replace(gate, (
        "{%- if (preserve_thinking is defined and preserve_thinking is true) or "
        "(loop.index0 > ns.last_query_index) %}"))
    messages = [{"role": "user", "content": "a"},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "EARLIER", "signature": "s"},
                    {"type": "text", "text": "b"}]},
                {"role": "user", "content": "c"}]
    for template, kwargs, kept in ((qwen36, None, True),
                                   (qwen36, {"preserve_thinking": False}, False),
                                   (qwen_tokenizer.chat_template, None, False)):
        tokenizer = _Template(qwen_tokenizer, template)
        chat, _ = to_chat_request(MessagesRequest(model="m", max_tokens=5, messages=messages,
                                                  chat_template_kwargs=kwargs))
        text = render_chat(tokenizer, chat).text
        assert ("<think>\nEARLIER\n</think>\n\nb<|im_end|>" in text) == kept

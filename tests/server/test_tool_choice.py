"""Forced tool calls: the preamble written into the prompt is the template's own rendering of a
tool-calling turn, and chat/completions reports the forced call like any other."""

from __future__ import annotations

import contextlib
import json

import httpx
import openai
import pytest

from tests.server.fakes import FakeEngine, serve
from tinyserve.server.app import create_app
from tinyserve.server.chat import render_chat
from tinyserve.server.errors import APIError
from tinyserve.server.protocol import ChatCompletionRequest
from tinyserve.server.responses import ChatAssembler
from tinyserve.server.state import ServerConfig, ServerState
from tinyserve.server.tool_choice import continuation, forced_function

MODEL = "tiny-test"
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}
    for n in ("get_weather", "get_time")]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.mark.parametrize("choice, tools, expected", [
    (None, TOOLS, None), ("auto", TOOLS, None), ("none", TOOLS, None),
    ("required", TOOLS, ""), ("required", TOOLS[:1], "get_weather"), (NAMED, TOOLS, "get_time"),
], ids=["unset", "auto", "none", "required", "required_one_tool", "named"])
def test_forced_function(choice, tools, expected):
    assert forced_function(choice, [t["function"]["name"] for t in tools]) == expected


@pytest.mark.parametrize("choice, tools", [
    ("required", None), (NAMED, TOOLS[:1]), ("always", TOOLS),
    ({"type": "function", "name": "get_time"}, TOOLS),
], ids=["required_no_tools", "named_unknown", "bad_string", "responses_form"])
def test_forced_function_refuses(choice, tools):
    with pytest.raises(APIError) as exc:
        forced_function(choice, [t["function"]["name"] for t in tools or ()])
    assert exc.value.status == 400 and exc.value.param == "tool_choice"


def test_continuation_forms():
    assert continuation(True) == ("", "")
    assert continuation(False, forced="f") == ("<tool_call>\n<function=f>\n",
                                               "<tool_call>\n<function=f>\n")
    suffix, prefill = continuation(True, forced="")
    assert suffix == "\n</think>\n\n<tool_call>\n<function=" and prefill == suffix[11:]
    suffix, prefill = continuation(True, "Sure.", forced="f")
    assert suffix == "\n</think>\n\nSure.\n\n<tool_call>\n<function=f>\n"
    assert prefill == "<tool_call>\n<function=f>\n"
    assert continuation(True, "The answer is") == ("\n</think>\n\nThe answer is", "")


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no_thinking"])
def test_preamble_is_the_templates_tool_call_turn(qwen_tokenizer, thinking):
    # the forced prompt is the template's rendering of a turn that calls the tool, cut after
    # the function name: the model continues a form it was trained on
    kw = {"chat_template_kwargs": {"enable_thinking": thinking}}
    req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Weather?"}],
                                tools=TOOLS, **kw)
    prompt = render_chat(qwen_tokenizer, req)
    suffix, _ = continuation(prompt.reasoning_open, forced="get_weather")
    history = ChatCompletionRequest(model="m", tools=TOOLS, **kw, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [
            {"id": "c", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "sunny"}])
    turn = render_chat(qwen_tokenizer, history).text
    forced = prompt.text + suffix
    assert turn.startswith(forced) and forced.endswith("<function=get_weather>\n")
    assert turn[len(forced):].startswith("<parameter=city>\nParis\n</parameter>\n</function>")


def test_assembler_reads_the_prefill_first():
    asm = ChatAssembler(reasoning_open=False, tools=TOOLS, prefill="<tool_call>\n<function=")
    deltas = asm.feed("get_time>\n<parameter=city>\nOslo\n</parameter>\n")
    deltas += asm.finish()
    assert asm.tool_calls[0]["function"]["name"] == "get_time"
    assert json.loads(asm.tool_calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert asm.finish_reason("stop") == "tool_calls" and asm.content == ""
    assert deltas[0]["tool_calls"][0]["function"]["name"] == "get_time"
    # nothing generated at all: the preamble alone still yields the (empty) call
    asm = ChatAssembler(reasoning_open=False, tools=TOOLS, prefill="<tool_call>\n<function=f>\n")
    asm.finish()
    assert [c["function"] for c in asm.tool_calls] == [{"name": "f", "arguments": "{}"}]


def _script(tokenizer):
    def script(prompt_ids, params):
        text = tokenizer.decode(prompt_ids)
        if text.endswith("<function=get_time>\n"):
            return ["<parameter=city>\n", "Oslo\n</parameter>\n", "</function>\n</tool_call>"]
        if text.endswith("<function="):
            return ["get_weather>\n<parameter=days>\n", "2\n</parameter>\n</function>\n",
                    "</tool_call>"]
        return ["Hel", "lo"]
    return script


@pytest.fixture
def server(qwen_tokenizer):
    engine = FakeEngine(qwen_tokenizer, _script(qwen_tokenizer))
    state = ServerState(ServerConfig(served_model_name=MODEL), engine)
    try:
        with serve(create_app(state)) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.mark.parametrize("choice, name, args", [
    (NAMED, "get_time", {"city": "Oslo"}), ("required", "get_weather", {"days": 2}),
], ids=["named", "required"])
def test_chat_completions_forced_call(server, qwen_tokenizer, choice, name, args):
    url, engine = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Hi"}], tools=TOOLS,
              tool_choice=choice)
    r = client.chat.completions.create(**kw)
    prompt = qwen_tokenizer.decode(engine.submitted[-1][0])
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n"
                           "<function=" + (f"{name}>\n" if choice == NAMED else ""))
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (name, args)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    chunks = list(client.chat.completions.create(**kw, stream=True))
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == name
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == args
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with contextlib.suppress(openai.BadRequestError):  # a plain request is not forced
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert qwen_tokenizer.decode(engine.submitted[-1][0]).endswith("assistant\n<think>\n")


def test_forced_call_errors(server):
    url, engine = server
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": TOOLS}
    r = httpx.post(url + "/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "nope" in r.json()["error"]["message"] and not engine.submitted

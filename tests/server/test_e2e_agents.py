"""Acceptance for coding-agent clients: the real engine on a tiny CPU checkpoint behind uvicorn,
the official `anthropic` and `openai` SDKs as clients, a scripted multi-turn tool conversation
on each API (the logits are forced, as in test_e2e), streamed and not; usage, stop sequences,
errors and auth."""

from __future__ import annotations

import json

import pytest
import torch

from tests.server.fakes import serve
from tinyserve.server.app import create_app
from tinyserve.server.state import ServerConfig, ServerState

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

MODEL = "tiny"
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CALL = ("The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
        "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>")
ANSWER = "The tool said sunny.\n</think>\n\nIt is sunny in Paris."
FORCED = "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def live(tiny_checkpoint):
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    ckpt = tiny_checkpoint(max_position_embeddings=2048)
    engine = build_engine(EngineConfig(model=str(ckpt), device="cpu", max_context=1024,
                                       max_seqs=4, max_num_batched_tokens=512)).start()
    state = ServerState(ServerConfig(served_model_name=MODEL, api_key="k1"), engine)
    try:
        with serve(create_app(state)) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture
def prompts(live):
    """Script the model: a prompt that ends in a forced call's preamble gets its parameters,
    one with a tool response the answer, any other the call; records every prompt's text."""
    _, engine = live
    tok = engine.tokenizer
    scripts = {k: tok.encode(v, add_special_tokens=False)
               for k, v in (("call", CALL), ("answer", ANSWER), ("forced", FORCED))}
    response, end = tok.convert_tokens_to_ids("<tool_response>"), tok.convert_tokens_to_ids(
        "<|im_end|>")
    seen: list[str] = []

    def hook(logits: torch.Tensor, seqs) -> torch.Tensor:
        forced = torch.full_like(logits, -1e9)
        for row, seq in enumerate(seqs):
            prompt = seq.history[:len(seq.history) - seq.num_generated]
            if seq.num_generated == 0:
                seen.append(tok.decode(prompt))
            if tok.decode(prompt[-8:]).endswith("<function=get_weather>\n"):
                ids = scripts["forced"]
            else:
                ids = scripts["answer" if response in prompt else "call"]
            n = seq.num_generated
            forced[row, ids[n] if n < len(ids) else end] = 0
        return forced

    engine.set_logits_hook(hook)
    yield seen
    engine.set_logits_hook(None)


def _tokens(engine, text: str) -> int:
    return len(engine.tokenizer.encode(text, add_special_tokens=False))


def test_messages_tool_conversation(live, prompts):
    url, engine = live
    client = anthropic.Anthropic(base_url=url, api_key="k1", max_retries=0, timeout=60)
    tools = [{"name": "get_weather", "description": "Get the weather", "input_schema": PARAMS}]
    kw = dict(model=MODEL, max_tokens=200, tools=tools, system="You are terse.",
              messages=[{"role": "user", "content": "Weather in Paris?"}])
    first = client.messages.create(**kw)
    thinking, use = first.content
    assert thinking.thinking == "The user wants the weather." and first.stop_reason == "tool_use"
    assert (use.name, use.input) == ("get_weather", {"city": "Paris"})
    assert first.usage.output_tokens == _tokens(engine, CALL) + 1  # + <|im_end|>
    counted = client.messages.count_tokens(model=MODEL, tools=tools, system="You are terse.",
                                           messages=kw["messages"]).input_tokens
    assert first.usage.input_tokens + first.usage.cache_read_input_tokens == counted
    with client.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[1].input == use.input
    # NOTE: the second request may reuse the first one's prompt from the prefix cache
    assert streamed.usage.output_tokens == first.usage.output_tokens
    assert streamed.usage.input_tokens + streamed.usage.cache_read_input_tokens == counted
    turn2 = kw["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                          for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "sunny"}]}]}]
    second = client.messages.create(**{**kw, "messages": turn2})
    assert second.content[-1].text == "It is sunny in Paris." and second.stop_reason == "end_turn"
    # the first turn's thinking is back in the prompt (the current tool loop)
    assert "<think>\nThe user wants the weather.\n</think>" in prompts[-1]
    stopped = client.messages.create(**{**kw, "messages": turn2, "stop_sequences": ["Paris"]})
    assert stopped.content[-1].text == "It is sunny in"
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "Paris")
    assert engine.stats().running == 0


def test_responses_tool_conversation(live, prompts):
    url, engine = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=60)
    tools = [{"type": "function", "name": "get_weather", "parameters": PARAMS}]
    kw = dict(model=MODEL, tools=tools, instructions="You are terse.", store=False,
              include=["reasoning.encrypted_content"])
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.responses.create(input=ask, **kw)
    reasoning, call = first.output
    assert reasoning.content[0].text == "The user wants the weather."
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    assert first.usage.output_tokens == _tokens(engine, CALL) + 1
    assert first.usage.input_tokens == len(engine.tokenizer.encode(prompts[-1]))
    with client.responses.stream(input=ask, **kw) as stream:
        streamed = stream.get_final_response()
    assert [i.type for i in streamed.output] == ["reasoning", "function_call"]
    assert streamed.output[1].arguments == call.arguments
    assert streamed.usage.output_tokens == first.usage.output_tokens
    # as Codex sends it back: reasoning without its text (encrypted_content carries it)
    back = [reasoning.model_dump(exclude_none=True, exclude={"content", "id", "status"}),
            call.model_dump(exclude_none=True, exclude={"id", "status"}),
            {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    second = client.responses.create(input=ask + back, **kw)
    assert second.output_text == "It is sunny in Paris." and second.status == "completed"
    assert "<think>\nThe user wants the weather.\n</think>" in prompts[-1]
    assert engine.stats().running == 0


def test_chat_forced_tool_conversation(live, prompts):
    url, engine = live
    client = openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0, timeout=60)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                           tool_choice=choice, max_tokens=100)
        assert prompts[-1].endswith("<think>\n\n</think>\n\n<tool_call>\n"
                                    "<function=get_weather>\n")
        (call,) = r.choices[0].message.tool_calls
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert r.choices[0].finish_reason == "tool_calls"
        assert r.usage.completion_tokens == _tokens(engine, FORCED) + 1
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, tools=tools,
                                                 max_tokens=100, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == \
        "It is sunny in Paris."


def test_agent_api_errors_with_real_engine(live):
    url, engine = live
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="bad", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="bad", max_retries=0).responses.create(
            model=MODEL, input="x")
    with pytest.raises(anthropic.BadRequestError) as exc:
        anthropic.Anthropic(base_url=url, auth_token="k1", max_retries=0).messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "Paris " * 1200}])
    assert "prompt is too long" in exc.value.message and "1023 maximum" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        openai.OpenAI(base_url=url + "/v1", api_key="k1", max_retries=0).responses.create(
            model=MODEL, input="x", previous_response_id="resp_1")
    assert exc.value.body["param"] == "previous_response_id"
    assert engine.stats().running == 0

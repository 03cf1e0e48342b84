"""Chat rendering with the real Qwen3.5 tokenizer and template against test_vectors.json."""

from __future__ import annotations

import copy
import json

import pytest

from tinyserve.server.chat import ChatRenderer
from tinyserve.server.errors import APIError
from tinyserve.server.protocol import ChatCompletionRequest


@pytest.fixture(scope="module")
def vectors(shared_dir):
    return json.loads((shared_dir / "data" / "qwen35_tokenizer" / "test_vectors.json").read_text())


def _request(case: dict, *, string_args: bool) -> ChatCompletionRequest:
    messages = copy.deepcopy(case["messages"])
    if string_args:  # what OpenAI clients send: arguments as a JSON string
        for m in messages:
            for call in m.get("tool_calls") or []:
                call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    kw = {k: v for k, v in case["kwargs"].items() if k != "add_generation_prompt"}
    return ChatCompletionRequest(model="m", messages=messages, tools=case["tools"],
                                 chat_template_kwargs=kw or None)


@pytest.mark.parametrize("string_args", [False, True], ids=["dict_args", "json_args"])
def test_chat_vectors(qwen_tokenizer, vectors, string_args: bool) -> None:
    renderer = ChatRenderer(qwen_tokenizer)
    for case in vectors["chat"]:
        out = renderer.render(_request(case, string_args=string_args))
        assert out.text == case["text"], case["name"]
        assert out.ids == case["ids"], case["name"]
        assert out.reasoning_open == (case["kwargs"].get("enable_thinking") is not False)


def test_encode_vectors(qwen_tokenizer, vectors) -> None:
    for case in vectors["encode"]:
        assert qwen_tokenizer.encode(case["text"], add_special_tokens=False) == case["ids"]


def test_thinking_controls(qwen_tokenizer) -> None:
    renderer = ChatRenderer(qwen_tokenizer)
    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}
    assert renderer.render(ChatCompletionRequest(**base)).reasoning_open
    for extra in ({"thinking": {"type": "disabled"}}, {"reasoning_effort": "none"},
                  {"chat_template_kwargs": {"enable_thinking": False}}):
        out = renderer.render(ChatCompletionRequest(**base, **extra))
        assert not out.reasoning_open and out.text.endswith("<think>\n\n</think>\n\n"), extra


def test_developer_role_and_text_parts(qwen_tokenizer) -> None:
    renderer = ChatRenderer(qwen_tokenizer)
    req = ChatCompletionRequest(model="m", messages=[
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hello, "},
                                     {"type": "text", "text": "how are you?"}]}])
    text = renderer.render(req).text
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "<|im_start|>user\nHello, how are you?<|im_end|>" in text


def test_template_errors_are_400(qwen_tokenizer) -> None:
    renderer = ChatRenderer(qwen_tokenizer)
    bad = [[{"role": "assistant", "content": "only me"}],
           [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}],
           [{"role": "user", "content": "x"}, {"role": "assistant", "content": "",
             "tool_calls": [{"type": "function",
                             "function": {"name": "f", "arguments": "{oops"}}]}]]
    for messages in bad:
        with pytest.raises(APIError) as exc:
            renderer.render(ChatCompletionRequest(model="m", messages=messages))
        assert exc.value.status == 400

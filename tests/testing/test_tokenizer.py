"""The tiny tokenizer: loads offline through AutoTokenizer, round-trips text, keeps Qwen3.5's
special tokens as single ids, and its chat template renders like Qwen3.5's."""

from __future__ import annotations

import json

import pytest

from tinyserve.testing.tokenizer import (
    SPECIAL_TOKENS,
    TINY_VOCAB_SIZE,
    save_tiny_tokenizer,
    special_token_ids,
    tokenizer_json,
)

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]

CONVERSATIONS = {
    "plain": ([{"role": "user", "content": "Hello, how are you?"}], None),
    "system": ([{"role": "system", "content": " Be brief. "},
                {"role": "user", "content": "Hi"}], None),
    "multi_turn_reasoning": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "simple sum"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "<think>\nadd\n</think>\n\n6"},
    ], None),
    "tools": ([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "Let me check.", "reasoning_content": "Need the tool.",
         "tool_calls": [{"type": "function", "function": {
             "name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}},
             {"type": "function", "function": {"name": "get_weather",
                                               "arguments": {"city": "Nice"}}}]},
        {"role": "tool", "content": "{\"temp\": 18}"},
        {"role": "tool", "content": "{\"temp\": 21}"},
    ], TOOLS),
    "content_parts": ([{"role": "user", "content": [{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]}], None),
}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tok")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def test_vocab_fits_and_specials_are_last():
    ids = special_token_ids()
    assert list(ids) == list(SPECIAL_TOKENS)
    assert sorted(ids.values()) == list(range(TINY_VOCAB_SIZE - len(SPECIAL_TOKENS),
                                              TINY_VOCAB_SIZE))
    assert len(json.loads(tokenizer_json())["model"]["vocab"]) + len(ids) == TINY_VOCAB_SIZE


def test_training_is_deterministic():
    assert tokenizer_json.__wrapped__() == tokenizer_json()


def test_autotokenizer_offline(tok):
    assert len(tok) == TINY_VOCAB_SIZE
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == special_token_ids()["<|im_end|>"]
    assert tok.pad_token == "<|endoftext|>"


@pytest.mark.parametrize("text", [
    "Hello, how are you?", "  leading and trailing  ", "line1\nline2\n\n\tend",
    "你好，世界 🤖 émoji Привет", "def f(x):\n    return x ** 2", "",
], ids=["ascii", "spaces", "newlines", "unicode", "code", "empty"])
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert all(0 <= i < TINY_VOCAB_SIZE for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids(tok):
    ids = special_token_ids()
    for t in SPECIAL_TOKENS:
        assert tok.encode(t, add_special_tokens=False) == [ids[t]]
    text = "<think>\nhmm\n</think>\n\n<tool_call>x</tool_call><|im_end|>"
    enc = tok.encode(text, add_special_tokens=False)
    assert tok.decode(enc) == text
    # think and tool tags survive skip_special_tokens, the chat markers do not
    kept = tok.decode(enc, skip_special_tokens=True)
    assert kept == "<think>\nhmm\n</think>\n\n<tool_call>x</tool_call>"


def test_generation_prompts(tok):
    msgs = [{"role": "user", "content": "Hi"}]
    on = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True,
                                  enable_thinking=False)
    assert on == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert off == ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
                   "<think>\n\n</think>\n\n")


def test_matches_qwen35_test_vectors(tok, shared_dir):
    vectors = json.loads((shared_dir / "data/qwen35_tokenizer/test_vectors.json").read_text())
    for case in vectors["chat"]:
        got = tok.apply_chat_template(case["messages"], tools=case["tools"], tokenize=False,
                                      **case["kwargs"])
        assert got == case["text"], case["name"]


@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("thinking", [None, False], ids=["default", "no_think"])
def test_renders_like_qwen35_template(tok, shared_dir, name, thinking):
    qwen = (shared_dir / "data/qwen35_tokenizer/chat_template.jinja").read_text()
    messages, tools = CONVERSATIONS[name]
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    for gen in (True, False):
        ours = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                       add_generation_prompt=gen, **kwargs)
        theirs = tok.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=gen, chat_template=qwen, **kwargs)
        assert ours == theirs


def test_template_errors(tok):
    with pytest.raises(Exception, match="No user query"):
        tok.apply_chat_template([{"role": "system", "content": "x"}], tokenize=False)
    with pytest.raises(Exception, match="System message must be at the beginning"):
        tok.apply_chat_template([{"role": "user", "content": "x"},
                                 {"role": "system", "content": "y"}], tokenize=False)

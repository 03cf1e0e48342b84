"""Reasoning splitter and Qwen3.5 XML tool-call parser on scripted text, fed in every split."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.server.reasoning import ReasoningParser, reasoning_open_in_prompt
from tinyserve.server.responses import ChatAssembler
from tinyserve.server.tool_parser import (
    ContentDelta,
    ToolCallArgs,
    ToolCallParser,
    ToolCallStart,
    convert_value,
)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
          "properties": {"s": {"type": "string"}, "i": {"type": "integer"},
                         "x": {"type": "number"}, "b": {"type": "boolean"},
                         "o": {"type": "object"}, "a": {"type": "array"},
                         "n": {"type": ["integer", "null"]}}}}}]


def _pieces(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 6)
        out.append(text[i:i + n])
        i += n
    return out


def _split_reasoning(text: str, open_: bool, seed: int) -> tuple[str, str]:
    p = ReasoningParser(open_)
    r = c = ""
    for piece in _pieces(text, seed):
        a, b = p.feed(piece)
        r, c = r + a, c + b
    a, b = p.finish()
    return r + a, c + b


REASONING_CASES = {
    "close_tag": ("I think.\n</think>\n\nAnswer.", True, ("I think.", "Answer.")),
    "thinking_off": ("Answer </think> kept", False, ("", "Answer </think> kept")),
    "old_template_open_tag": ("<think>\nhmm\n</think>\n\nok", False, ("hmm", "ok")),
    "tool_call_ends_reasoning": ("need it\n<tool_call>\nx", True, ("need it", "<tool_call>\nx")),
    "truncated": ("still thinking", True, ("still thinking", "")),
    "no_reasoning": ("</think>\n\nDirect.", True, ("", "Direct.")),
    "partial_tag_kept": ("a </thi", True, ("a </thi", "")),
    "lt_in_reasoning": ("1 < 2 and <b>\n</think>ok", True, ("1 < 2 and <b>", "ok")),
}


@pytest.mark.parametrize("name", sorted(REASONING_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reasoning_split(name: str, seed: int) -> None:
    text, open_, want = REASONING_CASES[name]
    assert _split_reasoning(text, open_, seed) == want


def test_reasoning_open_from_prompt() -> None:
    assert reasoning_open_in_prompt("<|im_start|>assistant\n<think>\n")
    assert not reasoning_open_in_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not reasoning_open_in_prompt("<|im_start|>user\nhi<|im_end|>\n")
    past = "<think>\nold\n</think>\n\nx<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert reasoning_open_in_prompt(past)


def _parse(text: str, seed: int, tools=TOOLS) -> tuple[str, list[tuple[str, dict]]]:
    p = ToolCallParser(tools)
    events = []
    for piece in _pieces(text, seed):
        events += p.feed(piece)
    events += p.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    names = {e.index: e.name for e in events if isinstance(e, ToolCallStart)}
    args: dict[int, str] = {}
    for e in events:
        if isinstance(e, ToolCallArgs):
            args[e.index] = args.get(e.index, "") + e.fragment
    assert sorted(args) == sorted(names)
    return content, [(names[i], json.loads(args[i])) for i in sorted(names)]


CALL = "<tool_call>\n<function=f>\n<parameter=s>\nParis\n</parameter>\n</function>\n</tool_call>"
TOOL_CASES = {
    "plain_text": ("Just text, no calls.", ("Just text, no calls.", [])),
    "one_call": (CALL, ("", [("f", {"s": "Paris"})])),
    "text_then_call": ("Let me look.\n\n" + CALL, ("Let me look.", [("f", {"s": "Paris"})])),
    "parallel": (CALL + "\n" + CALL.replace("Paris", "Rome"),
                 ("", [("f", {"s": "Paris"}), ("f", {"s": "Rome"})])),
    "inline_values": ("<tool_call><function=f><parameter=i>42</parameter><parameter=b>false"
                      "</parameter></function></tool_call>",
                      ("", [("f", {"i": 42, "b": False})])),
    "typed": ("<tool_call>\n<function=f>\n<parameter=x>\n2.5\n</parameter>\n<parameter=o>\n"
              '{"k": [1, 2]}\n</parameter>\n<parameter=a>\n[1, "two"]\n</parameter>\n'
              "<parameter=n>\nnull\n</parameter>\n<parameter=s>\n 12 \n</parameter>\n"
              "</function>\n</tool_call>",
              ("", [("f", {"x": 2.5, "o": {"k": [1, 2]}, "a": [1, "two"], "n": None,
                           "s": " 12 "})])),
    "multiline_value": ("<tool_call>\n<function=f>\n<parameter=s>\nline1\nline2\n</parameter>\n"
                        "</function>\n</tool_call>", ("", [("f", {"s": "line1\nline2"})])),
    "no_params": ("<tool_call>\n<function=f>\n</function>\n</tool_call>", ("", [("f", {})])),
    "unknown_function": ("<tool_call>\n<function=g>\n<parameter=k>\n7\n</parameter>\n"
                         "</function>\n</tool_call>", ("", [("g", {"k": "7"})])),
    "missing_param_close": ("<tool_call>\n<function=f>\n<parameter=s>\nA\n<parameter=i>\n3\n"
                            "</function>\n</tool_call>", ("", [("f", {"s": "A", "i": 3})])),
    "missing_tool_call_close": ("<tool_call>\n<function=f>\n<parameter=i>\n1\n</parameter>\n"
                                "</function>\nafter", ("\nafter", [("f", {"i": 1})])),
    "truncated_call": ("<tool_call>\n<function=f>\n<parameter=s>\nPar",
                       ("", [("f", {"s": "Par"})])),
    "garbage_block": ("x <tool_call> nothing here", ("x <tool_call> nothing here", [])),
    "block_without_function": ("a <tool_call>junk</tool_call> b",
                               ("a <tool_call>junk</tool_call> b", [])),
    "text_after_call": (CALL + "\n\nDone.", ("\n\nDone.", [("f", {"s": "Paris"})])),
    "lt_in_text": ("a < b <tool", ("a < b <tool", [])),
}


@pytest.mark.parametrize("name", sorted(TOOL_CASES))
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_tool_parser(name: str, seed: int) -> None:
    text, want = TOOL_CASES[name]
    assert _parse(text, seed) == want


def test_convert_value_falls_back_to_text() -> None:
    assert convert_value("abc", {"type": "integer"}) == "abc"
    assert convert_value("3", {"type": "number"}) == 3
    assert convert_value("{bad", {"type": "object"}) == "{bad"
    assert convert_value("7", None) == "7"
    assert convert_value("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 5


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(list("ab<>/=\n tolcfunip_")), max_size=80),
       st.integers(0, 10_000))
def test_tool_parser_never_loses_plain_text(text: str, seed: int) -> None:
    """Without a complete call, every non-whitespace character comes back as content."""
    p = ToolCallParser(TOOLS)
    events = []
    for piece in _pieces(text, seed):
        events += p.feed(piece)
    events += p.finish()
    if not any(isinstance(e, ToolCallStart) for e in events):
        content = "".join(e.text for e in events if isinstance(e, ContentDelta))
        assert content.split() == text.split() or "".join(content.split()) == "".join(
            text.split())


def test_assembler_parallel_tool_calls_false() -> None:
    a = ChatAssembler(reasoning_open=False, tools=TOOLS, parallel_tool_calls=False)
    deltas = a.feed(CALL + "\n" + CALL.replace("Paris", "Rome")) + a.finish()
    assert len(a.tool_calls) == 1 and json.loads(a.tool_calls[0]["function"]["arguments"]) == {
        "s": "Paris"}
    assert all(tc["index"] == 0 for d in deltas for tc in d.get("tool_calls", []))
    assert a.finish_reason("stop") == "tool_calls" and a.finish_reason("length") == "length"
    assert a.message()["content"] is None


def _strict_json(text: str):
    def refuse(token: str):
        raise AssertionError(f"{token} is not JSON")
    return json.loads(text, parse_constant=refuse)


# the model's parameter text, its schema, what the arguments carry (always strict JSON)
MODEL_OUTPUT = [
    ("{1, 2}", {"type": "object"}, "{1, 2}"),  # literal_eval: a set
    ("b'raw'", {"type": "array"}, "b'raw'"),  # literal_eval: bytes
    ("{(1, 2): 3}", {"type": "object"}, "{(1, 2): 3}"),  # a tuple key
    ("(1, 'a')", {"type": "array"}, [1, "a"]),  # a tuple is a JSON array
    ("inf", {"type": "number"}, "inf"),
    ("-Infinity", {"type": "number"}, "-Infinity"),
    ("nan", {"type": "number"}, "nan"),
    ("1e999", {"type": "number"}, "1e999"),
    ('{"x": NaN}', {"type": "object"}, '{"x": NaN}'),
    ("[Infinity]", {"type": "array"}, "[Infinity]"),
    ("1" * 5000, {"type": "integer"}, "1" * 5000),  # past Python's int-string digit limit
    ("1" * 5000, {"type": "number"}, "1" * 5000),
    ("[" * 5000 + "]" * 5000, {"type": "array"}, "[" * 5000 + "]" * 5000),
    ("12345678901234567890", {"type": "number"}, 12345678901234567890),
    ("3", {"anyOf": {"type": "integer"}}, "3"),  # anyOf not a list
    ("3", {"oneOf": 5}, "3"),
    ("3", {"anyOf": [{"anyOf": [{"type": "integer"}]}]}, 3),
    ("3", {"type": 7}, "3"),
]


@pytest.mark.parametrize("text,schema,want", MODEL_OUTPUT,
                         ids=[f"{i}-{t[:12]}" for i, (t, _, _) in enumerate(MODEL_OUTPUT)])
def test_tool_arguments_are_always_strict_json(text: str, schema, want) -> None:
    assert convert_value(text, schema) == want
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"p": schema}}}}]
    a = ChatAssembler(reasoning_open=False, tools=tools)
    a.feed(f"<tool_call>\n<function=f>\n<parameter=p>\n{text}\n</parameter>\n</function>\n"
           "</tool_call>")
    a.finish()
    (call,) = a.tool_calls
    assert _strict_json(call["function"]["arguments"]) == {"p": want}


def test_deeply_nested_any_of_is_bounded() -> None:
    schema: dict = {"type": "integer"}
    for _ in range(5000):
        schema = {"anyOf": [schema]}
    assert convert_value("3", schema) == "3"  # deeper than any real schema: text


def test_logprobs_are_finite_json() -> None:
    from tinyserve.core import TokenLogprobs
    from tinyserve.server.logprobs import chat_entries, completion_logprobs

    lps = [TokenLogprobs(5, float("-inf"), ((5, float("-inf")), (6, -1.5)))]
    text_of = lambda tid: (f"t{tid}", [tid])  # noqa: E731
    for obj in (chat_entries(text_of, lps), completion_logprobs(text_of, lps, 0)):
        text = json.dumps(obj, allow_nan=False)
        assert "-9999.0" in text

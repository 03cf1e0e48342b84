"""Acceptance: the real engine on a tiny CPU checkpoint behind uvicorn, the `openai` package as
the client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
import torch

from tests.server.fakes import serve
from tinyserve.server.app import create_app
from tinyserve.server.state import ServerConfig, ServerState

MODEL = "tiny"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]
SCRIPT = ("The user wants the weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
          "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
          "</function>\n</tool_call>")


@pytest.fixture(scope="module")
def live(tiny_checkpoint):
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    # The tools system prompt alone is ~650 tiny-tokenizer tokens: allow 2048 positions.
    ckpt = tiny_checkpoint(max_position_embeddings=2048)
    engine = build_engine(EngineConfig(model=str(ckpt), device="cpu", max_context=1024,
                                       max_seqs=16, max_num_batched_tokens=512)).start()
    state = ServerState(ServerConfig(served_model_name=MODEL, api_key="k1,k2"), engine)
    try:
        with serve(create_app(state)) as url:
            yield url, engine
    finally:
        engine.shutdown()


def _client(url: str, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def _msgs(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def _collect_stream(chunks) -> dict:
    out = {"content": "", "reasoning": "", "finish": None, "usage": None, "n": 0}
    for c in chunks:
        out["n"] += 1
        if c.usage is not None:
            out["usage"] = c.usage
        for ch in c.choices:
            extra = ch.delta.model_extra or {}
            out["content"] += ch.delta.content or ""
            out["reasoning"] += extra.get("reasoning_content") or ""
            out["finish"] = ch.finish_reason or out["finish"]
    return out


def test_chat_stream_equals_nonstream(live):
    url, engine = live
    client = _client(url)
    kw = dict(model=MODEL, messages=_msgs("Hello, how are you?"), temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kw)
    msg = full.choices[0].message
    got = _collect_stream(client.chat.completions.create(
        **kw, stream=True, stream_options={"include_usage": True}))
    assert got["content"] == (msg.content or "")
    assert got["reasoning"] == (msg.model_extra or {}).get("reasoning_content", "")
    assert got["finish"] == full.choices[0].finish_reason
    assert full.usage.completion_tokens <= 24 and full.usage.prompt_tokens > 5
    # NOTE: the second request may reuse the first one's prompt from the prefix cache
    skip = {"prompt_tokens_details"}
    assert got["usage"].model_dump(exclude=skip) == full.usage.model_dump(exclude=skip)
    if full.choices[0].finish_reason == "length":
        assert full.usage.completion_tokens == 24


def test_completions_usage_length_and_stop(live):
    url, engine = live
    client = _client(url)
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode(prompt))
    text = r.choices[0].text
    stream = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in stream if c.choices) == text
    # a stop string taken from the middle of the greedy text ends it there, unsent
    printable = [i for i in range(3, len(text) - 2) if text[i:i + 2].isprintable()
                 and "\ufffd" not in text[: i + 2]]
    if not printable:
        pytest.skip("the random model produced no printable text to stop on")
    stop = text[printable[0]:printable[0] + 2]
    r2 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                   stop=[stop], extra_body={"ignore_eos": True})
    assert r2.choices[0].finish_reason == "stop"
    assert r2.choices[0].text == text[: text.find(stop)]


def test_seed_reproducible(live):
    url, _ = live
    client = _client(url)
    kw = dict(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, seed=1234,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_logit_bias_through_the_sdk(live):
    # the OpenAI SDK's logit_bias (token id -> bias) forces a token and bans another
    url, engine = live
    client = _client(url)
    word = engine.tokenizer.encode(" the", add_special_tokens=False)[0]
    kw = dict(model=MODEL, prompt="Hello", max_tokens=5, extra_body={"ignore_eos": True})
    r = client.completions.create(**kw, temperature=0.8, seed=3, logit_bias={str(word): 100})
    assert r.choices[0].text == engine.tokenizer.decode([word] * 5)
    greedy = client.completions.create(**kw, temperature=0)
    # the greedy first token from the engine (its text may be part of a character)
    from tinyserve.core import SamplingParams
    from tinyserve.server.chat import encode_text

    prompt = encode_text(engine.tokenizer, "Hello", "prompt", 1024)
    first = next(iter(engine.submit(prompt, SamplingParams(temperature=0.0, max_tokens=1,
                                                           ignore_eos=True)))).token_ids[0]
    banned = client.completions.create(**kw, temperature=0, logit_bias={str(first): -100})
    assert not banned.choices[0].text.startswith(greedy.choices[0].text)


def test_logprobs_through_the_sdk(live):
    # chat: one entry per completion token, the same streamed as in one body; completions:
    # the legacy object, its tokens spelling the text; both the engine's numbers
    url, engine = live
    client = _client(url)
    kw = dict(model=MODEL, messages=_msgs("Hello"), temperature=0, max_tokens=10,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True,
                                                         "chat_template_kwargs":
                                                             {"enable_thinking": False}})
    full = client.chat.completions.create(**kw)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 10
    for e in content:
        assert len(e.top_logprobs) == 2 and e.logprob <= 0.0
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == e.logprob
        assert bytes(e.bytes).decode("utf-8", errors="replace") == e.token
    streamed = [e for c in client.chat.completions.create(**kw, stream=True)
                for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert client.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}
                                          ).choices[0].logprobs is None
    prompt = "The quick brown fox"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert lp.text_offset[0] == 0 and all(len(t) <= 3 for t in lp.top_logprobs)
    if "\ufffd" not in "".join(lp.tokens):
        assert "".join(lp.tokens) == r.choices[0].text
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8,
                                            temperature=0, logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert [t for c in chunks for ch in c.choices if ch.logprobs
            for t in ch.logprobs.token_logprobs] == lp.token_logprobs
    offsets = [o for c in chunks for ch in c.choices if ch.logprobs
               for o in ch.logprobs.text_offset]
    assert offsets == lp.text_offset


@pytest.fixture
def scripted(live):
    """Force the engine to emit SCRIPT token by token, then <|im_end|>."""
    _, engine = live
    ids = engine.tokenizer.encode(SCRIPT, add_special_tokens=False)
    end = engine.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def hook(logits: torch.Tensor, seqs) -> torch.Tensor:
        forced = torch.full_like(logits, -1e9)
        for row, seq in enumerate(seqs):
            forced[row, ids[seq.num_generated] if seq.num_generated < len(ids) else end] = 0
        return forced

    engine.set_logits_hook(hook)
    yield
    engine.set_logits_hook(None)


def test_reasoning_and_tool_call_scripted(live, scripted):
    url, _ = live
    client = _client(url)
    kw = dict(model=MODEL, messages=_msgs("Weather in Paris?"), tools=TOOLS, max_tokens=200)
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}

    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks)
    assert reasoning == "The user wants the weather."
    deltas = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].id.startswith("call_")
    assert len(deltas) > 2  # arguments arrive in several fragments
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {
        "city": "Paris", "days": 3}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_logprobs_of_a_scripted_tool_call(live, scripted):
    # every generated token has one entry, reasoning and tool-call tokens included, streamed
    # or not (the numbers are the model's: the script's logits hook does not change them)
    url, engine = live
    client = _client(url)
    kw = dict(model=MODEL, messages=_msgs("Weather in Paris?"), tools=TOOLS, max_tokens=200,
              logprobs=True, top_logprobs=1)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert r.choices[0].finish_reason == "tool_calls"
    assert len(content) == r.usage.completion_tokens
    assert "".join(e.token for e in content).startswith(SCRIPT)
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs
                for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert all(len(e.top_logprobs) == 1 and e.logprob <= e.top_logprobs[0].logprob <= 0
               for e in streamed)


def test_concurrent_streams_match_solo(live):
    url, engine = live
    client = _client(url)
    jobs = [(f"Request number {i}: " + "tell me about Paris " * (i % 5), 4 + (i * 7) % 37)
            for i in range(16)]

    def run(prompt: str, n: int, stream: bool) -> str:
        kw = dict(model=MODEL, messages=_msgs(prompt), temperature=0, max_tokens=n,
                  extra_body={"ignore_eos": True})
        if not stream:
            m = client.chat.completions.create(**kw).choices[0].message
            return f"{(m.model_extra or {}).get('reasoning_content', '')}|{m.content or ''}"
        got = _collect_stream(client.chat.completions.create(**kw, stream=True))
        assert got["finish"] == "length"
        return f"{got['reasoning']}|{got['content']}"

    solo = [run(p, n, stream=False) for p, n in jobs]
    results: list[str | None] = [None] * len(jobs)
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            results[i] = run(*jobs[i], stream=True)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results == solo


def test_killed_client_frees_pages(live):
    url, engine = live
    body = {"model": MODEL, "messages": _msgs("Hello"), "stream": True, "max_tokens": 400,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer k2"}) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 6:
                assert engine.stats().kv_pages_used > 0
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (engine.stats().kv_pages_used
                                           or engine.stats().running):
        time.sleep(0.05)
    stats = engine.stats()
    assert (stats.kv_pages_used, stats.running, stats.state_slots_used) == (0, 0, 0)
    assert stats.requests_aborted >= 1
    metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k1"}).text
    assert "tinyserve:kv_pages_used 0" in metrics


def test_errors_with_real_engine(live):
    url, engine = live
    with pytest.raises(openai.AuthenticationError):
        _client(url, "bad").models.list()
    (card,) = _client(url).models.list().data
    assert card.model_extra["context_length"] == engine.max_context == 1024
    with pytest.raises(openai.BadRequestError) as exc:
        _client(url).chat.completions.create(model=MODEL, messages=_msgs("Paris " * 1200))
    assert "1024" in exc.value.message
    with pytest.raises(openai.NotFoundError):
        _client(url).chat.completions.create(model="other", messages=_msgs("x"))
    with pytest.raises(openai.BadRequestError) as exc:
        _client(url).chat.completions.create(model=MODEL, messages=_msgs("x"), n=30)
    assert exc.value.body["param"] == "n"
    assert engine.stats().running == 0


def test_n_choices(live):
    # n choices share one response id; seeded ones differ from each other and reproduce;
    # streamed chunks carry each choice's index; usage counts the prompt once
    url, engine = live
    client = _client(url)
    kw = dict(model=MODEL, prompt="Hello", max_tokens=8, temperature=1.0, seed=7, n=3,
              extra_body={"ignore_eos": True})
    r = client.completions.create(**kw)
    texts = [c.text for c in sorted(r.choices, key=lambda c: c.index)]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len(engine.tokenizer.encode("Hello"))
    one = client.completions.create(**{**kw, "n": 1})
    assert one.choices[0].text == texts[0]  # choice i is sampled with seed + i
    streamed = ["", "", ""]
    chunks = list(client.completions.create(**kw, stream=True,
                                            stream_options={"include_usage": True}))
    for c in chunks:
        for ch in c.choices:
            streamed[ch.index] += ch.text
    assert streamed == texts and len({c.id for c in chunks}) == 1
    assert chunks[-1].usage.completion_tokens == 24
    chat = client.chat.completions.create(model=MODEL, messages=_msgs("Hi"), max_tokens=6,
                                          temperature=0, n=2,
                                          extra_body={"ignore_eos": True})
    a, b = (c.message.content for c in chat.choices)
    assert a == b and [c.finish_reason for c in chat.choices] == ["length", "length"]
    assert engine.stats().running == 0

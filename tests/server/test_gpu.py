"""The server over the tiny checkpoint on CUDA (kernels instead of references): greedy stream ==
non-streamed text, concurrent streams agree with the same requests alone (up to a near-tie),
aborts free the pages.
Needs fastapi, uvicorn and openai on the GPU machine (skipped otherwise)."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.requires_cuda


@pytest.fixture(scope="module")
def gpu_live(tiny_checkpoint):
    from tests.server.fakes import serve
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig
    from tinyserve.server.app import create_app
    from tinyserve.server.state import ServerConfig, ServerState

    engine = build_engine(EngineConfig(model=str(tiny_checkpoint(max_position_embeddings=2048)),
                                       device="cuda", max_seqs=8, max_context=1024)).start()
    try:
        with serve(create_app(ServerState(ServerConfig(served_model_name="tiny"), engine))
                   ) as url:
            yield url, engine
    finally:
        engine.shutdown()


# Concurrent requests share batches, and a batch of other shapes takes other kernel tiles
# (other reduction orders): the random tiny model's near-uniform logits may then flip a token
# at a near-tie, after which the texts part. A flip must be at a near-tie, and before it every
# token's logprob must agree.
NEAR_TIE = 0.05  # nats between the top two logprobs of the request alone
LOGPROB_TOL = 0.05


def _run(client, prompt: str, n: int, stream: bool) -> list[tuple[str, float, float]]:
    """(token, logprob, top-1 minus top-2 logprob) of each generated token."""
    kw = dict(model="tiny", messages=[{"role": "user", "content": prompt}], temperature=0,
              max_tokens=n, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True,
                          "chat_template_kwargs": {"enable_thinking": False}})
    if stream:
        entries = [e for c in client.chat.completions.create(**kw, stream=True)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**kw).choices[0].logprobs.content
    return [(e.token, e.logprob, e.top_logprobs[0].logprob - e.top_logprobs[1].logprob)
            for e in entries]


def _agree(got: list[tuple[str, float, float]], alone: list[tuple[str, float, float]]) -> None:
    assert len(got) == len(alone)
    for i, ((token, logprob, _), (want, want_logprob, gap)) in enumerate(
            zip(got, alone, strict=True)):
        if token != want:
            assert gap < NEAR_TIE, (i, token, want, gap)
            return
        assert abs(logprob - want_logprob) < LOGPROB_TOL, (i, token, logprob, want_logprob)


def test_gpu_stream_concurrency_and_abort(gpu_live):
    url, engine = gpu_live
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    jobs = [(f"Request {i}: " + "weather in Paris " * (i % 4), 4 + 5 * i) for i in range(8)]
    solo = [_run(client, p, n, stream=False) for p, n in jobs]
    for (p, n), alone in zip(jobs[:2], solo, strict=False):  # the same batches: the same tokens
        assert [t for t, _, _ in _run(client, p, n, stream=True)] == [t for t, _, _ in alone]
    results: list = [None] * len(jobs)

    def worker(i: int) -> None:
        results[i] = _run(client, *jobs[i], stream=True)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    for got, alone in zip(results, solo, strict=True):
        assert got is not None
        _agree(got, alone)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "max_tokens": 500, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i == 5:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and engine.stats().kv_pages_used:
        time.sleep(0.05)
    assert engine.stats().kv_pages_used == 0

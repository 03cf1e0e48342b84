"""Load with faults: 32 concurrent streaming clients over the real engine (tiny CPU model).

Every greedy answer must equal the same request run alone; clients hang up at random points
(before the first token, i.e. during prefill, and during decode; streamed and not); one
request raises inside the engine (a logits hook) and fails alone. Afterwards every KV page,
GDN state slot and prefix-cache reference is back at its idle value.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.reliability import report
from tests.reliability.client import MODEL, Result, complete, hang_up, stream
from tests.reliability.pools import leaks

CHAT, COMP = "/v1/chat/completions", "/v1/completions"
WORDS = ("Paris", "river", "cloud", "engine", "seven", "garden", "blue", "quantum", "market",
         "story", "tea", "orbit")
SYSTEM = "You are a careful assistant. Answer briefly and precisely. "
# A token-id prompt no chat or text prompt starts with: the engine fails it on purpose.
POISON = [5, 5, 5, 5, 5, 9, 9, 9, 9, 9]
CLIENTS = 32


@dataclass(frozen=True)
class Job:
    path: str
    body: dict
    long: bool  # a prompt long enough that its prefill takes several steps


def make_jobs(rng: random.Random, n: int) -> list[Job]:
    jobs = []
    for i in range(n):
        words = rng.choice((2, 8, 30, 70))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        if i % 3 == 0:  # a shared prefix: prefix-cache hits under load
            text = SYSTEM * 3 + text
        body = {"model": MODEL, "max_tokens": rng.choice((1, 2, 5, 12, 24, 40)),
                "temperature": 0, "ignore_eos": True}
        if i % 2:
            jobs.append(Job(CHAT, {**body, "messages": [{"role": "user", "content": text}]},
                            words >= 30))
        else:
            jobs.append(Job(COMP, {**body, "prompt": text}, words >= 30))
    return jobs


def poison_hook(logits, seqs):
    for s in seqs:
        if list(s.history[:len(POISON)]) == POISON and s.num_generated >= 2:
            raise RuntimeError("fault injected by the reliability test")
    return logits


def run_load(url: str, engine, *, seed: int, distinct: int, total: int,
             time_limit: float) -> None:
    rng = random.Random(seed)
    jobs = make_jobs(rng, distinct)
    limits = httpx.Limits(max_connections=2 * CLIENTS, max_keepalive_connections=CLIENTS)
    with httpx.Client(timeout=120, limits=limits) as client:
        solo = [complete(client, url, j.path, j.body) for j in jobs]
        assert all(r.status == 200 for r in solo), [r.body for r in solo if r.status != 200]
        before = engine.stats()

        # the plan: mostly whole streams, some whole bodies, cuts at random points, one fault
        plan: list[tuple[str, int, float]] = []
        for _ in range(total - 1):
            i = rng.randrange(distinct)
            x = rng.random()
            if x < 0.70:
                plan.append(("stream", i, 0))
            elif x < 0.80:
                plan.append(("body", i, 0))
            elif x < 0.95:
                if x < 0.86:  # hang up before the first token, while the prompt prefills
                    plan.append(("cut", rng.choice([k for k, j in enumerate(jobs) if j.long]),
                                 0))
                else:  # ... or somewhere in the decode
                    plan.append(("cut", i, rng.randint(1, max(1, solo[i].completion_tokens))))
            else:
                plan.append(("hangup", i, rng.uniform(0.0, 0.8)))
        plan.insert(len(plan) // 3, ("poison", -1, 0))

        def one(item: tuple[str, int, float]) -> tuple[str, int, Result | None]:
            kind, i, arg = item
            if kind == "poison":
                body = {"model": MODEL, "prompt": POISON, "max_tokens": 30,
                        "temperature": 0, "ignore_eos": True}
                return kind, i, stream(client, url, COMP, body)
            job = jobs[i]
            if kind == "stream":
                return kind, i, stream(client, url, job.path, job.body)
            if kind == "body":
                return kind, i, complete(client, url, job.path, job.body)
            if kind == "cut":
                return kind, i, stream(client, url, job.path, job.body, cut_after=int(arg))
            hang_up(url, job.path, {**job.body, "stream": False}, arg)
            return kind, i, None

        engine.set_logits_hook(poison_hook)
        t0 = time.monotonic()
        try:
            with ThreadPoolExecutor(CLIENTS) as pool:
                results = list(pool.map(one, plan, timeout=time_limit))
        finally:
            engine.set_logits_hook(None)
        elapsed = time.monotonic() - t0

    mismatches, served, fives = [], 0, 0
    for kind, i, res in results:
        if res is not None and res.status >= 500:
            fives += 1
        if kind == "poison":
            assert res.status == 200 and res.error is not None, res
            assert "fault injected" in res.error["message"]
            report.add("faults_injected")
        elif kind in ("stream", "body"):
            want = solo[i]
            assert res.status == 200 and res.error is None, (kind, res)
            got = (res.text, res.finish, res.completion_tokens)
            if got != (want.text, want.finish, want.completion_tokens):
                mismatches.append((kind, i, got, (want.text, want.finish,
                                                  want.completion_tokens)))
            served += 1
        elif kind == "cut":
            assert res.status == 200, res
            report.add("disconnects_injected")
            report.add("disconnects_in_prefill" if res.events == 0 else "disconnects_in_decode")
        else:
            report.add("disconnects_injected")
            report.add("disconnects_non_streaming")
    report.add("requests_served", served + len(solo))
    report.add("responses_5xx", fives)
    left = leaks(engine)
    report.add("leaked_kv_pages", left["kv_pages"])
    report.add("leaked_state_slots", left["state_slots"])
    report.add("leaked_prefix_cache_refs", left["cache_refs"])

    assert not mismatches, mismatches[:3]
    assert fives == 0
    assert left == {"requests": 0, "kv_pages": 0, "state_slots": 0, "cache_refs": 0}, left
    after = engine.stats()
    assert after.requests_failed - before.requests_failed == 1
    assert after.requests_aborted > before.requests_aborted
    report.add("preemptions", after.preemptions - before.preemptions)
    assert elapsed < time_limit
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    with httpx.Client(timeout=60) as client:  # and the first job still answers as alone
        assert complete(client, url, jobs[0].path, jobs[0].body).text == solo[0].text


def test_load_with_disconnects_and_a_fault(load_server):
    url, engine = load_server
    run_load(url, engine, seed=1, distinct=24, total=192, time_limit=150)


@pytest.mark.slow
def test_soak(load_server):
    url, engine = load_server
    for seed in (2, 3, 4):
        run_load(url, engine, seed=seed, distinct=48, total=600, time_limit=900)

"""The prefix cache inside the scheduler and the engine.

First over a checking fake runner (no model): its 'KV pages' and 'GDN states' record which
tokens they hold, so every step asserts that a sequence resumes from exactly its own history
and never writes a page someone else shares. Then on the tiny checkpoint (CPU, fp32): multi-turn
chats prefill only the new turn and generate exactly the tokens of an engine without the cache.
"""

from __future__ import annotations

import random
import threading

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tinyserve.core import Batch, ForwardOutput, SamplingParams
from tinyserve.engine.scheduler import Scheduler
from tinyserve.kv.allocator import PageAllocator
from tinyserve.kv.prefix_cache import PrefixCache

PS = 4


def next_token(history: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return (sum(history) * 31 + len(history)) % 90 + 5


def reference(prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class CheckingRunner:
    """Fake runner + state pool: page -> {offset: (token, position)}, slot -> tokens seen."""

    def __init__(self) -> None:
        self.kv: dict[int, dict[int, tuple[int, int]]] = {}
        self.data: dict[int, tuple[int, ...]] = {}
        self.computed: dict[str, int] = {}
        self.pages: PageAllocator | None = None

    def copy_slot(self, src: int, dst: int) -> None:
        self.data[dst] = self.data[src]

    def forward(self, batch: Batch) -> ForwardOutput:
        out = []
        for s in batch.seqs:
            hist, start, end = s.history, s.start_pos, s.start_pos + s.num_tokens
            if start:
                assert self.data[s.state_slot] == tuple(hist[:start]), "wrong GDN state"
                for p in range(start):
                    assert self.kv[s.page_ids[p // PS]][p % PS] == (hist[p], p), "wrong KV"
            for p in range(start, end):
                page = s.page_ids[p // PS]
                assert self.pages.refcount(page) == 1, "writes a shared page"
                self.kv.setdefault(page, {})[p % PS] = (hist[p], p)
            self.data[s.state_slot] = tuple(hist[:end])
            self.computed[s.request_id] = self.computed.get(s.request_id, 0) + s.num_tokens
            out.append(next_token(hist[:end]) if s.sample else None)
        return ForwardOutput(out)


def make(num_pages=64, max_seqs=4, snapshots=3, budget=16, max_context=96, interval=0,
         cache=True):
    runner = CheckingRunner()
    pages = runner.pages = PageAllocator(num_pages)
    pc = PrefixCache(pages, page_size=PS, states=runner,
                     snapshot_slots=range(max_seqs, max_seqs + snapshots),
                     snapshot_interval=interval) if cache else None
    s = Scheduler(pages=pages, slots=PageAllocator(max_seqs), page_size=PS,
                  max_context=max_context, max_seqs=max_seqs, max_num_batched_tokens=budget,
                  prefix_cache=pc)
    return s, runner


def run(s: Scheduler, runner: CheckingRunner, outputs: dict, limit: int = 2000) -> None:
    for _ in range(limit):
        if not s.has_work:
            return
        batch = s.schedule()
        for ev in s.update(batch, runner.forward(batch)) if batch.seqs else ():
            outputs.setdefault(ev.request_id, []).append(ev.token_id)
    raise AssertionError("did not finish")


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_second_turn_prefills_only_the_new_tokens() -> None:
    s, runner = make()
    out: dict[str, list[int]] = {}
    p1 = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]  # 11 tokens
    s.add("t1", p1, greedy(6))
    run(s, runner, out)
    assert out["t1"] == reference(p1, 6)
    # computed 11 + 5 = 16 tokens: the last one was sampled, never run
    p2 = p1 + out["t1"] + [40, 41, 42]
    s.add("t2", p2, greedy(4))
    run(s, runner, out)
    assert out["t2"] == reference(p2, 4)
    assert runner.computed["t2"] == (len(p2) - 16) + 3  # the prefill, then 3 decode steps
    assert s.cache.hits == 1 and s.cache.hit_tokens == 16
    s.cache.check()
    s.cache.clear()
    assert s.pages.num_free == s.pages.num_pages and s.slots.num_free == s.slots.num_pages


def test_same_prompt_reuses_the_prompt_end_snapshot() -> None:
    s, runner = make()
    out: dict[str, list[int]] = {}
    prompt = list(range(20, 34))  # 14 tokens: the prefill is cut at 12 for a snapshot
    s.add("a", prompt, greedy(9))
    run(s, runner, out)
    s.add("b", prompt, greedy(9))
    run(s, runner, out)
    assert out["a"] == out["b"] == reference(prompt, 9)
    assert runner.computed["b"] == 2 + 8
    s.add("c", prompt[:9] + [99] * 6, greedy(3))  # branches inside page 3: nothing to reuse
    run(s, runner, out)
    assert runner.computed["c"] == 15 + 2 and out["c"] == reference(prompt[:9] + [99] * 6, 3)


def test_snapshot_interval_allows_reuse_before_a_branch() -> None:
    s, runner = make(interval=8, budget=32)
    out: dict[str, list[int]] = {}
    a = list(range(1, 31))
    s.add("a", a, greedy(2))
    run(s, runner, out)
    b = a[:19] + [77] * 8
    s.add("b", b, greedy(2))
    run(s, runner, out)
    assert runner.computed["b"] == len(b) - 16 + 1 and out["b"] == reference(b, 2)


def test_eviction_under_pressure_never_touches_running_requests() -> None:
    s, runner = make(num_pages=14, max_seqs=3, snapshots=2, budget=8, max_context=48)
    out: dict[str, list[int]] = {}
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(5, 60) for _ in range(rng.randrange(3, 20))]
               for i in range(12)}
    for rid, p in prompts.items():
        s.add(rid, p, greedy(12))
        if rng.random() < 0.5:
            batch = s.schedule()
            for ev in s.update(batch, runner.forward(batch)):
                out.setdefault(ev.request_id, []).append(ev.token_id)
    run(s, runner, out)
    assert all(out[r] == reference(p, 12) for r, p in prompts.items())
    assert s.num_preemptions > 0  # the pool was really short
    s.cache.check()
    s.cache.clear()
    assert s.pages.num_free == s.pages.num_pages


conversation = st.tuples(
    st.lists(st.integers(5, 6), min_size=1, max_size=10),  # first prompt (collides often)
    st.lists(st.lists(st.integers(5, 9), min_size=1, max_size=6), max_size=3),  # later turns
    st.integers(1, 12),  # max_tokens per turn
    st.integers(0, 6),  # arrival step
    st.sampled_from([None, 0, 1, 3]))  # abort after this many steps of its first turn


@settings(max_examples=80, deadline=None)
@given(st.lists(conversation, min_size=1, max_size=6), st.lists(st.integers(5, 6), max_size=12),
       st.integers(8, 16), st.integers(0, 3), st.sampled_from([0, 8]))
def test_random_interleavings_keep_accounting_exact(convs, system, num_pages, snapshots,
                                                    interval):
    """Multi-turn conversations arrive, run, abort and continue in random interleavings under
    page pressure: every output is the reference one, and once everything has finished and
    the cache is cleared every page and slot is free."""
    s, runner = make(num_pages=num_pages, max_seqs=4, snapshots=snapshots, budget=8,
                     max_context=32, interval=interval)
    out: dict[str, list[int]] = {}
    convs_state = [{"prompt": system + c[0], "turn": 0, "rid": None, "done": False} for c in convs]
    for step_no in range(3000):
        for i, ((_, turns, n, arrival, abort_at), c) in enumerate(zip(convs, convs_state,
                                                                       strict=True)):
            if c["done"] or step_no < arrival:
                continue
            rid = c["rid"]
            if rid in s.requests:
                if c["turn"] == 1 and abort_at is not None and step_no >= arrival + abort_at:
                    s.finish(rid)
                    c["done"] = True
                continue
            if rid is not None:  # the previous turn finished
                assert out[rid] == reference(c["prompt"], n)
                if c["turn"] > len(turns):
                    c["done"] = True
                    continue
                c["prompt"] = c["prompt"] + out[rid] + turns[c["turn"] - 1]
            if len(c["prompt"]) + n > 32:
                c["done"] = True
                continue
            c["rid"] = f"c{i}t{c['turn']}"
            c["turn"] += 1
            s.add(c["rid"], c["prompt"], greedy(n))
        if not s.has_work and all(c["done"] for c in convs_state):
            break
        batch = s.schedule()
        if batch.seqs:
            for ev in s.update(batch, runner.forward(batch)):
                out.setdefault(ev.request_id, []).append(ev.token_id)
    assert not s.has_work and all(c["done"] for c in convs_state)
    if s.cache is not None:
        s.cache.check()
        s.cache.clear()
    assert s.pages.num_free == s.pages.num_pages and s.slots.num_free == s.slots.num_pages


# -------------------------------------------------------------------------- tiny checkpoint


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    common = dict(model=str(tiny_checkpoint()), device="cpu", max_context=256, max_seqs=4,
                  max_num_batched_tokens=64, page_size=16)
    cached = build_engine(EngineConfig(**common)).start()
    plain = build_engine(EngineConfig(**common, prefix_cache=False)).start()
    small = build_engine(EngineConfig(**common, num_kv_pages=14,
                                      prefix_snapshot_slots=2)).start()
    counts = {id(e): _record(e) for e in (cached, plain, small)}
    try:
        yield cached, plain, small, counts
    finally:
        for e in (cached, plain, small):
            e.shutdown()


def _record(engine) -> dict[str, int]:
    """Count the tokens each request runs through the model."""
    counts: dict[str, int] = {}
    launch = engine.runner.launch

    def counting(batch, **kw):
        for s in batch.seqs:
            counts[s.request_id] = counts.get(s.request_id, 0) + s.num_tokens
        return launch(batch, **kw)

    engine.runner.launch = counting
    return counts


def _gen(engine, prompt, n, rid):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return engine.submit(prompt, params, request_id=rid).result(timeout=120)


def _prompt(rng, n):
    return [rng.randrange(1, 480) for _ in range(n)]


def test_tiny_two_turn_chat_prefills_only_the_new_turn(engines) -> None:
    cached, plain, _, counts = engines
    cached.clear_prefix_cache()
    rng = random.Random(1)
    p1 = _prompt(rng, 37)
    a1 = _gen(cached, p1, 28, "two-1")
    assert a1.token_ids == _gen(plain, p1, 28, "two-1").token_ids
    p2 = p1 + a1.token_ids + _prompt(rng, 9)  # 37 + 28 + 9 = 74 tokens
    a2 = _gen(cached, p2, 10, "two-2")
    # turn 1 ran 37 + 27 = 64 tokens: the cache resumes there
    assert a2.cached_tokens == 64
    assert counts[id(cached)]["two-2"] - 9 == len(p2) - 64 == 9 + 1
    assert a2.token_ids == _gen(plain, p2, 10, "two-2").token_ids
    s = cached.stats()
    assert s.prefix_cache_hits >= 1 and s.prefix_cached_tokens >= 64
    assert (s.running, s.kv_pages_used, s.state_slots_used) == (0, 0, 0)
    assert s.prefix_cache_pages > 0


def test_tiny_branches_and_regeneration(engines) -> None:
    cached, plain, _, counts = engines
    cached.clear_prefix_cache()
    rng = random.Random(2)
    p = _prompt(rng, 50)
    a = _gen(cached, p, 20, "br-0").token_ids  # ran 69 tokens: snapshots at 48 and 64
    again = _gen(cached, p, 20, "br-1")
    assert again.token_ids == a and again.cached_tokens == 48
    branches = [p + a + _prompt(rng, k) for k in (5, 12)] + [p[:40] + _prompt(rng, 30)]
    handles = [cached.submit(b, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                             request_id=f"br-b{i}") for i, b in enumerate(branches)]
    got = [h.result(timeout=120) for h in handles]
    assert [g.cached_tokens for g in got] == [64, 64, 0]
    for i, (b, g) in enumerate(zip(branches, got, strict=True)):
        assert g.token_ids == _gen(plain, b, 8, f"br-b{i}").token_ids
    assert counts[id(cached)]["br-b0"] == len(branches[0]) - 64 + 7


def test_tiny_eviction_under_pressure(engines) -> None:
    _, plain, small, _ = engines
    rng = random.Random(3)
    convs = [_prompt(rng, rng.randrange(10, 40)) for _ in range(5)]
    results: dict[tuple[int, int], list[int]] = {}
    errors: list[BaseException] = []

    def chat(i: int) -> None:
        try:
            prompt = convs[i]
            for turn in range(3):
                out = _gen(small, prompt, 12, f"ev-{i}-{turn}").token_ids
                results[(i, turn)] = (prompt, out)
                prompt = prompt + out + [i + 1, turn + 1]
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=chat, args=(i,)) for i in range(len(convs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    for (i, turn), (prompt, out) in results.items():
        assert out == _gen(plain, prompt, 12, f"ev-{i}-{turn}").token_ids
    s = small.stats()
    assert s.prefix_cache_queries == len(results) and (s.running, s.kv_pages_used) == (0, 0)
    small.clear_prefix_cache()
    s = small.stats()
    assert small.scheduler.pages.num_free == s.kv_pages_total and s.prefix_cache_pages == 0


def test_tiny_server_reports_cached_tokens(engines) -> None:
    from tests.server.fakes import serve
    from tinyserve.server.app import create_app
    from tinyserve.server.state import ServerConfig, ServerState

    cached, _, _, _ = engines
    cached.clear_prefix_cache()
    state = ServerState(ServerConfig(served_model_name="tiny"), cached)
    prompt = _prompt(random.Random(4), 40)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0,
            "ignore_eos": True}
    with serve(create_app(state)) as url:
        first = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        second = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        metrics = httpx.get(url + "/metrics", timeout=60).text
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert "tinyserve:prefix_cache_hits_total" in metrics
    hits = [ln for ln in metrics.splitlines() if ln.startswith("tinyserve:prefix_cache_hits")]
    assert int(hits[0].split()[-1]) >= 1


def _turn2_logits(engine, p1: list[int], extra: list[int], a1: list[int] | None = None):
    """Turn 1 (greedy, 28 tokens) then turn 2 = p1 + answer + extra with one sampled token;
    returns (answer, turn-2 logits [V] float32 on the CPU, turn-2 cached tokens)."""
    if a1 is None:
        a1 = _gen(engine, p1, 28, "t2l-1").token_ids
    seen = {}

    def hook(logits, seqs):
        for i, s in enumerate(seqs):
            if s.request_id == "t2l-2" and s.num_generated == 0:
                seen["logits"] = logits[i].float().cpu()
        return logits

    engine.set_logits_hook(hook)
    try:
        out = _gen(engine, p1 + a1 + extra, 1, "t2l-2")
    finally:
        engine.set_logits_hook(None)
    return a1, seen["logits"], out.cached_tokens


def _kl(ref, other) -> float:
    lp, lq = ref.log_softmax(-1), other.log_softmax(-1)
    return float((lp.exp() * (lp - lq)).sum())


@pytest.mark.parametrize("fmt", ["iso3", "iso4"])
def test_tiny_iso_pages_are_reused_as_they_are(fmt: str) -> None:
    """ISO KV (head_dim 128): the cached packed pages serve the second turn; its logits stay
    as close to an uncached run as chunked prefill does (the prefix is read packed)."""
    pytest.importorskip("transformers")
    from tests.model.hf_tiny import _ROOT, checkpoint
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    checkpoint("bf16", "hd128")
    common = dict(model=str(_ROOT / "hd128-bf16"), kv=fmt, device="cpu", max_context=128,
                  max_seqs=2, max_num_batched_tokens=64)
    rng = random.Random(5)
    p1, extra = _prompt(rng, 37), _prompt(rng, 9)
    with build_engine(EngineConfig(**common)).start() as cached:
        a1, got, n_cached = _turn2_logits(cached, p1, extra)
    with build_engine(EngineConfig(**common, prefix_cache=False)).start() as plain:
        _, ref, _ = _turn2_logits(plain, p1, extra, a1)
    assert n_cached == 64 and torch.isfinite(got).all()
    assert _kl(ref, got) < 0.01


@pytest.mark.requires_cuda
@pytest.mark.parametrize("kv", ["bf16", "iso3"])
def test_cuda_second_turn_matches_uncached(kv: str) -> None:
    """On the GPU (bf16, kernels): a restored GDN snapshot + reused pages give the second
    turn the logits of an uncached run, within bf16 noise."""
    pytest.importorskip("transformers")
    from tests.model.hf_tiny import _ROOT, checkpoint
    from tinyserve.engine.build import build_engine
    from tinyserve.engine.config import EngineConfig

    checkpoint("bf16", "hd128")
    common = dict(model=str(_ROOT / "hd128-bf16"), kv=kv, device="cuda", max_context=256,
                  max_seqs=2, max_num_batched_tokens=64)
    rng = random.Random(6)
    p1, extra = _prompt(rng, 37), _prompt(rng, 9)
    with build_engine(EngineConfig(**common)).start() as cached:
        a1, got, n_cached = _turn2_logits(cached, p1, extra)
        assert cached.stats().prefix_cache_hits == 1
    with build_engine(EngineConfig(**common, prefix_cache=False)).start() as plain:
        _, ref, _ = _turn2_logits(plain, p1, extra, a1)
    assert n_cached == 64 and torch.isfinite(got).all()
    assert _kl(ref, got) < 0.02
    assert torch.nn.functional.cosine_similarity(ref, got, dim=0) > 0.99


def test_cli_flag_turns_the_cache_off() -> None:
    from tinyserve.cli import build_parser
    from tinyserve.engine.config import EngineConfig

    on = EngineConfig.from_args(build_parser().parse_args(["run", "m"]))
    off = EngineConfig.from_args(build_parser().parse_args(["run", "m", "--no-prefix-cache"]))
    assert (on.prefix_cache, on.snapshot_slots(1), on.snapshot_slots(4)) == (True, 2, 5)
    assert (off.prefix_cache, off.snapshot_slots(1)) == (False, 0)
    assert EngineConfig(model="m", prefix_snapshot_slots=3).snapshot_slots(1) == 3
    with pytest.raises(ValueError, match="prefix_snapshot_interval"):
        EngineConfig(model="m", prefix_snapshot_interval=10)

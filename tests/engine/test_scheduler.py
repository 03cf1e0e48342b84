"""The scheduler on hand-written outputs: no model, no torch tensors."""

from __future__ import annotations

import random

import pytest

from tinyserve.core import PENDING_TOKEN, ForwardOutput, SamplingParams
from tinyserve.engine.scheduler import RequestRejected, Scheduler
from tinyserve.kv.allocator import PageAllocator

EOS = 0


def make(num_pages=64, num_slots=4, page_size=4, max_context=64, max_seqs=4, budget=16):
    return Scheduler(pages=PageAllocator(num_pages), slots=PageAllocator(num_slots),
                     page_size=page_size, max_context=max_context, max_seqs=max_seqs,
                     max_num_batched_tokens=budget, eos_token_ids=(EOS,))


def next_token(history: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole sequence."""
    return (sum(history) * 31 + len(history)) % 90 + 5


def step(s: Scheduler, forced: dict[str, int] | None = None):
    batch = s.schedule()
    tokens = []
    for seq in batch.seqs:
        # NOTE: the runner sees every token up to the end of its chunk.
        assert seq.history[seq.start_pos:seq.start_pos + seq.num_tokens] == seq.token_ids
        assert len(seq.page_ids) * s.page_size >= seq.start_pos + seq.num_tokens
        if not seq.sample:
            tokens.append(None)
        elif forced and seq.request_id in forced:
            tokens.append(forced[seq.request_id])
        else:
            tokens.append(next_token(seq.history))
    events = s.update(batch, ForwardOutput(tokens))
    log = s.__dict__.setdefault("test_log", ({}, {}))  # every step's events, for run_all
    for e in events:
        log[0].setdefault(e.request_id, []).append(e.token_id)
        if e.finish_reason:
            log[1][e.request_id] = e.finish_reason
    return batch, events


def run_all(s: Scheduler, limit=1000):
    """Step until idle; the outputs and finish reasons of every step so far."""
    for _ in range(limit):
        if not s.has_work:
            break
        step(s)
    assert not s.has_work
    return s.__dict__.get("test_log", ({}, {}))


def assert_idle(s: Scheduler) -> None:
    assert s.pages.num_free == s.pages.num_pages
    assert s.slots.num_free == s.slots.num_pages
    assert not s.requests and not s.running and not s.waiting


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


def test_chunked_prefill_then_decode() -> None:
    s = make(budget=4)
    s.add("a", list(range(1, 11)), greedy(3))
    chunks = []
    for _ in range(5):
        batch, _ = step(s)
        (seq,) = batch.seqs
        chunks.append((seq.start_pos, seq.num_tokens, seq.sample))
    assert chunks == [(0, 4, False), (4, 4, False), (8, 2, True), (10, 1, True), (11, 1, True)]
    assert_idle(s)


def test_decodes_first_then_prefill_under_budget() -> None:
    s = make(budget=8, max_seqs=4)
    s.add("a", [1, 2], greedy(10))
    s.add("b", [3, 4], greedy(10))
    step(s)  # both prefills
    s.add("c", list(range(1, 21)), greedy(2))
    batch, _ = step(s)
    assert [(q.request_id, q.num_tokens) for q in batch.seqs] == [("a", 1), ("b", 1), ("c", 6)]
    assert batch.num_tokens == 8
    batch, _ = step(s)
    assert [(q.request_id, q.num_tokens) for q in batch.seqs] == [("a", 1), ("b", 1), ("c", 6)]


def test_max_seqs_limits_running() -> None:
    s = make(max_seqs=2, num_slots=8)
    for i in range(5):
        s.add(f"r{i}", [1, 2, 3], greedy(4))
    batch, _ = step(s)
    assert len(batch) == 2 and len(s.running) == 2 and len(s.waiting) == 3
    outputs, reasons = run_all(s)
    assert all(len(v) == 4 for v in outputs.values()) and set(reasons.values()) == {"length"}
    assert_idle(s)


def test_admission_waits_for_slots_and_pages() -> None:
    s = make(num_slots=1)
    s.add("a", [1, 2, 3], greedy(2))
    s.add("b", [1, 2, 3], greedy(2))
    batch, _ = step(s)
    assert [q.request_id for q in batch.seqs] == ["a"] and len(s.waiting) == 1
    s2 = make(num_pages=3, page_size=4, max_context=12)
    s2.add("a", list(range(1, 9)), greedy(4))  # 2 pages now, 3 at the end
    s2.add("b", list(range(1, 9)), greedy(4))
    batch, _ = step(s2)
    assert [q.request_id for q in batch.seqs] == ["a"]
    outputs, _ = run_all(s2)
    assert len(outputs["a"]) == len(outputs["b"]) == 4
    assert_idle(s2)


def test_rejects_what_can_never_fit() -> None:
    s = make(num_pages=4, page_size=4, max_context=32)
    with pytest.raises(RequestRejected, match="exceeds the context limit of 32") as exc:
        s.add("a", [1] * 30, greedy(5))
    assert (exc.value.prompt_tokens, exc.value.max_tokens, exc.value.limit) == (30, 5, 32)
    with pytest.raises(RequestRejected, match="needs 5 KV pages; the pool has 4"):
        s.check(17, greedy(2))
    with pytest.raises(RequestRejected, match="empty"):
        s.check(0, greedy(2))
    s.add("ok", [1] * 12, greedy(4))  # exactly fills the pool
    with pytest.raises(ValueError, match="already in use"):
        s.add("ok", [1], greedy(1))
    run_all(s)
    assert_idle(s)


def test_preempts_newest_when_pages_run_out_and_recomputes() -> None:
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8], "c": [9, 10, 11, 12]}
    alone = {}
    for rid, p in prompts.items():
        s = make()
        s.add(rid, p, greedy(8))
        alone[rid] = run_all(s)[0][rid]
    s = make(num_pages=7, page_size=4, max_context=12)
    for rid, p in prompts.items():
        s.add(rid, p, greedy(8))
    outputs, reasons = run_all(s)
    assert s.num_preemptions > 0
    assert outputs == alone
    assert reasons == {"a": "length", "b": "length", "c": "length"}
    assert_idle(s)


def test_abort_anywhere_frees_everything() -> None:
    s = make(budget=4)
    s.add("prefilling", list(range(1, 11)), greedy(5))
    s.add("waiting", [1, 2], greedy(5))
    step(s)
    assert s.requests["prefilling"].running and s.pages.num_used > 0
    assert s.finish("prefilling") is not None
    assert s.finish("waiting") is not None
    assert s.finish("unknown") is None
    assert_idle(s)
    s.add("decoding", [1, 2], greedy(5))
    step(s)
    step(s)
    s.finish("decoding")
    assert_idle(s)


def test_fifo_head_is_not_starved_by_small_requests() -> None:
    s = make(num_pages=6, page_size=4, max_context=24, max_seqs=4)
    s.add("small0", [1, 2, 3, 4], greedy(3))
    step(s)
    s.add("big", list(range(1, 21)), greedy(3))  # needs 5 pages: waits for small0
    s.add("small1", [1, 2], greedy(3))
    order = []
    for _ in range(100):
        if not s.has_work:
            break
        batch, _ = step(s)
        for q in batch.seqs:
            if q.start_pos == 0 and q.request_id not in order:
                order.append(q.request_id)
    assert order == ["big", "small1"]
    assert_idle(s)


def test_stop_conditions() -> None:
    s = make()
    s.add("eos", [1, 2], greedy(10))
    s.add("ignore", [1, 2], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    s.add("stop_id", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[77]))
    _, events = step(s, forced={"eos": EOS, "ignore": EOS, "stop_id": 5})
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("eos", "stop"), ("ignore", None), ("stop_id", None)]
    _, events = step(s, forced={"ignore": EOS, "stop_id": 77})
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("ignore", None), ("stop_id", "stop")]
    _, events = step(s, forced={"ignore": EOS})
    assert [(e.request_id, e.token_id, e.finish_reason) for e in events] == [
        ("ignore", EOS, "length")]
    assert_idle(s)


def test_solo_runs_alone_after_a_failed_step() -> None:
    s = make()
    for rid in "abc":
        s.add(rid, [1, 2, 3], greedy(4))
    batch = s.schedule()  # pretend this step failed
    for q in batch.seqs:
        s.preempt(q.request_id, solo_until=q.start_pos + q.num_tokens)
    assert s.pages.num_used == 0
    for expected in ("a", "b", "c"):
        batch, _ = step(s)
        assert [q.request_id for q in batch.seqs] == [expected]
    batch, _ = step(s)
    assert len(batch) == 3
    run_all(s)
    assert_idle(s)


def test_solo_lasts_until_past_the_failed_chunk() -> None:
    """A request whose failed step was its third prefill chunk runs alone through all three
    chunks again (not only the first: its third would fail beside the others again), then
    shares steps."""
    s = make(budget=4)
    s.add("long", list(range(1, 13)), greedy(2))
    for _ in range(2):
        step(s)  # "long": tokens 0-3, then 4-7
    s.add("other", [1, 2, 3], greedy(6))
    batch = s.schedule()  # "long" 8-11 (the budget leaves "other" waiting): pretend it failed
    failed = {q.request_id: q.start_pos + q.num_tokens for q in batch.seqs}
    assert failed == {"long": 12}
    s.preempt("long", solo_until=failed["long"])
    for start in (0, 4, 8):
        batch, _ = step(s)
        assert [(q.request_id, q.start_pos) for q in batch.seqs] == [("long", start)]
    batch, _ = step(s)
    assert sorted(q.request_id for q in batch.seqs) == ["long", "other"]
    run_all(s)
    assert_idle(s)


def test_random_workload_returns_to_idle() -> None:
    rng = random.Random(1)
    s = make(num_pages=12, page_size=4, max_context=40, max_seqs=3, budget=8, num_slots=3)
    n = 0
    for _ in range(400):
        if rng.random() < 0.3:
            plen = rng.randint(1, 20)
            s.add(f"r{n}", [rng.randint(1, 99) for _ in range(plen)],
                  greedy(rng.randint(1, 40 - plen)))
            n += 1
        if s.requests and rng.random() < 0.05:
            s.finish(rng.choice(list(s.requests)))
        if s.has_work:
            batch, _ = step(s)
            assert len(batch) <= 3 and batch.num_tokens <= 8
        assert s.pages.num_used == sum(len(r.pages) for r in s.running)
        assert s.slots.num_used == len(s.running)
    run_all(s)
    assert_idle(s)


def test_admission_leaves_a_page_per_running_request() -> None:
    s = make(num_pages=3, page_size=4, max_context=12)
    s.add("a", [1, 2, 3, 4], greedy(4))  # 1 page now, 2 at the end
    step(s)
    s.add("b", list(range(1, 9)), greedy(1))  # 2 pages: admitting it would starve a's decode
    batch, _ = step(s)
    assert [q.request_id for q in batch.seqs] == ["a"]
    outputs, _ = run_all(s)
    assert s.num_preemptions == 0 and len(outputs["b"]) == 1
    assert_idle(s)


def test_decode_steps_hand_out_the_page_list_without_copying_it() -> None:
    s = make(num_pages=64, page_size=4)
    s.add("a", list(range(1, 10)), SamplingParams(max_tokens=12, ignore_eos=True))
    s.add("b", list(range(1, 6)), SamplingParams(max_tokens=12, ignore_eos=True))
    step(s)
    for _ in range(8):  # across page boundaries: pages appended in place
        batch, _ = step(s)
        for seq in batch.seqs:
            req = s.requests[seq.request_id]
            assert seq.page_ids is req.pages
            assert len(seq.page_ids) == s.pages_for(seq.start_pos + 1)
    s.preempt("b")  # a released request gets a new list; the old batch keeps its pages
    old = next(q for q in batch.seqs if q.request_id == "b")
    assert s.requests["b"].pages == [] and old.page_ids and old.page_ids is not \
        s.requests["b"].pages
    run_all(s)
    assert_idle(s)


def test_request_preempted_by_a_decode_page_is_not_prefilled_in_the_same_step() -> None:
    # b is admitted while a decodes, and still prefilling (one token a step) when a crosses a
    # page boundary with no page left: a's reservation preempts b in that very schedule().
    s = make(num_pages=6, page_size=4, max_context=16, max_seqs=2, budget=2)
    s.add("a", [1, 2, 3, 4], SamplingParams(max_tokens=12, ignore_eos=True))
    step(s)
    step(s)
    s.add("b", list(range(1, 13)), SamplingParams(max_tokens=2, ignore_eos=True))
    for _ in range(8):
        batch, _ = step(s)
        assert [q.request_id for q in batch.seqs] == ["a", "b"]
    assert s.num_preemptions == 0
    batch, _ = step(s)  # the step that preempts b: its batch holds a alone
    assert s.num_preemptions == 1
    assert [q.request_id for q in batch.seqs] == ["a"]
    for seq in batch.seqs:
        assert seq.state_slot is not None and s.requests[seq.request_id].running
    outputs, reasons = run_all(s)
    assert reasons == {"a": "length", "b": "length"}
    assert_idle(s)


# ------------------------------------------------------------------- chained decode steps


def chained_run(s: Scheduler, forced: dict[str, dict[int, int]] | None = None,
                limit: int = 1000) -> tuple[dict, dict, int]:
    """Step like the engine with chained decode: advance, schedule_next before the tokens
    are known, record, run the chained batch (its input = the token just recorded). Returns
    (outputs, finish reasons, chained steps). `forced[rid][i]`: the i-th output token."""
    outs: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    chained = 0
    ahead = None
    for _ in range(limit):
        if ahead is not None:
            batch, ahead = ahead, None
        elif s.has_work:
            batch = s.schedule()
        else:
            break
        s.advance(batch)
        nxt = s.schedule_next(batch)
        tokens = []
        for seq in batch.seqs:
            history = seq.history[:seq.start_pos + seq.num_tokens]
            if seq.token_ids == [PENDING_TOKEN]:
                assert len(seq.history) >= seq.start_pos + 1  # recorded by now
            else:
                assert history[seq.start_pos:] == seq.token_ids
            n = len(outs.get(seq.request_id, []))
            f = (forced or {}).get(seq.request_id, {})
            tokens.append(f.get(n, next_token(history)) if seq.sample else None)
        for e in s.record(batch, ForwardOutput(tokens)):
            outs.setdefault(e.request_id, []).append(e.token_id)
            if e.finish_reason:
                reasons[e.request_id] = e.finish_reason
        if nxt is not None:
            chained += 1
            ahead = nxt
    assert not s.has_work
    return outs, reasons, chained


def test_chained_steps_give_the_serial_outputs() -> None:
    """Chaining changes when steps are scheduled, never what they compute: same outputs and
    finish reasons as the serial loop, through prefill, length ends at different steps, an
    EOS and a stop token (both seen one step late), and a late arrival."""
    want_s, got_s = make(), make()
    forced = {"eos": {5: EOS}, "stop": {3: 77}}
    for s in (want_s, got_s):
        s.add("long", [1, 2, 3, 4, 5], greedy(12))
        s.add("short", [6, 7], greedy(4))
        s.add("eos", [8, 9, 10], greedy(10))
        s.add("stop", [3], SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[77]))
    for s in (want_s,):
        for _ in range(1000):
            if not s.has_work:
                break
            step(s, forced={rid: f[s.requests[rid].num_generated]
                            for rid, f in forced.items()
                            if rid in s.requests and s.requests[rid].num_generated in f})
    want = want_s.__dict__["test_log"]
    outs, reasons, chained = chained_run(got_s, forced)
    assert (outs, reasons) == want
    assert reasons == {"long": "length", "short": "length", "eos": "stop", "stop": "stop"}
    assert chained > 5
    assert_idle(got_s)


def test_schedule_next_only_when_nothing_can_change() -> None:
    s = make(page_size=4)
    s.add("a", [1, 2, 3], greedy(5))
    s.add("b", [4, 5], greedy(2))
    batch = s.schedule()  # both prefills
    s.advance(batch)
    assert s.schedule_next(batch) is None  # not a decode step
    s.record(batch, ForwardOutput([10, 11]))
    batch = s.schedule()  # a at position 3, b at 2
    s.advance(batch)
    assert s.schedule_next(batch) is None  # b's token is its 2nd of 2: it ends
    s.record(batch, ForwardOutput([12, 13]))
    assert "b" not in s.requests
    batch = s.schedule()  # a alone at position 4: its next position needs a second page
    assert len(s.requests["a"].pages) == 2
    s.advance(batch)
    s.add("late", [1], greedy(3))
    assert s.schedule_next(batch) is None  # someone waits
    s.finish("late")
    nxt = s.schedule_next(batch)
    assert nxt is not None and len(nxt.seqs) == 1
    q = nxt.seqs[0]
    assert (q.token_ids, q.start_pos, q.num_generated) == ([PENDING_TOKEN], 5, 3)
    assert q.page_ids is s.requests["a"].pages and len(q.page_ids) == 2
    s.record(batch, ForwardOutput([14]))  # a's 3rd token of 5
    s.advance(nxt)
    nxt2 = s.schedule_next(nxt)  # it samples the 5th
    assert nxt2 is not None and nxt2.seqs[0].start_pos == 6
    s.record(nxt, ForwardOutput([15]))
    s.advance(nxt2)
    assert s.schedule_next(nxt2) is None  # a ends with the token nxt2 samples
    events = s.record(nxt2, ForwardOutput([16]))
    assert [(e.token_id, e.finish_reason) for e in events] == [(16, "length")]


def test_schedule_next_takes_the_page_of_the_next_position_or_gives_up() -> None:
    s = make(num_pages=2, page_size=4, max_context=8)
    s.add("a", [1, 2, 3], greedy(5))
    step(s)  # prefill: one page, token 3 sampled
    batch = s.schedule()  # decode at position 3: still the first page
    s.advance(batch)
    nxt = s.schedule_next(batch)  # position 4: the second and last page
    assert nxt is not None and s.pages.num_free == 0 and len(s.requests["a"].pages) == 2
    s.record(batch, ForwardOutput([5]))
    s.add("b", [1], greedy(1))  # waits for a page
    s.advance(nxt)
    assert s.schedule_next(nxt) is None
    s.record(nxt, ForwardOutput([6]))
    s.finish("b")
    s2 = make(num_pages=3, page_size=4, max_context=8)
    s2.add("a", [1, 2, 3], greedy(5))
    s2.add("b", [4, 5, 6], greedy(5))
    step(s2)  # both prefills, one page each
    batch = s2.schedule()  # both decode at position 3
    s2.advance(batch)
    assert s2.schedule_next(batch) is None  # position 4: two new pages, one left
    assert all(r.running for r in s2.running)  # nobody was preempted for it


def test_a_request_ended_between_steps_gets_no_chained_token() -> None:
    """An abort (or a stop string) between a chained step's launch and its record: its token
    is dropped and the request's pages and slot are free at once."""
    s = make()
    s.add("a", [1, 2, 3], greedy(8))
    s.add("b", [4, 5, 6], greedy(8))
    step(s)
    batch = s.schedule()
    s.advance(batch)
    nxt = s.schedule_next(batch)
    assert nxt is not None
    s.record(batch, ForwardOutput([7, 8]))
    s.finish("a")
    assert s.slots.num_used == 1
    s.advance(nxt)
    events = s.record(nxt, ForwardOutput([9, 10]))
    assert [(e.request_id, e.token_id) for e in events] == [("b", 10)]
    assert s.requests["b"].tokens == [4, 5, 6, next_token([4, 5, 6]), 8, 10]


# ------------------------------------------------------------------- fairness between groups


def alone_outputs(prompts: dict[str, list[int]], n: int) -> dict[str, list[int]]:
    out = {}
    for rid, p in prompts.items():
        s = make()
        s.add(rid, p, greedy(n))
        out[rid] = run_all(s)[0][rid]
    return out


def test_a_group_holding_every_seat_yields_one_to_a_newcomer() -> None:
    """Four choices of one request fill every seat; a later request gets a seat at once (the
    group's newest choice is preempted, recomputed later) and shares every step with one
    choice at a time; every output is what it is alone."""
    prompts = {f"big{i}": [1 + i, 2, 3] for i in range(4)} | {"short": [7, 8]}
    s = make(max_seqs=4, num_slots=4)
    for i in range(4):
        s.add(f"big{i}", prompts[f"big{i}"], greedy(30), group="big")
    for _ in range(3):
        step(s)
    s.add("short", prompts["short"], greedy(3))
    batch, _ = step(s)
    ids = [q.request_id for q in batch.seqs]
    assert "short" in ids and s.num_preemptions == 1
    assert not s.requests["big3"].running  # the newest choice of the group made way
    assert len(batch) == 2  # the big group runs one choice beside the newcomer's one
    ran = []
    while "short" in s.requests:
        batch, _ = step(s)
        assert len(batch) <= 2
        ran += [q.request_id for q in batch.seqs if q.request_id != "short"]
    assert len(set(ran)) == len(ran)  # the big group's choices take turns
    outputs, reasons = run_all(s)
    assert outputs == alone_outputs(prompts, 30) | {"short": alone_outputs(prompts, 3)["short"]}
    assert set(reasons.values()) == {"length"}
    assert_idle(s)


def test_admission_is_round_robin_between_groups() -> None:
    s = make(max_seqs=2, num_slots=8)
    for i in range(4):
        s.add(f"a{i}", [1, 2, 3], greedy(2), group="a")
    s.add("b0", [4, 5], greedy(2), group="b")
    order: list[str] = []
    for _ in range(50):
        if not s.has_work:
            break
        batch, _ = step(s)
        order += [q.request_id for q in batch.seqs if q.start_pos == 0]
    # b0 arrived last, but its group held no seat when the first seat came free
    assert order.index("b0") < order.index("a2") and s.num_preemptions == 0
    assert_idle(s)


def test_groups_holding_their_share_do_not_preempt_each_other() -> None:
    s = make(max_seqs=4, num_slots=4)
    for g in "ab":
        for i in range(3):
            s.add(f"{g}{i}", [1, 2, 3], greedy(6), group=g)
    outputs, _ = run_all(s)
    assert s.num_preemptions == 0  # a waits with 2 seats while b holds 2: no swap
    assert all(len(v) == 6 for v in outputs.values()) and len(outputs) == 6
    assert_idle(s)


def test_pages_running_out_preempt_the_group_holding_the_most() -> None:
    s = make(num_pages=9, page_size=4, max_context=16, max_seqs=4)
    s.add("solo", [1, 2, 3, 4], greedy(8))  # arrives first
    for i in range(2):
        s.add(f"g{i}", [5 + i, 6, 7, 8], greedy(8), group="g")
    s.add("late", [9, 10, 11, 12], greedy(8))  # the newest, but alone in its group
    for _ in range(6):
        step(s)
        if s.num_preemptions:
            break
    assert s.num_preemptions == 1
    assert not s.requests["g1"].running  # not "late", the newest request overall
    run_all(s)
    assert_idle(s)

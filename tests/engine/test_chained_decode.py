"""Chained decode steps (the next decode step launched before this one's tokens are read) on
the tiny model, on CPU through the decode graphs' static path (no capture): the runner's
chained launches give the serial path's tokens (greedy, seeded, biased, with logprobs, with
penalties); the engine with chaining gives what it gives without, through ends at different
steps (length, a stop token, a stop string), a seeded sampled request with penalties beside
greedy ones and the prefix cache's decode-time snapshots; an abort and a late arrival while
steps are chained leak nothing. (The scheduler's side, EOS included:
tests/engine/test_scheduler.py.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.core import PENDING_TOKEN, Batch, SamplingParams, ScheduledSeq
from tinyserve.engine.graph import DecodeGraphs
from tinyserve.engine.llm import LLM
from tinyserve.engine.runner import ModelRunner

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PAGES_PER_SEQ = 16


@pytest.fixture
def static_decode(monkeypatch):
    """CPU runners built with a graph padding slot decode through `DecodeGraphs` without
    capture, as CUDA runners replay their graphs."""
    init = ModelRunner.__init__

    def with_graphs(self, model, **kwargs):
        init(self, model, **kwargs)
        pad = kwargs.get("graph_pad_slot")
        if pad is not None and self.graphs is None:
            self.graphs = DecodeGraphs(model, page_size=self.page_size, pad_state_slot=pad)

    monkeypatch.setattr(ModelRunner, "__init__", with_graphs)


@contextlib.contextmanager
def _chaining(chain: bool) -> Iterator[None]:
    """Without `chain`, runners never chain (every step waits for the last one's tokens)."""
    with pytest.MonkeyPatch.context() as mp:
        if not chain:
            mp.setattr(ModelRunner, "can_chain", lambda self, batch: False)
        yield


def _record_chained(engine) -> list[tuple[str, ...]]:
    """Wrap the engine runner's `launch`: the request ids of every chained launch, in order."""
    launch, chained = engine.runner.launch, []

    def recording(batch, **kw):
        if kw.get("after") is not None:
            chained.append(tuple(s.request_id for s in batch.seqs))
        return launch(batch, **kw)

    engine.runner.launch = recording
    return chained


def _seqs(tokens: list[int], pos: list[int], params: SamplingParams = GREEDY,
          step: int = 0, histories: list[list[int]] | None = None) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"r{i}", [t], p, list(range(i * PAGES_PER_SEQ,
                                                        (i + 1) * PAGES_PER_SEQ)),
                         i, sample=True, params=params,
                         history=list(histories[i]) if histories else [], num_generated=step)
            for i, (t, p) in enumerate(zip(tokens, pos, strict=True))]


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=64)
# a bias reads no token history: greedy rows with one run the sampler on the graph's logits
BIASED = SamplingParams(temperature=0.0, max_tokens=64, logit_bias={7: 3.0, 11: -100.0})
# log-probabilities travel back in pinned copies beside the tokens: chained steps keep them
LOGPROBS = SamplingParams(temperature=0.8, seed=5, max_tokens=64, logprobs=3)
# penalties count tokens on the device: a chained step reads the counts of the one before
PENALISED = SamplingParams(temperature=0.7, seed=6, max_tokens=64, repetition_penalty=1.3,
                           presence_penalty=0.6, frequency_penalty=0.4)


@pytest.mark.parametrize("params", [GREEDY, SEEDED, BIASED, LOGPROBS, PENALISED],
                         ids=["greedy", "seeded", "bias", "logprobs", "penalties"])
def test_chained_launches_give_the_serial_tokens(static_decode, params) -> None:
    cfg, w = checkpoint("bf16")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (9, 14, 5)]

    def runner() -> ModelRunner:
        r = build_runner(cfg, w, num_pages=3 * PAGES_PER_SEQ, num_slots=4,
                         graph_pad_slot=3, keep_logits=False)
        assert r.graphs is not None
        return r

    def prefill(r: ModelRunner) -> list[int]:
        seqs = [ScheduledSeq(f"r{i}", p, 0, _seqs([0] * 3, [1] * 3)[i].page_ids, i,
                             sample=True, params=GREEDY) for i, p in enumerate(prompts)]
        return r.forward(Batch(seqs)).next_tokens

    pos = [len(p) for p in prompts]

    def serial(q: SamplingParams) -> tuple[list, list, list[int]]:
        """8 steps one after the other, the host's history complete at every step."""
        r = runner()
        first = prefill(r)
        hist = [p + [t] for p, t in zip(prompts, first, strict=True)]
        tokens, lps, last = [], [], first
        for i in range(8):
            out = r.forward(Batch(_seqs(last, [p + i for p in pos], q, i + 1, hist)))
            last = out.next_tokens
            tokens.append(last)
            lps.append(out.logprobs)
            hist = [h + [t] for h, t in zip(hist, last, strict=True)]
        return tokens, lps, first

    want, want_lp, first = serial(params)
    chained = runner()
    assert prefill(chained) == first
    got, got_lp = [], []
    hist = [p + [t] for p, t in zip(prompts, first, strict=True)]  # chained: never updated
    pending = chained.launch(Batch(_seqs(first, pos, params, 1, hist)))
    for i in range(1, 9):
        if i < 8:
            nxt = Batch(_seqs([PENDING_TOKEN] * 3, [p + i for p in pos], params, i + 1, hist))
            assert chained.can_chain(nxt)
            following = chained.launch(nxt, after=pending)
        got.append(pending.result().next_tokens)
        got_lp.append(pending.result().logprobs)
        pending = following
    assert got == want
    assert got_lp == want_lp
    if params.logprobs is not None:
        assert all(len(lp.top) == 3 and lp.token_id == t
                   for step, lps in zip(got, got_lp, strict=True)
                   for t, lp in zip(step, lps, strict=True))
    if params is PENALISED:  # the penalties changed the tokens
        plain = replace(params, repetition_penalty=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0)
        assert serial(plain)[0] != want
    chained.sampler.logits_hook = lambda logits, seqs: logits  # a hook may read anything
    assert not chained.can_chain(Batch(_seqs([PENDING_TOKEN] * 3, pos, params)))
    chained.sampler.logits_hook = None
    with pytest.raises(ValueError, match="chained launch"):  # a prefill cannot chain
        chained.launch(Batch([ScheduledSeq("r0", [1, 2], 40, list(range(16)), 0,
                                           sample=True, params=GREEDY)]), after=pending)


def _generate(path: str, prompts: list[list[int]], params: list[SamplingParams], *,
              chain: bool, **kwargs) -> tuple[list, int, object]:
    """(token ids, texts, finish reasons) per prompt, the number of chained launches and the
    engine's final stats."""
    with _chaining(chain), LLM(path, device="cpu", max_context=192, max_seqs=4,
                               max_num_batched_tokens=32, cuda_graphs=True, **kwargs) as llm:
        engine = llm.engine
        assert engine.runner.graphs is not None
        chained = _record_chained(engine)
        outs = llm.generate(prompts, params)
        stats = engine.stats()
    return ([(o.token_ids, o.text, o.finish_reason, o.logprobs) for o in outs], len(chained),
            stats)


def _close_logprobs(a, b, tol: float = 1e-4) -> bool:
    return len(a) == len(b) and all(
        x.token_id == y.token_id and abs(x.logprob - y.logprob) < tol
        and [t for t, _ in x.top] == [t for t, _ in y.top]
        and all(abs(p - q) < tol for (_, p), (_, q) in zip(x.top, y.top, strict=True))
        for x, y in zip(a, b, strict=True))


def test_engine_with_chained_decode_matches_the_serial_engine(
        tiny_checkpoint, static_decode) -> None:
    path = str(tiny_checkpoint("bf16"))
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (11, 30, 7, 19)]
    base = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for n in (40, 23, 31, 12)]
    first, _, _ = _generate(path, prompts, base, chain=False, prefix_cache=False)
    # Ends that only the sampled tokens reveal: a stop token (request 0's 9th token), a stop
    # string (a piece of request 1's text), and a sampled row with penalties (request 3)
    # beside greedy ones.
    stop_token = first[0][0][8]
    text = first[1][1]
    stop_text = text[len(text) // 2:len(text) // 2 + 2]
    params = [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                             stop_token_ids=[stop_token]),
              SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True, stop=stop_text),
              SamplingParams(max_tokens=31, temperature=0.0, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=12, temperature=0.9, seed=11, ignore_eos=True,
                             repetition_penalty=1.2, presence_penalty=0.5)]
    for cache in (False, True):
        want, none, _ = _generate(path, prompts, params, chain=False, prefix_cache=cache)
        got, chained, stats = _generate(path, prompts, params, chain=True,
                                        prefix_cache=cache)
        assert none == 0
        # NOTE: the two engines batch differently, so log-probabilities agree to rounding
        assert [g[:3] for g in got] == [w[:3] for w in want]
        assert _close_logprobs(got[2][3], want[2][3]) and len(got[2][3]) == 31
        assert got[2][0] == first[2][0]  # asking for logprobs changes no token
        assert got[0][2] == "stop" and got[0][0][-1] == stop_token
        assert got[1][2] == "stop" and stop_text not in got[1][1]
        assert chained >= 10  # the greedy rows chained once the sampled one was done
        assert stats.running == stats.waiting == 0
        assert stats.kv_pages_used == 0 and stats.state_slots_used == 0


def test_decode_time_snapshots_of_a_chained_engine_serve_the_next_turn(
        tiny_checkpoint, static_decode) -> None:
    """A snapshot taken while a chained step is queued holds the state after the step it
    follows (it is queued between the two): the second turn, resumed from a snapshot that
    turn 1's decode took, gives the tokens of an engine without a cache."""
    path = str(tiny_checkpoint("bf16"))
    g = torch.Generator().manual_seed(6)
    p1 = torch.randint(0, 400, (21,), generator=g).tolist()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def two_turns(chain: bool, cache: bool):
        with _chaining(chain), LLM(path, device="cpu", max_context=192, max_seqs=2,
                                   cuda_graphs=True, prefix_cache=cache) as llm:
            a1 = llm.generate([p1], params)[0].token_ids
            snapshot = _snapshot_state(llm, p1 + a1, 48) if cache else None
            p2 = p1 + a1 + [5, 6, 7]
            a2 = llm.engine.submit(p2, params).result()
        return a1, a2.token_ids, a2.cached_tokens, snapshot

    want = two_turns(chain=False, cache=False)
    got = two_turns(chain=True, cache=True)
    assert got[:2] == want[:2]
    assert got[2] == 48  # 21 + 30 - 1 = 50 tokens ran in turn 1; the last page boundary: 48
    (conv, rec), (want_conv, want_rec) = got[3]
    torch.testing.assert_close(conv, want_conv, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rec, want_rec, rtol=1e-4, atol=1e-4)


def _snapshot_state(llm: LLM, tokens: list[int], n: int):
    """(conv, recurrent) of the prefix cache's snapshot after `tokens[:n]`, and the same
    state computed by teacher forcing the `n` tokens in a free slot."""
    engine = llm.engine

    def read():
        match = engine.prefix_cache.match(tokens, n)
        assert match.num_tokens == n and match.snapshot_slot is not None
        states = engine.runner.model.states
        snap = (states.conv[:, match.snapshot_slot].clone(),
                states.recurrent[:, match.snapshot_slot].clone())
        s = engine.scheduler
        pages, slot = s.alloc_pages(s.pages_for(n)), s.slots.alloc(1)[0]
        try:
            engine.runner.logits(tokens[:n], page_ids=pages, state_slot=slot)
            ref = states.conv[:, slot].clone(), states.recurrent[:, slot].clone()
        finally:
            s.pages.free(pages)
            s.slots.free([slot])
        return snap, ref

    return engine.call(read)


def test_abort_and_late_arrival_while_steps_are_chained(
        tiny_checkpoint, static_decode) -> None:
    """A request aborted while its next step is already queued ends at once with its pages
    and slot back; a request that arrives while steps are chained is admitted and finishes;
    nothing leaks; the survivors chain again afterwards."""
    g = torch.Generator().manual_seed(7)
    p_long, p_late = (torch.randint(0, 400, (n,), generator=g).tolist() for n in (17, 9))
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    with LLM(str(tiny_checkpoint("bf16")), device="cpu", max_context=192, max_seqs=4,
             cuda_graphs=True, prefix_cache=False) as llm:
        engine = llm.engine
        chained = _record_chained(engine)
        long = engine.submit(p_long, greedy, request_id="long")
        other = engine.submit(p_long[:5], SamplingParams(max_tokens=40, temperature=0.7,
                                                         seed=1, ignore_eos=True),
                              request_id="other")
        stream = iter(long)
        for _ in range(6):
            next(stream)
        late = engine.submit(p_late, SamplingParams(max_tokens=12, temperature=0.0,
                                                    ignore_eos=True), request_id="late")
        for _ in range(4):
            next(stream)
        long.abort()
        outs = list(stream)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        done_late, done_other = late.result(timeout=120), other.result(timeout=120)
        stats = engine.stats()
    assert (done_late.finish_reason, len(done_late.token_ids)) == ("length", 12)
    assert (done_other.finish_reason, len(done_other.token_ids)) == ("length", 40)
    assert any("long" in c for c in chained) and any("late" in c for c in chained)
    assert any(c == ("other",) for c in chained)  # chained on after the others ended
    assert stats.running == stats.waiting == 0
    assert stats.kv_pages_used == 0 and stats.state_slots_used == 0
    assert stats.requests_aborted == 1 and stats.requests_finished == 2


@pytest.mark.requires_cuda
def test_cuda_engine_chains_greedy_and_sampled_rows(tiny_checkpoint) -> None:
    """On CUDA (captured graphs), the engine chains greedy, seeded sampled and penalised rows
    and gives the tokens of the engine without chaining (a near-tie of the tiny model
    aside)."""
    path = str(tiny_checkpoint("bf16"))
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, 400, (n,), generator=g).tolist() for n in (13, 29, 6)]
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=4,
                             ignore_eos=True),
              SamplingParams(max_tokens=24, temperature=0.6, top_k=20, seed=9,
                             ignore_eos=True, repetition_penalty=1.2, presence_penalty=0.4,
                             frequency_penalty=0.3)]
    outs = {}
    for chain in (False, True):
        with _chaining(chain), LLM(path, device="cuda", max_context=256, max_seqs=4) as llm:
            engine = llm.engine
            assert engine.runner.graphs is not None
            chained = _record_chained(engine)
            outs[chain] = [c.token_ids for c in llm.generate(prompts, params)]
            assert engine.runner.graphs.num_graphs >= 1
            assert (len(chained) >= 10) == chain, len(chained)
    assert all(len(t) == 24 for t in outs[True])
    same = sum(a == b for x, y in zip(outs[False], outs[True], strict=True)
               for a, b in zip(x, y, strict=True))
    assert same >= 0.9 * 24 * len(prompts), outs


def test_chained_steps_across_a_graph_capacity_boundary(static_decode) -> None:
    """A chained step whose sequence outgrows the graph's context capacity (256 -> 512 tokens)
    builds the next graph entry inside the chained launch and still reads its input token
    from the previous step's output (held by the other entry)."""
    cfg, w = checkpoint("bf16")
    prompt = torch.randint(0, 500, (250,), generator=torch.Generator().manual_seed(9)).tolist()
    pages = list(range(160))  # 640 tokens of 4

    def runner() -> ModelRunner:
        return build_runner(cfg, w, num_pages=160, num_slots=2, graph_pad_slot=1,
                            keep_logits=False)

    def seq(token: int, pos: int) -> ScheduledSeq:
        return ScheduledSeq("r", [token], pos, pages, 0, sample=True, params=GREEDY)

    serial, chained = runner(), runner()
    first = [r.forward(Batch([ScheduledSeq("r", prompt, 0, pages, 0, sample=True,
                                            params=GREEDY)])).next_tokens[0]
             for r in (serial, chained)]
    assert first[0] == first[1]
    want, token = [], first[0]
    for pos in range(250, 262):
        token = serial.forward(Batch([seq(token, pos)])).next_tokens[0]
        want.append(token)
    got, pending = [], chained.launch(Batch([seq(first[1], 250)]))
    for pos in range(251, 263):
        following = (chained.launch(Batch([seq(PENDING_TOKEN, pos)]), after=pending)
                     if pos < 262 else None)
        got.append(pending.result().next_tokens[0])
        pending = following
    assert got == want
    assert len(chained.graphs._entries) == 2  # capacities 256 and 512

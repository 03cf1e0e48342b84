"""The engine loop over a fake runner (a bigram 'model' through the real sampler), with and
without the overlap hook (a step's outputs emitted during the next step's forward)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tinyserve.core import Batch, ForwardOutput, SamplingParams
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.loop import Engine, EngineParts
from tinyserve.engine.runner_api import Runner
from tinyserve.engine.sampler import Sampler
from tinyserve.engine.scheduler import RequestRejected

V = 128  # ASCII byte tokens
EOS = 0
POISON = 127


class ByteTokenizer:
    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i for i in ids if i != EOS).decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


class Finished:
    """The `PendingStep` of a step computed at launch."""

    device_tokens = None

    def __init__(self, output: ForwardOutput) -> None:
        self.output = output

    def result(self) -> ForwardOutput:
        return self.output


class FakeRunner(Runner):
    """Bigram model: logits depend on the last token only. Raises on POISON."""

    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(0)
        self.table = torch.randn(V, V, generator=gen) * 3
        self.table[:, EOS] = -1e4  # never ends by itself
        self.table[:, POISON] = -1e4  # nor samples the poison (only a test's prompt holds it)
        self.sampler = Sampler()
        self.batches: list[Batch] = []
        self.delay = 0.0

    def launch(self, batch: Batch, *, after=None) -> Finished:
        self.batches.append(batch)
        if any(POISON in s.token_ids for s in batch.seqs):
            raise RuntimeError("poisoned input")
        time.sleep(self.delay)
        sampling = [s for s in batch.seqs if s.sample]
        logits = self.table[[s.token_ids[-1] for s in sampling]]
        tokens = iter(self.sampler(logits, sampling).tolist()) if sampling else iter(())
        return Finished(ForwardOutput([next(tokens) if s.sample else None
                                       for s in batch.seqs]))

    def logits(self, ids, *, page_ids=None, state_slot=None, chunk_size=None):
        assert len(page_ids) * 4 >= len(ids) and state_slot >= 0
        return self.table[ids]


class OverlapRunner(FakeRunner):
    """FakeRunner that runs `ModelRunner`'s overlap hook, called once the step's tokens are
    known (its 'device work' queued) and before launch returns. Counts the tokens the engine
    emitted from inside the hook."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self.engine: Engine | None = None
        self.emitted_in_hook = 0

    def launch(self, batch: Batch, *, after=None) -> Finished:
        out = super().launch(batch)
        if self.overlap_hook is not None:
            before = self.engine._counts["generation_tokens"]
            self.overlap_hook()
            self.emitted_in_hook += self.engine._counts["generation_tokens"] - before
        return out


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])


def make_engine(num_pages=64, max_seqs=4, budget=8, max_context=128,
                overlap=False) -> Engine:
    runner = OverlapRunner() if overlap else FakeRunner()
    parts = EngineParts(runner=runner, tokenizer=ByteTokenizer(),
                        model_config=SimpleNamespace(vocab_size=V),
                        num_kv_pages=num_pages, num_state_slots=max_seqs,
                        max_context=max_context, eos_token_ids=(EOS,))
    cfg = EngineConfig(model="fake", max_seqs=max_seqs, max_num_batched_tokens=budget,
                       page_size=4)
    engine = Engine(parts, cfg)
    runner.engine = engine
    return engine


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, **kw)


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert (s.running, s.waiting, s.kv_pages_used, s.state_slots_used) == (0, 0, 0, 0)


PROMPTS = [[72, 105], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [50] * 20, [99]]


@OVERLAP
def test_batched_equals_alone_and_returns_to_idle(overlap: bool) -> None:
    with make_engine(overlap=overlap) as engine:
        alone = [engine.submit(p, greedy(12)).result() for p in PROMPTS]
        handles = [engine.submit(p, greedy(12)) for p in PROMPTS]
        together = [h.result() for h in handles]
        assert [o.token_ids for o in together] == [o.token_ids for o in alone]
        assert all(o.finish_reason == "length" and o.completion_tokens == 12 for o in together)
        assert [o.prompt_tokens for o in together] == [len(p) for p in PROMPTS]
        assert together[0].text == ByteTokenizer().decode(together[0].token_ids)
        assert max(len(b) for b in engine.runner.batches) > 1  # really batched
        if overlap:  # most outputs went out while the next step ran
            assert engine.runner.emitted_in_hook > 60  # of 192
        stats = engine.stats()
        assert stats.requests_finished == 8 and stats.generation_tokens_total == 96
        assert len(stats.ttft_seconds) == 8 and len(stats.itl_seconds) == 88
        assert_idle(engine)


@OVERLAP
def test_seeded_sampling_reproduces_under_batching(overlap: bool) -> None:
    with make_engine(overlap=overlap) as engine:
        params = SamplingParams(max_tokens=10, seed=7)
        first = engine.submit(PROMPTS[0], params).result().token_ids
        noise = [engine.submit(p, SamplingParams(max_tokens=10)) for p in PROMPTS[1:]]
        again = engine.submit(PROMPTS[0], params).result().token_ids
        [h.result() for h in noise]
        assert first == again


@OVERLAP
def test_async_iteration(overlap: bool) -> None:
    async def main(engine: Engine) -> list[str]:
        async def one(prompt):
            chunks = []
            async for out in engine.submit(prompt, greedy(6)):
                chunks.append(out)
            return chunks

        results = await asyncio.gather(*(one(p) for p in PROMPTS))
        return [[c.finished for c in r] for r in results]

    with make_engine(overlap=overlap) as engine:
        finished_flags = asyncio.run(main(engine))
    assert all(flags == [False] * 5 + [True] for flags in finished_flags)


@OVERLAP
def test_abort_frees_resources_mid_stream(overlap: bool) -> None:
    with make_engine(overlap=overlap) as engine:
        engine.runner.delay = 0.002
        h = engine.submit(PROMPTS[1], greedy(100))
        other = engine.submit(PROMPTS[0], greedy(5))
        first = h.get(timeout=10)
        assert not first.finished
        h.abort()
        outs = list(h)
        assert outs[-1].finish_reason == "abort" and outs[-1].finished
        assert other.result(timeout=10).finish_reason == "length"
        engine.abort("no-such-request")
        time.sleep(0.05)
        assert_idle(engine)
        assert engine.stats().requests_aborted == 1


@OVERLAP
def test_failing_request_fails_alone(overlap: bool) -> None:
    with make_engine(overlap=overlap) as engine:
        good = [engine.submit(p, greedy(8)) for p in PROMPTS[:2]]
        bad = engine.submit([5, POISON, 6], greedy(8))
        out = bad.result(timeout=10)
        assert out.finish_reason == "error" and "poisoned input" in out.error
        results = [h.result(timeout=10) for h in good]
        assert all(r.finish_reason == "length" for r in results)
        ref = [engine.submit(p, greedy(8)).result().token_ids for p in PROMPTS[:2]]
        assert [r.token_ids for r in results] == ref
        assert engine.stats().requests_failed == 1
        assert_idle(engine)


@OVERLAP
def test_failing_request_past_its_first_chunk_fails_alone(overlap: bool) -> None:
    """The poison in the second prefill chunk: after the shared step fails, the request runs
    alone until past that chunk (it fails there, alone), not just for its first chunk, after
    which the shared step would fail again, and again."""
    with make_engine(overlap=overlap) as engine:
        good = [engine.submit(p, greedy(8)) for p in PROMPTS[:2]]
        bad = engine.submit([5] * 10 + [POISON, 6], greedy(8))  # budget 8: chunks 0-7, 8-11
        out = bad.result(timeout=10)
        assert out.finish_reason == "error" and "poisoned input" in out.error
        assert all(h.result(timeout=10).finish_reason == "length" for h in good)
        assert engine.stats().requests_failed == 1 and engine.stats().preemptions <= 3
        assert_idle(engine)


def test_rejections_are_immediate() -> None:
    engine = make_engine(max_context=32)
    with pytest.raises(RequestRejected, match="exceeds the context limit of 32"):
        engine.submit([1] * 30, greedy(8))
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.submit([V + 5], greedy(1))
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.submit([1], greedy(1))


@OVERLAP
def test_stop_strings_and_stop_tokens_through_the_engine(overlap: bool) -> None:
    script = list(b"hello STOP world")

    def force(logits, seqs):
        out = torch.full_like(logits, -1e9)
        for i, s in enumerate(seqs):
            out[i, script[s.num_generated % len(script)]] = 0.0
        return out

    with make_engine(overlap=overlap) as engine:
        engine.set_logits_hook(force)
        out = engine.submit([1], SamplingParams(max_tokens=30, stop=["STOP"])).result()
        assert (out.text, out.finish_reason, out.completion_tokens) == ("hello ", "stop", 10)
        out = engine.submit([1], greedy(30, stop_token_ids=[ord("w")])).result()
        assert (out.text, out.finish_reason) == ("hello STOP ", "stop")
        out = engine.submit([1], greedy(8, stop=["xyz"])).result()
        assert (out.text, out.finish_reason) == ("hello ST", "length")
        engine.set_logits_hook(None)
        assert_idle(engine)


def test_logits_runs_on_the_loop_thread() -> None:
    with make_engine() as engine:
        got = engine.logits([1, 2, 3])
        assert torch.equal(got, engine.runner.table[[1, 2, 3]])
        with pytest.raises(RequestRejected):
            engine.logits([1] * 200)


@OVERLAP
def test_shutdown_aborts_pending_and_is_thread_safe(overlap: bool) -> None:
    engine = make_engine(overlap=overlap).start()
    engine.runner.delay = 0.01
    handles = []

    def submit_many():
        for p in PROMPTS * 3:
            handles.append(engine.submit(p, greedy(50)))

    threads = [threading.Thread(target=submit_many) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    time.sleep(0.05)
    engine.shutdown()
    outs = [h.result(timeout=10) for h in handles]
    assert len(outs) == 36
    assert {o.finish_reason for o in outs} <= {"abort", "length"}
    assert all(o.finished for o in outs)


def test_a_group_filling_every_seat_does_not_starve_a_later_request() -> None:
    """The choices of one request (a group) hold every seat for 100 tokens each; a 3-token
    request submitted later ends long before them, and each choice still gives what it
    gives alone (the one preempted for the newcomer is recomputed)."""
    with make_engine(max_seqs=4) as engine:
        alone = engine.submit([1, 2, 3], greedy(100, ignore_eos=True)).result().token_ids
        engine.runner.delay = 0.002
        big = [engine.submit([1, 2, 3], greedy(100, ignore_eos=True), group="big")
               for _ in range(4)]
        while engine.stats().generation_tokens_total < 100 + 8:  # every choice decodes
            time.sleep(0.005)
        short = engine.submit([4, 5], greedy(3, ignore_eos=True)).result()
        assert short.completion_tokens == 3
        assert not any(h.finished for h in big)
        assert engine.stats().preemptions >= 1
        assert [h.result().token_ids for h in big] == [alone] * 4
        assert_idle(engine)

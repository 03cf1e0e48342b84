"""`ModelRunner.launch`: the step's device work (forward, sampling, the token copy) is queued
before the host work that overlaps it (the experts provider's `after_launch`, the overlap
hook), the tokens come back through two alternating buffers, neither rewritten while a copy
into it may be in flight (a fake event that stays pending until waited for), and the tokens
are the serial path's (CPU, tiny model; offloaded experts through the torch
references)."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.engine import runner as runner_mod
from tinyserve.offload import gpu_cache
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


class FakeEvent:
    """A copy that stays in flight until someone waits for it: `record` of a new copy while
    the last one was not waited for is the bug under test."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name, self.pending = log, name, False

    def record(self, stream=None) -> None:
        assert not self.pending, f"{self.name}: a copy was queued while the last was in flight"
        self.pending = True
        self.log.append(f"record {self.name}")

    def query(self) -> bool:
        return not self.pending

    def synchronize(self) -> None:
        self.pending = False
        self.log.append(f"sync {self.name}")


@pytest.fixture(scope="module")
def tiny():
    return checkpoint("modelopt")


def _offloaded_runner(cfg, w, log: list[str], monkeypatch):
    monkeypatch.setattr(runner_mod, "host_event", lambda device: FakeEvent(log, "tokens"))
    names = iter(("victims", "log"))
    monkeypatch.setattr(gpu_cache, "host_event", lambda device: FakeEvent(log, next(names)))
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cpu",
                                      dtype=torch.float32)
    return build_runner(cfg, w, num_slots=2, poison=False, experts=experts), experts


def _seq(tokens: list[int], pos: int) -> ScheduledSeq:
    return ScheduledSeq("r", tokens, pos, list(range(32)), 0, sample=True, params=GREEDY)


def test_host_work_runs_after_the_step_is_queued_and_before_the_wait(tiny, monkeypatch):
    cfg, w = tiny
    log: list[str] = []
    runner, experts = _offloaded_runner(cfg, w, log, monkeypatch)
    sampler, after = runner.sampler, experts.after_launch

    runner.sampler = lambda logits, seqs, **kw: (log.append("sample")
                                                 or sampler(logits, seqs, **kw))
    experts.after_launch = lambda: log.append("after_launch") or after()
    runner.overlap_hook = lambda: log.append("hook")
    prompt = torch.randint(0, 500, (11,), generator=torch.Generator().manual_seed(3)).tolist()
    out = runner.forward(Batch([_seq(prompt, 0)]))
    tokens = [out.next_tokens[0]]
    for i in range(6):
        log.clear()
        pending = runner.launch(Batch([_seq([tokens[-1]], len(prompt) + i)]))
        steps = [e for e in log if e in ("sample", "record tokens", "after_launch", "hook")]
        assert steps == ["sample", "record tokens", "after_launch", "hook"], log
        # the log copy is queued before the step's work, the policy reads it after
        order = [log.index(e) for e in ("record log", "sample", "after_launch", "sync log")]
        assert order == sorted(order), log
        assert "sync tokens" not in log  # nobody waited for this step's tokens yet
        tokens.append(pending.result().next_tokens[0])
        assert log[-1] == "sync tokens"
    # Three launches without a wait (the tokens are the same each time, as in a timing
    # loop): the first two take one buffer each, the third reads the first's tokens out
    # before reusing its buffer, and every result stands.
    seq = _seq([tokens[-1]], len(prompt) + 6)
    log.clear()
    a, b = runner.launch(Batch([seq])), runner.launch(Batch([seq]))
    assert "sync tokens" not in log
    c = runner.launch(Batch([seq]))
    assert log.count("sync tokens") == 1 and a.done and not b.done
    assert a.result() is a.result()
    assert a.result().next_tokens == b.result().next_tokens == c.result().next_tokens


def test_launch_tokens_equal_the_serial_path(tiny) -> None:
    cfg, w = tiny
    fast = build_runner(cfg, w, num_pages=32, num_slots=2)
    slow = build_runner(cfg, w, num_pages=32, num_slots=2)
    prompt = torch.randint(0, 500, (9,), generator=torch.Generator().manual_seed(5)).tolist()
    got, want = [], []
    for i in range(8):
        ids = prompt if i == 0 else [got[-1]]
        pos = 0 if i == 0 else len(prompt) + i - 1
        got.append(fast.launch(Batch([_seq(ids, pos)])).result().next_tokens[0])
        ids = prompt if i == 0 else [want[-1]]
        logits = slow.run(slow.prepare(Batch([_seq(ids, pos)])))
        want.append(int(logits.argmax(-1)[0]))
    assert got == want


@pytest.mark.requires_cuda
def test_sampling_never_waits_for_the_device() -> None:
    """Penalties, temperature, top-k/p, min-p and seeded noise queue their small host tables
    without a stream synchronisation: the host work after a launch really overlaps it. So
    do the penalties' device-side counts, built and then advanced by a chained call."""
    from tinyserve.engine.sampler import Sampler

    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=50, repetition_penalty=1.2,
                             presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, min_p=0.1, seed=4)]
    seqs = [ScheduledSeq(f"s{i}", [1], 5, [0], i, sample=True, params=p,
                         history=[1, 2, 3, 4, 5, 3], num_generated=2)
            for i, p in enumerate(params)]
    logits = torch.randn(3, 1000, device="cuda")
    Sampler()(logits, seqs)  # warm-up (library handles, generators)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    sampler = Sampler()
    try:
        tokens = sampler(logits, seqs)
        chained = sampler(logits, seqs, chained=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert tokens.shape == chained.shape == (3,) and tokens.device.type == "cuda"

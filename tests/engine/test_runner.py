"""ModelRunner: the forward tensors it builds, sampling rows, teacher-forced logits, and a
scheduler-driven run (chunked prefill, mixed batches) equal to each request run alone."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.engine.scheduler import Scheduler
from tinyserve.kv.allocator import PageAllocator

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def tiny():
    return checkpoint("bf16", "tiny")


def test_prepare_tensors(tiny) -> None:
    runner = build_runner(*tiny, page_size=4)
    seqs = [ScheduledSeq("a", [5, 6, 7], 0, [3], 1, sample=True),
            ScheduledSeq("b", [9], 6, [2, 0], 0, sample=True),
            ScheduledSeq("c", [1, 2], 4, [7, 5, 6], 2, sample=False)]
    ctx = runner.prepare(Batch(seqs))
    assert ctx.input_ids.tolist() == [5, 6, 7, 9, 1, 2]
    assert ctx.input_ids_cpu.device.type == "cpu"  # what a host embedding table gathers from
    assert ctx.input_ids_cpu.tolist() == [5, 6, 7, 9, 1, 2]
    assert ctx.positions.tolist() == [0, 1, 2, 6, 4, 5]
    assert ctx.cu_seqlens.tolist() == [0, 3, 4, 6] and ctx.cu_seqlens.dtype == torch.int32
    assert ctx.prefix_lens.tolist() == [0, 6, 4] and ctx.seq_lens.tolist() == [3, 7, 6]
    assert ctx.page_table.tolist() == [[3, 0, 0], [2, 0, 0], [7, 5, 6]]
    assert ctx.slot_mapping.tolist() == [12, 13, 14, 2, 20, 21]
    assert ctx.state_slots.tolist() == [1, 0, 2]
    assert ctx.logits_indices.tolist() == [2, 3]
    assert ctx.q_lens_cpu == [3, 1, 2] and ctx.prefix_lens_cpu == [0, 6, 4]
    assert not ctx.is_decode
    assert runner.prepare(seqs, all_logits=True).logits_indices.tolist() == list(range(6))
    with pytest.raises(ValueError, match="cannot hold"):
        runner.prepare([ScheduledSeq("d", [1] * 5, 0, [1], 0, sample=True)])


def test_forward_samples_only_flagged_rows(tiny) -> None:
    calls = []

    def sampler(logits, seqs, chained=False):
        calls.append((logits.shape, [s.request_id for s in seqs]))
        return torch.tensor([11, 22][:len(seqs)])

    runner = build_runner(*tiny, page_size=4)
    runner.sampler = sampler
    seqs = [ScheduledSeq("a", [5, 6, 7], 0, [3], 1, sample=False),
            ScheduledSeq("b", [8, 9], 0, [2], 0, sample=True)]
    out = runner.forward(Batch(seqs))
    assert out.next_tokens == [None, 11]
    assert calls == [(torch.Size([1, tiny[0].vocab_size]), ["b"])]
    assert out.logits.shape == (1, tiny[0].vocab_size) and torch.isfinite(out.logits).all()
    out = runner.forward(Batch([ScheduledSeq("a", [1], 3, [3], 1, sample=False)]))
    assert out.next_tokens == [None] and len(calls) == 1


def test_logits_chunked_equals_whole_and_frees_slot(tiny) -> None:
    runner = build_runner(*tiny, page_size=4, num_slots=2)
    ids = torch.randint(0, 500, (23,), generator=torch.Generator().manual_seed(0)).tolist()
    whole = runner.logits(ids)
    assert runner.model.states.num_free == 2
    torch.testing.assert_close(runner.logits(ids, chunk_size=5), whole, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="KV pages"):
        runner.logits([1] * 200)


def test_scheduler_driven_run_equals_alone(tiny) -> None:
    """Three requests through the real scheduler (prefill chunks of at most 8 tokens, mixed
    with decodes) produce the greedy tokens of each request's own teacher-forced logits."""
    cfg, w = tiny
    num_pages, page_size, num_slots = 24, 4, 3
    runner = build_runner(cfg, w, num_pages=num_pages, page_size=page_size,
                          num_slots=num_slots)
    sched = Scheduler(pages=PageAllocator(num_pages), slots=PageAllocator(num_slots),
                      page_size=page_size, max_context=64, max_seqs=3,
                      max_num_batched_tokens=8)
    gen = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(0, 500, (n,), generator=gen).tolist()
               for i, n in enumerate((11, 3, 17))}
    for rid, p in prompts.items():
        sched.add(rid, p, GREEDY)
    outputs: dict[str, list[int]] = {rid: [] for rid in prompts}
    steps = 0
    while sched.has_work and steps < 100:
        batch = sched.schedule()
        for ev in sched.update(batch, runner.forward(batch)):
            outputs[ev.request_id].append(ev.token_id)
        steps += 1
    alone = build_runner(cfg, w, num_pages=num_pages, page_size=page_size)
    for rid, p in prompts.items():
        out = outputs[rid]
        assert len(out) == GREEDY.max_tokens
        logits = alone.logits(p + out[:-1])[len(p) - 1:]
        top2 = logits.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 1e-3
        want = logits.argmax(-1).tolist()
        for i in range(len(out)):
            if not clear[i]:
                break
            assert out[i] == want[i], (rid, i)

"""Decode over static buffers (`engine.graph`): buckets, the packed inputs, and the static
padded forward equal to the eager one on CPU; on CUDA, graph replay against eager decode on
the tiny model (bf16 and NVFP4 weights, bf16 and ISO3 KV, 1 and 3 sequences) with one host
synchronisation per step."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.model.hf_tiny import checkpoint
from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.engine.graph import DecodeGraphs, batch_bucket, capacity_pages
from tinyserve.engine.runner import ModelRunner
from tinyserve.engine.sampler import Sampler
from tinyserve.kv.bf16 import BF16KVBackend, causal_attention
from tinyserve.kv.registry import create_kv_backend
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.model.qwen35 import Qwen35Model

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PAGE, PAGES_PER_SEQ, NUM_SEQS = 4, 16, 3
PAD_SLOT = NUM_SEQS  # the pool has one more slot than sequences


def _runner(fmt: str, kv: str, *, device: str, dtype: torch.dtype,
            graphs: bool = False, embed_device: str | None = None) -> ModelRunner:
    cfg, w = checkpoint(fmt, "hd128")
    backend = create_kv_backend(kv, layer_ids=list(cfg.full_attention_layers),
                                num_kv_heads=cfg.num_kv_heads,
                                num_q_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                                num_pages=NUM_SEQS * PAGES_PER_SEQ, page_size=PAGE,
                                device=device, dtype=dtype)
    states = GDNStatePool.for_config(cfg, NUM_SEQS + 1, device=device, dtype=dtype)
    for t in (states.conv, states.recurrent, *_kv_tensors(backend)):
        t.fill_(255 if t.dtype == torch.uint8 else float("nan"))  # poison
    model = Qwen35Model(cfg, w, kv=backend, states=states, device=device, dtype=dtype,
                        embed_device=embed_device)
    return ModelRunner(model, page_size=PAGE, cuda_graphs=graphs, graph_pad_slot=PAD_SLOT)


def _kv_tensors(backend) -> list[torch.Tensor]:
    return [backend.buffer] if hasattr(backend, "buffer") else [backend.k_cache, backend.v_cache]


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, 500, (length,), generator=g).tolist()
            for length in (9, 14, 5)[:n]]


def _pages(i: int) -> list[int]:
    return list(range(i * PAGES_PER_SEQ, (i + 1) * PAGES_PER_SEQ))


def _decode_seqs(last: list[int], pos: list[int]) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"r{i}", [t], p, _pages(i), i, sample=True, params=GREEDY)
            for i, (t, p) in enumerate(zip(last, pos, strict=True))]


def _prefill(runner: ModelRunner, prompts: list[list[int]]) -> list[int]:
    seqs = [ScheduledSeq(f"r{i}", p, 0, _pages(i), i, sample=True, params=GREEDY)
            for i, p in enumerate(prompts)]
    return runner.forward(Batch(seqs)).next_tokens


def test_buckets_and_capacity() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 17, 256)] == [1, 2, 4, 8, 8, 16, 24,
                                                                      256]
    assert batch_bucket(257) is None
    assert capacity_pages(1, 16) == 16 and capacity_pages(256, 16) == 16
    assert capacity_pages(257, 16) == 32 and capacity_pages(3000, 4) == 1024


@pytest.mark.parametrize("budget", [1 << 30, 1], ids=["one-call", "row-by-row"])
def test_bf16_batched_decode_equals_per_sequence(budget: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`BF16KVBackend.decode` (what graphs run) against the per-sequence eager attention, with
    NaN in every unwritten slot and a page table wider than the lengths."""
    monkeypatch.setattr("tinyserve.kernels.attention.paged_ref.DECODE_GATHER_BYTES", budget)
    g = torch.Generator().manual_seed(3)
    kv = BF16KVBackend(layer_ids=[0], num_kv_heads=2, num_q_heads=4, head_dim=8, num_pages=12,
                       page_size=PAGE, device="cpu", dtype=torch.float32)
    kv.k_cache.fill_(float("nan"))
    kv.v_cache.fill_(float("nan"))
    lens, tables = [5, 13, 1], [[4, 0, 0], [7, 2, 9, 11], [3]]
    for length, pages in zip(lens, tables, strict=True):
        t = torch.arange(length)
        slots = torch.tensor(pages)[t // PAGE] * PAGE + t % PAGE
        kv.write(0, torch.randn(length, 2, 8, generator=g), torch.randn(length, 2, 8, generator=g),
                 slots)
    q = torch.randn(3, 4, 8, generator=g)
    width = 6
    table = torch.tensor([p + [0] * (width - len(p)) for p in tables], dtype=torch.int32)
    got = kv.decode(0, q, table, torch.tensor(lens, dtype=torch.int32), 24, 0.3)
    for b, (length, pages) in enumerate(zip(lens, tables, strict=True)):
        kb, vb = kv.gather(0, torch.tensor(pages), length)
        want = causal_attention(q[b:b + 1], kb, vb, length - 1, 0.3)
        torch.testing.assert_close(got[b:b + 1], want, rtol=1e-5, atol=1e-5)


def test_runner_keeps_cpu_eager() -> None:
    runner = _runner("bf16", "bf16", device="cpu", dtype=torch.float32, graphs=True)
    assert runner.graphs is None


def test_static_inputs_match_prepare() -> None:
    runner = _runner("bf16", "bf16", device="cpu", dtype=torch.float32)
    graphs = DecodeGraphs(runner.model, page_size=PAGE, pad_state_slot=PAD_SLOT)
    seqs = [ScheduledSeq("a", [11], 9, _pages(0), 2, sample=True),
            ScheduledSeq("b", [12], 30, _pages(1), 0, sample=True),
            ScheduledSeq("c", [13], 4, _pages(2), 1, sample=True)]
    entry = graphs._build(4, capacity_pages(31, PAGE))
    graphs._fill(entry, seqs)
    graphs._upload(entry)
    ref, ctx = runner.prepare(Batch(seqs)), entry.ctx
    for name in ("input_ids", "positions", "slot_mapping", "state_slots", "prefix_lens",
                 "seq_lens"):
        assert getattr(ctx, name)[:3].tolist() == getattr(ref, name).tolist(), name
    assert ctx.input_ids[3] == 0 and ctx.slot_mapping[3] == -1
    assert ctx.state_slots[3] == PAD_SLOT and ctx.seq_lens[3] == 1
    assert ctx.page_table.shape == (4, 64) and ctx.page_table[3].eq(0).all()
    for b, s in enumerate(seqs):
        used = s.start_pos // PAGE + 1
        assert ctx.page_table[b, :used].tolist() == s.page_ids[:used]
        assert ctx.page_table[b, used:].eq(0).all()
    assert ctx.is_decode and ctx.seq_len_bound == 256
    with pytest.raises(ValueError, match="cannot hold"):
        graphs.run([ScheduledSeq("d", [1], 200, [0], 0, sample=True)])
    with pytest.raises(ValueError, match="padding state slot"):
        graphs.run([ScheduledSeq("e", [1], 3, [0], PAD_SLOT, sample=True)])
    with pytest.raises(ValueError, match="pad_state_slot"):
        DecodeGraphs(runner.model, page_size=PAGE, pad_state_slot=NUM_SEQS + 1)


@pytest.mark.parametrize("kv", ["bf16", "iso3"])
def test_static_padded_decode_equals_eager_on_cpu(kv: str) -> None:
    """Three sequences in a bucket of four, host lists as placeholders: the static forward
    gives the eager logits and leaves the same KV pages and GDN states (the padded row writes
    only the padding page and the spare slot)."""
    eager = _runner("bf16", kv, device="cpu", dtype=torch.float32)
    static = _runner("bf16", kv, device="cpu", dtype=torch.float32)
    graphs = DecodeGraphs(static.model, page_size=PAGE, pad_state_slot=PAD_SLOT)
    prompts = _prompts(NUM_SEQS)
    last = _prefill(eager, prompts)
    assert _prefill(static, prompts) == last
    pos = [len(p) for p in prompts]
    for _ in range(3):
        seqs = _decode_seqs(last, pos)
        want = eager.run(eager.prepare(Batch(seqs)))
        got, tokens = graphs.run(seqs)
        assert got.shape == want.shape and torch.equal(tokens, got.argmax(-1))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        last = want.argmax(-1).tolist()
        pos = [p + 1 for p in pos]
    real = slice(0, NUM_SEQS)
    for a, b in ((eager.model.states.conv, static.model.states.conv),
                 (eager.model.states.recurrent, static.model.states.recurrent)):
        torch.testing.assert_close(b[:, real], a[:, real], rtol=1e-4, atol=1e-4)
    used = NUM_SEQS * PAGES_PER_SEQ  # every page but the backend's padding page
    for a, b in zip(_kv_tensors(eager.model.kv), _kv_tensors(static.model.kv), strict=True):
        if a.dtype == torch.uint8:
            written = ~a[:, :, :used * PAGE].eq(255)
            assert torch.equal(written, ~b[:, :, :used * PAGE].eq(255))
        else:
            mask = ~a[:, :used].isnan()
            assert torch.equal(mask, ~b[:, :used].isnan())
            torch.testing.assert_close(b[:, :used][mask], a[:, :used][mask])


# --------------------------------------------------------------------------------------------
# Through the runner (CPU: the static path without capture; CUDA: captured graphs)


def _greedy_run(runner: ModelRunner, prompts: list[list[int]], steps: int,
                syncs: list[int] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    last = _prefill(runner, prompts)
    tokens = [[t] for t in last]
    pos = [len(p) for p in prompts]
    logits = []
    for _ in range(steps):
        batch = Batch(_decode_seqs(last, pos))
        if syncs is None:
            out = runner.forward(batch)
        else:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = runner.forward(batch)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs.append(sum("synchroniz" in str(w.message) for w in caught))
        logits.append(out.logits.float().cpu())
        last = out.next_tokens
        for i, t in enumerate(last):
            tokens[i].append(t)
        pos = [p + 1 for p in pos]
    return tokens, logits


def test_runner_decode_branch_on_cpu() -> None:
    """`runner.forward` through the static decode path (no capture on CPU) generates the
    eager runner's greedy tokens, sampling from copies of the static logits."""
    eager = _runner("bf16", "bf16", device="cpu", dtype=torch.float32)
    static = _runner("bf16", "bf16", device="cpu", dtype=torch.float32)
    static.graphs = DecodeGraphs(static.model, page_size=PAGE, pad_state_slot=PAD_SLOT)
    prompts = _prompts(NUM_SEQS)
    want, want_logits = _greedy_run(eager, prompts, 4)
    got, got_logits = _greedy_run(static, prompts, 4)
    assert got == want
    assert got_logits[0].data_ptr() != got_logits[1].data_ptr()
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_runner_samples_in_the_graph_when_greedy() -> None:
    """Greedy rows without penalties take the static path's own argmax (no logits copy with
    `keep_logits=False`); a row with a repetition penalty goes through the sampler, as
    eagerly."""
    eager = _runner("bf16", "bf16", device="cpu", dtype=torch.float32)
    static = _runner("bf16", "bf16", device="cpu", dtype=torch.float32)
    static.graphs = DecodeGraphs(static.model, page_size=PAGE, pad_state_slot=PAD_SLOT)
    static.keep_logits = False
    calls: list[int] = []

    class Counting(Sampler):
        def __call__(self, logits, seqs, **kw):
            calls.append(len(seqs))
            return super().__call__(logits, seqs, **kw)

    static.sampler = Counting()
    prompts = _prompts(NUM_SEQS)
    last = _prefill(eager, prompts)
    assert _prefill(static, prompts) == last
    calls.clear()
    pos = [len(p) for p in prompts]
    penalised = SamplingParams(temperature=0.0, repetition_penalty=1.3, max_tokens=64)
    for step in range(4):
        seqs = _decode_seqs(last, pos)
        if step >= 2:  # the last row penalised from here on
            s = seqs[-1]
            seqs[-1] = ScheduledSeq(s.request_id, s.token_ids, s.start_pos, s.page_ids,
                                    s.state_slot, sample=True, params=penalised,
                                    history=prompts[-1] + [s.token_ids[0]])
        want = eager.forward(Batch(seqs))
        got = static.forward(Batch(seqs))
        assert got.next_tokens == want.next_tokens
        assert (got.logits is None) == (step < 2)
        last = want.next_tokens
        pos = [p + 1 for p in pos]
    assert calls == [NUM_SEQS, NUM_SEQS]  # the sampler ran for the penalised steps only


@pytest.mark.requires_cuda
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("kv", ["bf16", "iso3"])
@pytest.mark.parametrize("fmt", ["bf16", "modelopt"])
def test_graph_decode_equals_eager(fmt: str, kv: str, batch: int) -> None:
    """Greedy decode with replayed graphs gives the eager tokens (a near-tie of the eager
    logits may flip a token: then that sequence stops being compared), logits within bf16
    noise, and one host synchronisation per step once the graph is captured."""
    prompts, steps = _prompts(batch), 10
    eager = _runner(fmt, kv, device="cuda", dtype=torch.bfloat16, graphs=False)
    graph = _runner(fmt, kv, device="cuda", dtype=torch.bfloat16, graphs=True)
    assert eager.graphs is None and graph.graphs is not None
    want, want_logits = _greedy_run(eager, prompts, steps)
    syncs: list[int] = []
    got, got_logits = _greedy_run(graph, prompts, steps, syncs)
    assert graph.graphs.num_graphs >= 1, "no decode graph was captured"
    # step 0 captures; the step's one wait, for its sampled tokens, is on the copy's event
    # (`PendingOutput.result`), which the sync debug mode does not count
    assert syncs[1:] == [0] * (steps - 1), syncs
    assert_same_greedy(got, want, got_logits, want_logits)


def assert_same_greedy(got: list[list[int]], want: list[list[int]],
                       got_logits: list[torch.Tensor], want_logits: list[torch.Tensor]) -> None:
    """Graph tokens equal the eager ones, logits within bf16 noise; a token may flip only at
    a near-tie of the eager logits (then that sequence stops being compared)."""
    for i in range(len(want)):
        assert got[i][0] == want[i][0]  # prefill is eager in both
        for step in range(len(want_logits)):
            ref, out = want_logits[step][i], got_logits[step][i]
            assert torch.isfinite(out).all()
            diff = (out - ref).abs().max().item()
            assert diff <= 0.05 * ref.abs().max().item(), (i, step, diff)
            if got[i][step + 1] != want[i][step + 1]:
                # a flip needs the eager top-2 margin within the two logits' changes
                top2 = ref.topk(2).values
                assert (top2[0] - top2[1]).item() <= 2 * diff, (i, step, "not a near-tie")
                break


@pytest.mark.requires_cuda
def test_graph_reused_per_bucket() -> None:
    """Steps of the same bucket replay one graph; another batch size captures another."""
    runner = _runner("bf16", "bf16", device="cuda", dtype=torch.bfloat16, graphs=True)
    prompts = _prompts(2)
    last = _prefill(runner, prompts)
    pos = [len(p) for p in prompts]
    for _ in range(3):
        last = runner.forward(Batch(_decode_seqs(last, pos))).next_tokens
        pos = [p + 1 for p in pos]
    assert runner.graphs.num_graphs == 1
    seqs = [ScheduledSeq("x", [1], 40, _pages(2), 2, sample=True, params=GREEDY)]
    runner.forward(Batch(seqs))
    assert runner.graphs.num_graphs == 2


@pytest.mark.requires_cuda
def test_engine_with_graphs_matches_without(tiny_checkpoint) -> None:
    """The whole engine (scheduler, prefix cache, spare state slot from `engine.build`) with
    decode graphs generates what it generates without them, and captures at least one."""
    from tinyserve.engine.llm import LLM

    path = str(tiny_checkpoint("bf16"))
    prompts = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 3, "42"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for graphs in (False, True):
        with LLM(path, device="cuda", max_context=256, max_seqs=4, cuda_graphs=graphs) as llm:
            outs[graphs] = [c.token_ids for c in llm.generate(prompts, params)]
            runner = llm.engine.runner
            assert (runner.graphs is not None) == graphs
            if graphs:
                assert runner.graphs.num_graphs >= 1
    assert all(len(t) == 24 for t in outs[True])
    same = sum(a == b for x, y in zip(outs[False], outs[True], strict=True)
               for a, b in zip(x, y, strict=True))
    assert same >= 0.9 * 24 * len(prompts), outs  # greedy ties aside, the same tokens

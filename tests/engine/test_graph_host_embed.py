"""Decode graphs with the embedding table in host RAM (`embed_device="cpu"`). Registered with
CUDA (the default on a GPU, `embed_mapped`), the graph's embedding kernel reads the rows from
it by token ids on the device; otherwise ("host ids") the static forward starts from hidden
states the host gathers into the packed pinned input buffer.

CPU: the packed rows (poisoned first) and the static path without capture against the eager
runner. CUDA, both modes: graph replay against eager decode, the eager forward with a host
table free of host synchronisations, and the engine capturing graphs when its memory plan
puts the embedding on the host (and chaining its steps when the table is registered).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator

import pytest
import torch

from tests.engine.test_graph import (
    NUM_SEQS,
    PAD_SLOT,
    PAGE,
    _decode_seqs,
    _greedy_run,
    _pages,
    _prefill,
    _prompts,
    _runner,
    assert_same_greedy,
)
from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.engine.graph import DecodeGraphs, capacity_pages


def _seqs(tokens: list[int], starts: list[int]) -> list[ScheduledSeq]:
    return [ScheduledSeq(f"s{i}", [t], p, _pages(i), i, sample=True)
            for i, (t, p) in enumerate(zip(tokens, starts, strict=True))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_hidden_rows_follow_the_int_inputs(dtype: torch.dtype) -> None:
    """The [B, H] rows sit word-aligned after the int inputs of the token-id layout (which
    are unchanged), hold the table's rows of the step's tokens, zero for padded rows, and the
    one copy of the packed buffer moves them to the graph's input."""
    model = _runner("bf16", "bf16", device="cpu", dtype=dtype).model
    host = DecodeGraphs(model, page_size=PAGE, pad_state_slot=PAD_SLOT, host_embedding=True)
    plain = DecodeGraphs(model, page_size=PAGE, pad_state_slot=PAD_SLOT)
    assert not plain.host_embedding  # the table is on the model's device (CPU)
    pages = capacity_pages(31, PAGE)
    entry, ref = host._build(4, pages), plain._build(4, pages)
    assert ref.hidden is None and entry.hidden is not None
    H = model.config.hidden_size
    assert entry.hidden.shape == (4, H) and entry.hidden.dtype == dtype
    assert entry.hidden.untyped_storage().data_ptr() == entry.device_buf.untyped_storage(
    ).data_ptr()
    entry.host.fill_(-1)  # poison: NaN in every float view
    entry.device_buf.fill_(-1)
    seqs = _seqs([11, 499, 11], [9, 30, 4])
    host._fill(entry, seqs)
    host._upload(entry)
    plain._fill(ref, seqs)
    words = ref.host.numel()
    assert torch.equal(entry.host[:words], ref.host)
    assert entry.host.numel() == words + 4 * H * dtype.itemsize // 8
    assert torch.equal(entry.hidden[:3], model.embed_tokens[[11, 499, 11]])
    assert entry.hidden[3].eq(0).all()
    host._fill(entry, seqs[:1])  # fewer sequences: the rows of the dropped ones become zeros
    host._upload(entry)
    assert torch.equal(entry.hidden[0], model.embed_tokens[11])
    assert entry.hidden[1:].eq(0).all()


@pytest.mark.parametrize("batch", [1, NUM_SEQS])
def test_host_embedding_static_decode_equals_eager_on_cpu(batch: int,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """Through `runner.forward`, the static path from gathered hidden states gives the eager
    runner's greedy tokens and logits, and embeds no token ids itself."""
    eager = _runner("bf16", "iso3", device="cpu", dtype=torch.float32)
    static = _runner("bf16", "iso3", device="cpu", dtype=torch.float32)
    static.graphs = DecodeGraphs(static.model, page_size=PAGE, pad_state_slot=PAD_SLOT,
                                 host_embedding=True)
    calls = {"embed": 0, "embed_host": 0}
    model = static.model
    for name in calls:
        monkeypatch.setattr(model, name, _counted(calls, name, getattr(model, name)))
    prompts, steps = _prompts(batch), 4
    want, want_logits = _greedy_run(eager, prompts, steps)
    got, got_logits = _greedy_run(static, prompts, steps)
    assert got == want
    for a, b in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert calls["embed"] == 1  # the (eager) prefill only
    assert calls["embed_host"] == steps + 1  # every step, and the padded warm-up fill


def _counted(calls: dict[str, int], name: str, fn):
    def spy(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)

    return spy


# --------------------------------------------------------------------------------------------
# CUDA


MODES = pytest.mark.parametrize("mapped", [True, False], ids=["mapped", "host_ids"])


def _set_mode(monkeypatch, mapped: bool) -> None:
    """"host_ids": the host table's registration fails, as when the driver refuses it."""
    if not mapped:
        from tinyserve.model import qwen35

        monkeypatch.setattr(qwen35, "register_mapped", lambda t, what: False)


@pytest.mark.requires_cuda
@MODES
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("fmt", ["bf16", "modelopt"])
def test_host_embedding_graph_decode_equals_eager(fmt: str, batch: int, mapped: bool,
                                                  monkeypatch) -> None:
    """`embed_device="cpu"`: replayed graphs (embedding from the registered table on the
    device, or started from the host-gathered rows) give the greedy tokens of eager decode,
    with one host synchronisation per step."""
    _set_mode(monkeypatch, mapped)
    prompts, steps = _prompts(batch), 8
    eager = _runner(fmt, "iso3", device="cuda", dtype=torch.bfloat16, embed_device="cpu")
    graph = _runner(fmt, "iso3", device="cuda", dtype=torch.bfloat16, graphs=True,
                    embed_device="cpu")
    assert graph.model.embed_tokens.device.type == "cpu"
    assert graph.model.embed_mapped == mapped
    assert graph.graphs is not None and graph.graphs.host_embedding == (not mapped)
    want, want_logits = _greedy_run(eager, prompts, steps)
    syncs: list[int] = []
    got, got_logits = _greedy_run(graph, prompts, steps, syncs)
    assert graph.graphs.num_graphs >= 1 and not graph.graphs.failed
    # step 0 captures; the step's one wait, for its sampled tokens, is on the copy's event
    # (`PendingOutput.result`), which the sync debug mode does not count
    assert syncs[1:] == [0] * (steps - 1), syncs
    assert_same_greedy(got, want, got_logits, want_logits)


@pytest.mark.requires_cuda
@MODES
@pytest.mark.parametrize("fmt", ["bf16", "modelopt"])
def test_host_embedding_eager_forward_does_not_sync(fmt: str, mapped: bool,
                                                    monkeypatch) -> None:
    """The eager forward with the table on the host reads it on the device, or gathers from
    `ctx.input_ids_cpu`: no host synchronisation inside it (sync debug mode "error"), for
    decode and for the embedding of a prefill; and its logits equal those of the table on
    the device."""
    _set_mode(monkeypatch, mapped)
    host = _runner(fmt, "iso3", device="cuda", dtype=torch.bfloat16, embed_device="cpu")
    dev = _runner(fmt, "iso3", device="cuda", dtype=torch.bfloat16)
    assert host.model.embed_on_host and not dev.model.embed_on_host
    prompts = _prompts(NUM_SEQS)
    last = _prefill(dev, prompts)
    assert _prefill(host, prompts) == last
    ids = torch.tensor(prompts[1])
    if mapped:  # ids on the device (copied before the check), the gather kernel built
        ids = ids.cuda()
        host.model.embed(ids)
    with _no_sync():
        rows = host.model.embed(ids)  # [T, H]
    assert torch.equal(rows, dev.model.embed(ids.cuda()))
    pos = [len(p) for p in prompts]
    for step in range(4):  # step 0 unchecked: kernel builds and autotuning synchronise
        batch = Batch(_decode_seqs(last, pos))
        ctx, ref_ctx = host.prepare(batch), dev.prepare(batch)
        torch.cuda.synchronize()
        with _no_sync() if step else contextlib.nullcontext():
            got = host.model.forward(ctx)
        want = dev.run(ref_ctx)
        diff = (got - want).abs().max().item()
        assert diff <= 1e-2 * want.abs().max().item(), (step, diff)
        last = want.argmax(-1).tolist()  # both continue from the same tokens
        pos = [p + 1 for p in pos]


@contextlib.contextmanager
def _no_sync() -> Iterator[None]:
    """A host synchronisation in the block raises (torch's CUDA sync debug mode)."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.requires_cuda
@MODES
@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_engine_captures_graphs_with_host_embedding(tiny_checkpoint, monkeypatch,
                                                    offload: bool, mapped: bool) -> None:
    """An engine whose memory plan puts the embedding on the host (experts resident, or
    offloaded behind a small cache as in a 6 GiB plan) captures decode graphs and generates
    the tokens of the all-resident engine (fp32); with the table registered its decode
    steps chain."""
    from tests.engine.test_chained_decode import _record_chained
    from tinyserve.engine import build
    from tinyserve.engine.llm import LLM

    _set_mode(monkeypatch, mapped)

    path = str(tiny_checkpoint("modelopt"))
    prompts = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 2, "42"]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_context=128, max_seqs=3,
                  max_num_batched_tokens=32, cuda_graphs=True)

    def generate() -> tuple[list[list[int]], object]:
        gc.collect()
        torch.cuda.empty_cache()
        with LLM(path, **common) as llm:
            chained.append(_record_chained(llm.engine))
            return [c.token_ids for c in llm.generate(prompts, params)], llm.engine.runner

    chained: list[list] = []

    want, _ = generate()
    real = build.plan_engine

    def plan(config, path=None, **kwargs):
        p = real(config, path, **kwargs)
        if offload:
            return dataclasses.replace(p, embed_device="cpu", expert_cache=True,
                                       expert_slots=p.experts_per_layer + 4)
        return dataclasses.replace(p, embed_device="cpu")

    monkeypatch.setattr(build, "plan_engine", plan)
    got, runner = generate()
    assert runner.model.embed_tokens.device.type == "cpu"
    assert runner.graphs is not None and runner.graphs.host_embedding == (not mapped)
    assert runner.graphs.num_graphs >= 1 and not runner.graphs.failed
    assert got == want
    assert bool(chained[-1]) == mapped, len(chained[-1])  # some steps chained

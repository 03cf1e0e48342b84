"""CUDA: decode graphs with the expert-cache policy deferred to after each replay (the
overlapped step) on the tiny NVFP4 model with a cache smaller than the experts give the
tokens of eager decode with the policy at the step boundary; a graph decode step waits for
the device once (the sampled tokens), never for the policy's log copy; through the engine,
the same tokens as the all-resident engine."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tinyserve.core import Batch, SamplingParams, ScheduledSeq
from tinyserve.engine.llm import LLM
from tinyserve.engine.runner import ModelRunner
from tinyserve.model.config import load_config
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore

pytestmark = pytest.mark.requires_cuda

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)
PAGES = 32


def _runner(cfg, w, *, graphs: bool) -> ModelRunner:
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cuda",
                                      dtype=torch.float32,
                                      max_ids=16 * cfg.num_experts_per_tok)
    assert experts.capturable
    # state slot 1 pads the graph's batch
    return build_runner(cfg, w, num_pages=PAGES, num_slots=2, poison=False, device="cuda",
                        experts=experts, cuda_graphs=graphs, graph_pad_slot=1)


def _decode(runner: ModelRunner, prompt: list[int], n: int,
            syncs: list[int] | None = None) -> list[int]:
    pages = list(range(PAGES))
    seq = ScheduledSeq("r", prompt, 0, pages, 0, sample=True, params=GREEDY)
    tokens = [runner.forward(Batch([seq])).next_tokens[0]]
    for i in range(n - 1):
        seq = ScheduledSeq("r", [tokens[-1]], len(prompt) + i, pages, 0, sample=True,
                           params=GREEDY)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                tokens.append(runner.forward(Batch([seq])).next_tokens[0])
            finally:
                torch.cuda.set_sync_debug_mode("default")
        if syncs is not None:
            syncs.append(sum("synchroniz" in str(m.message) for m in seen))
    return tokens


def test_graph_decode_with_the_deferred_policy_matches_eager() -> None:
    cfg, w = checkpoint("modelopt")
    prompt = torch.randint(0, 500, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    want = _decode(_runner(cfg, w, graphs=False), prompt, 24)
    runner = _runner(cfg, w, graphs=True)
    syncs: list[int] = []
    got = _decode(runner, prompt, 24, syncs)
    assert runner.graphs is not None and runner.graphs.num_graphs >= 1
    assert got == want
    experts = runner.model.experts
    assert experts.stats.misses > cfg.num_layers * cfg.num_experts  # it evicted
    experts.begin_step()
    assert experts.cache.policy.where == experts.cache.resident()
    # After the capture: no synchronising copy or call in a graph step (the token wait is
    # an event, which the sync debug mode does not count; the log copy is asynchronous).
    assert max(syncs[3:]) == 0, syncs


def test_engine_with_graphs_and_the_deferred_policy_matches_resident(tiny_checkpoint) -> None:
    ckpt = tiny_checkpoint("modelopt")
    cfg = load_config(ckpt)
    prompts = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 2]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    common = dict(device="cuda", dtype="float32", max_context=128, max_seqs=2,
                  max_num_batched_tokens=32)
    with LLM(str(ckpt), **common) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(str(ckpt), expert_cache_slots=cfg.num_experts + 4, **common) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.runner.graphs.num_graphs >= 1
        stats = llm.engine.stats()
    assert got == want
    assert stats.expert_cache_misses > cfg.num_layers * cfg.num_experts

"""Prefill streaming through the engine on CPU (continuous batching: chunks of one prompt
beside other sequences' decode tokens, streamed and cache-path steps alternating): the same
greedy tokens as the all-resident engine."""

from __future__ import annotations

import pytest

from tinyserve.core import SamplingParams
from tinyserve.engine.llm import LLM
from tinyserve.model.config import load_config
from tinyserve.offload import prefetch

PROMPTS = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 3, "42"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _generate(ckpt, **kwargs):
    with LLM(str(ckpt), device="cpu", max_context=96, max_seqs=3, max_num_batched_tokens=16,
             **kwargs) as llm:
        out = llm.generate(PROMPTS, GREEDY)
        return [c.token_ids for c in out], llm.engine.runner.model.experts


@pytest.mark.parametrize("fmt", ["bf16", "modelopt"])
def test_engine_with_streamed_prefill_generates_the_resident_tokens(tiny_checkpoint, monkeypatch,
                                                                     fmt: str) -> None:
    ckpt = tiny_checkpoint(fmt)
    cfg = load_config(ckpt)
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    resident, _ = _generate(ckpt)
    streamed_calls = []
    slot_ids = prefetch.LayerStreamer.slot_ids

    def counting(self, layer, topk_ids):
        streamed_calls.append(layer)
        return slot_ids(self, layer, topk_ids)

    monkeypatch.setattr(prefetch.LayerStreamer, "slot_ids", counting)
    tokens, experts = _generate(ckpt, expert_cache_slots=2 * E + 1)
    assert len(streamed_calls) >= 2 * cfg.num_layers  # at least two streamed steps
    s = experts.streamer
    assert isinstance(s, prefetch.LayerStreamer)
    assert 16 * k >= s.min_pairs  # a full 16-token step streams, a decode-only step does not
    assert tokens == resident
    stats = experts.stats
    # Streamed layers copied all E experts; the cache path ran too (decode steps).
    assert stats.misses >= cfg.num_layers * E and stats.hits > 0
    assert stats.h2d_bytes == stats.misses * experts.cache.store.bytes_per_expert

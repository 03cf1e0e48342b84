"""The overlapped engine step on the tiny model (CPU): offloaded experts with the
cache (torch references, a cache smaller than the experts) and the policy deferred to after
each launch give the resident engine's tokens and texts; the host mirror agrees with the
device afterwards."""

from __future__ import annotations

from tinyserve.core import SamplingParams
from tinyserve.engine.llm import LLM
from tinyserve.model.config import load_config
from tinyserve.offload.provider import OffloadedExperts

PROMPTS = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 2, "42"]
PARAMS = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, seed=3),
          SamplingParams(max_tokens=14, temperature=0.8, seed=5, ignore_eos=True)]


def _generate(ckpt, **kwargs):
    with LLM(str(ckpt), device="cpu", max_context=96, max_seqs=3, max_num_batched_tokens=16,
             **kwargs) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        experts = llm.engine.runner.model.experts
        mirror_ok = None
        if isinstance(experts, OffloadedExperts):
            def check() -> bool:
                experts.begin_step()
                return experts.cache.policy.where == experts.cache.resident()
            mirror_ok = llm.engine.call(check)
        return [(o.token_ids, o.text, o.finish_reason) for o in outs], llm.engine.stats(), \
            mirror_ok


def test_overlapped_offloaded_engine_generates_the_resident_tokens(tiny_checkpoint) -> None:
    ckpt = tiny_checkpoint("modelopt")
    cfg = load_config(ckpt)
    want, _, _ = _generate(ckpt)
    got, stats, mirror_ok = _generate(ckpt, expert_cache_slots=cfg.num_experts + 2)
    assert got == want
    assert mirror_ok
    assert stats.expert_cache_misses > cfg.num_layers * cfg.num_experts  # it evicted
    assert 0.0 < stats.expert_cache_hit_rate < 1.0

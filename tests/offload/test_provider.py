"""An offloaded tiny model (cache smaller than the experts) generates exactly the tokens of the
fully resident one, with the host-driven and the device-driven (torch reference) cache."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tests.offload.helpers import greedy_generate
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore


@pytest.fixture(scope="module")
def tiny():
    cfg, w = checkpoint("modelopt")
    prompt = torch.randint(0, 500, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    ref_tokens, ref_logits = greedy_generate(build_runner(cfg, w, num_slots=2), prompt, 24)
    return cfg, w, prompt, ref_tokens, ref_logits


def test_offloaded_model_generates_the_resident_tokens(tiny) -> None:
    cfg, w, prompt, ref_tokens, ref_logits = tiny
    store = HostExpertStore.from_weights(w, cfg)
    total = cfg.num_layers * cfg.num_experts  # 32
    experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cpu",
                                      dtype=torch.float32)
    tokens, logits = greedy_generate(build_runner(cfg, w, num_slots=2, experts=experts), prompt, 24)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5 * ref_logits.abs().max())
    stats = experts.stats
    assert stats.misses > total  # the cache really evicted and reloaded
    assert stats.h2d_bytes == stats.misses * store.bytes_per_expert
    # The cache state is consistent: every resident expert sits in the slot it claims.
    cache = experts.cache
    for (layer, e), slot in cache.resident().items():
        row = layer * cfg.num_experts + e
        assert torch.equal(cache.slots.w13[slot], store.slots.w13[row])
        assert torch.equal(cache.slots.w2_scale[slot], store.slots.w2_scale[row])


def test_mirror_follows_the_device(tiny) -> None:
    cfg, w, prompt, _, _ = tiny
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, 12, device="cpu", dtype=torch.float32)
    greedy_generate(build_runner(cfg, w, num_slots=2, experts=experts), prompt, 6)
    experts.begin_step()
    assert experts.cache.policy.where == experts.cache.resident()
    assert 0.0 < experts.stats.hit_rate < 1.0
    assert set(experts.stats.as_dict()["layer_hit_rate"]) == set(range(cfg.num_layers))


def test_eager_call_after_a_replay_keeps_the_mirror(tiny) -> None:
    """A graph replay runs every layer's lookup behind the provider's back (begin_step, then
    lookups only): the next eager forward must still fold that step's log into the policy
    before overwriting it, or the mirror loses loads and drifts from the device table."""
    cfg, w, prompt, _, _ = tiny
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cpu",
                                      dtype=torch.float32)
    runner = build_runner(cfg, w, num_slots=2, experts=experts)
    greedy_generate(runner, prompt, 2)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):  # replay-like steps: lookups that bypass the provider's forward
        experts.begin_step()
        for layer in range(cfg.num_layers):
            ids = torch.randperm(cfg.num_experts, generator=g)[:cfg.num_experts_per_tok]
            experts.cache.lookup(layer, ids.view(1, -1))
        greedy_generate(runner, prompt, 2)  # eager prefill + decode right after the "replay"
        experts.begin_step()
        assert experts.cache.policy.where == experts.cache.resident()

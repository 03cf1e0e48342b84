"""The offloaded provider on a GPU: the output of all-resident slots, and no host
synchronisation inside a step (torch's sync debug mode turns any into an error)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.offload.helpers import (
    assert_resident_outputs,
    random_experts,
    resident_layers,
    step_without_sync,
)
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore

pytestmark = pytest.mark.requires_cuda


@pytest.mark.parametrize("tokens", [1, 4, 64], ids=lambda n: f"N{n}")
def test_offloaded_equals_resident_without_host_sync(tokens: int) -> None:
    L, E, H, F, k = 4, 16, 256, 128, 4
    cfg = SimpleNamespace(num_layers=L, num_experts=E, hidden_size=H, moe_intermediate_size=F)
    w = random_experts(L, E, H, F)
    store = HostExpertStore.from_weights(w, cfg)
    assert store.pinned
    resident = resident_layers(w, L, E)
    experts = OffloadedExperts.create(store, E + 3, device="cuda", max_ids=64 * k)
    assert experts.cache.use_triton
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(6):
        experts.begin_step()
        xs, ids, wts, outs = step_without_sync(experts, tokens, L, E, H, k, g)
        assert_resident_outputs(outs, xs, ids, wts, resident)
    experts.begin_step()
    assert experts.stats.misses > E  # evictions happened
    assert experts.cache.policy.where == experts.cache.resident()


def test_unpinned_store_serves_through_the_references() -> None:
    """A store the driver could not register (pageable memory) is served by the torch
    references on the device: the outputs of all-resident slots, never captured in a graph."""
    L, E, H, F, k = 2, 8, 256, 128, 2
    cfg = SimpleNamespace(num_layers=L, num_experts=E, hidden_size=H, moe_intermediate_size=F)
    w = random_experts(L, E, H, F)
    store = HostExpertStore.from_weights(w, cfg, pin=False)
    assert not store.pinned
    resident = resident_layers(w, L, E)
    experts = OffloadedExperts.create(store, E + 1, device="cuda", max_ids=16 * k)
    assert not experts.cache.use_triton and not experts.capturable
    g = torch.Generator(device="cuda").manual_seed(2)
    for tokens in (1, 4, 1):
        experts.begin_step()
        xs = [torch.randn(tokens, H, device="cuda", dtype=torch.bfloat16, generator=g)
              for _ in range(L)]
        ids = [torch.rand(tokens, E, device="cuda", generator=g).topk(k).indices
               for _ in range(L)]
        wts = [torch.rand(tokens, k, device="cuda", generator=g) for _ in range(L)]
        outs = [experts.forward(la, xs[la], ids[la], wts[la]) for la in range(L)]
        assert_resident_outputs(outs, xs, ids, wts, resident)
    experts.begin_step()
    assert experts.stats.misses > E  # evictions happened


def _decode_syncs(cfg, weights, experts) -> int:
    """Host synchronisations of one eager tiny-model decode step (after a prefill and a decode
    warm-up), counted with torch's sync debug mode."""
    import warnings

    from tests.model.hf_tiny import build_runner
    from tinyserve.core import Batch, SamplingParams, ScheduledSeq

    runner = build_runner(cfg, weights, num_pages=16, num_slots=2, poison=False,
                          dtype=torch.bfloat16, device="cuda", experts=experts)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    pages = list(range(16))
    token = runner.forward(Batch([ScheduledSeq("r", list(range(1, 12)), start_pos=0,
                                               page_ids=pages, state_slot=0, sample=True,
                                               params=params)])).next_tokens[0]
    counts = []
    for pos in range(11, 14):
        seq = ScheduledSeq("r", [token], start_pos=pos, page_ids=pages, state_slot=0,
                           sample=True, params=params)
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                token = runner.forward(Batch([seq])).next_tokens[0]
            finally:
                torch.cuda.set_sync_debug_mode("default")
        counts.append(sum("synchroniz" in str(w.message) for w in seen))
    return counts[-1]


def test_offloaded_decode_step_adds_no_per_layer_sync() -> None:
    """A whole-model eager decode step with offloaded experts synchronises with the host at
    most twice more than with resident experts (begin_step's log copy at the step boundary),
    never once per layer."""
    from tests.model.hf_tiny import checkpoint

    cfg, w = checkpoint("modelopt")
    resident = _decode_syncs(cfg, w, None)
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cuda",
                                      max_ids=16 * cfg.num_experts_per_tok)
    assert experts.cache.use_triton
    offloaded = _decode_syncs(cfg, w, experts)
    assert offloaded <= resident + 2 < resident + cfg.num_layers, (offloaded, resident)


def test_victim_staging_buffer_waits_for_its_last_upload() -> None:
    # The constructor uploads the victim lists from a pinned staging buffer without waiting;
    # preload_all (no synchronisation in between) rewrites that buffer, and must first wait
    # for the upload, which here queues behind ~0.1 s of GPU sleep.
    L, E, H, F = 2, 8, 256, 128
    cfg = SimpleNamespace(num_layers=L, num_experts=E, hidden_size=H, moe_intermediate_size=F)
    store = HostExpertStore.from_weights(random_experts(L, E, H, F), cfg)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    slept = torch.cuda.Event()
    slept.record()
    experts = OffloadedExperts.create(store, L * E, device="cuda")
    experts.cache.preload_all()
    assert slept.query(), "the staging buffer was rewritten while its upload was pending"
    torch.cuda.synchronize()
    order = experts.cache.policy.victim_array(experts.cache._victim_n)
    want = torch.from_numpy(order[experts.cache._victim_perm]).to(torch.int32)
    assert torch.equal(experts.cache.victims.cpu(), want)

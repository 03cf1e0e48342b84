"""Prefill streaming (offload.prefetch) on CPU: the tiny model with a cache of two layers'
experts generates the fully resident tokens; the region / copy / wait bookkeeping; the cache's
slot eviction."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tests.offload.helpers import greedy_generate
from tinyserve.offload import prefetch
from tinyserve.offload.gpu_cache import DeviceExpertCache
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore


class LogQueue(prefetch.CopyQueue):
    """Copies at once (the earliest time the marks allow on CPU) and logs every operation."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple] = []

    def mark(self):
        ev = super().mark()
        self.log.append(("mark", ev))
        return ev

    def copy(self, after, copies):
        ev = super().copy(after, copies)
        self.log.append(("copy", after, ev, copies[0][1].data_ptr()))
        return ev

    def wait(self, event):
        self.log.append(("wait", event))


class DeferredQueue(prefetch.CopyQueue):
    """Runs a copy only when the compute stream waits for it (the latest legal time): a
    missing or wrong wait leaves stale slots behind and changes the output."""

    def __init__(self) -> None:
        super().__init__()
        self.pending: dict[int, list] = {}

    def copy(self, after, copies):
        ev = self._event()
        self.pending[ev] = copies
        return ev

    def wait(self, event):
        for ev in sorted(e for e in self.pending if e <= event):
            for dst, src in self.pending.pop(ev):
                dst.copy_(src)


@pytest.fixture(scope="module")
def tiny():
    cfg, w = checkpoint("modelopt")
    prompt = torch.randint(0, 500, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    ref = {chunk: greedy_generate(build_runner(cfg, w, num_slots=2), prompt, 12, chunk)
           for chunk in (20, 40)}
    return cfg, w, prompt, ref


def _streaming(cfg, w, slots: int, queue: prefetch.CopyQueue | None = None
               ) -> OffloadedExperts:
    store = HostExpertStore.from_weights(w, cfg)
    cache = DeviceExpertCache(store, slots, device="cpu", dtype=torch.float32)
    # 16 pairs: a 20-token chunk (40 pairs) streams, a decode token (2 pairs) does not.
    experts = OffloadedExperts(cache)
    experts.streamer = prefetch.LayerStreamer(cache, queue=queue, min_pairs=16)
    return experts


@pytest.mark.parametrize("chunk", [20, 40], ids=lambda c: f"chunk{c}")
@pytest.mark.parametrize("queue", ["now", "deferred"])
def test_streamed_prefill_generates_the_resident_tokens(tiny, chunk: int, queue: str) -> None:
    cfg, w, prompt, ref = tiny
    E = cfg.num_experts
    q = DeferredQueue() if queue == "deferred" else prefetch.CopyQueue()
    experts = _streaming(cfg, w, 2 * E + 1, q)  # < all 32 experts: the cache evicts
    runner = build_runner(cfg, w, num_slots=2, experts=experts)
    ref_tokens, ref_logits = ref[chunk]
    # Twice: the second prefill streams over slots the first decode filled (stale entries
    # would be found by the second decode).
    for _ in range(2):
        tokens, logits = greedy_generate(runner, prompt, 12, chunk)
        assert tokens == ref_tokens
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5,
                                   atol=1e-5 * ref_logits.abs().max())
    # Every layer of every chunk streamed (layers 0 and 1 once more for the second chunk
    # when the regions do not hold them), then decode took the cache path.
    stats = experts.stats
    assert stats.h2d_bytes == stats.misses * experts.cache.store.bytes_per_expert
    assert stats.misses >= cfg.num_layers * E
    assert not experts.streamer.active
    experts.begin_step()
    assert experts.cache.policy.where == experts.cache.resident()
    cache = experts.cache
    for (layer, e), slot in cache.resident().items():
        row = layer * E + e
        assert torch.equal(cache.slots.w13[slot], cache.store.slots.w13[row])


def test_copy_and_wait_order() -> None:
    cfg, w = checkpoint("modelopt")
    L, E, k = cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok
    q = LogQueue()
    experts = _streaming(cfg, w, 2 * E, q)
    s = experts.streamer
    src = experts.cache.store.slots.w13
    row_ptr = [src[la * E].data_ptr() for la in range(L)]
    ids = torch.randint(0, E, (10, k))

    def call(layer: int) -> torch.Tensor:
        q.log.clear()
        return experts._slot_ids(layer, ids)

    slots = call(0)  # first streamed layer: copy it, then prefetch layer 1, wait for layer 0
    assert torch.equal(slots, ids.int())
    (_, m), (_, a0, e0, p0), (_, a1, e1, p1), (_, w0) = q.log
    assert (a0, a1, w0, p0, p1) == (m, m, e0, row_ptr[0], row_ptr[1])
    ready = e1  # layer 1's copy, issued by the call for layer 0
    for layer in range(1, L):  # mark (after the MoE of layer - 1), prefetch layer + 1, wait
        slots = call(layer)
        assert torch.equal(slots, ids.int() + (layer % 2) * E)
        if layer + 1 < L:
            (_, m), (_, a, e, p), (_, wait) = q.log
            assert (a, p) == (m, row_ptr[layer + 1])
        else:
            (_, m), (_, wait) = q.log  # nothing after the last layer
        assert wait == ready
        ready = e if layer + 1 < L else None
        assert s.region_layer[layer % 2] == layer
    # The next chunk: the regions hold layers L-2 and L-1, so layers 0 and 1 copy again.
    call(0)
    assert [op[3] for op in q.log if op[0] == "copy"] == row_ptr[:2]
    # A decode call gives the regions back: the compute stream waits for the last copy.
    last = s._last
    q.log.clear()
    experts._slot_ids(1, ids[:1])
    assert q.log == [("wait", last)]
    assert not s.active and s.region_layer == [None, None]


def test_evict_slots_invalidates_exactly_the_range() -> None:
    cfg, w = checkpoint("modelopt")
    L, E = cfg.num_layers, cfg.num_experts
    store = HostExpertStore.from_weights(w, cfg)
    S = 3 * E
    cache = DeviceExpertCache(store, S, device="cpu", dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        cache.begin_step()
        for layer in range(L):
            cache.lookup(layer, torch.randperm(E, generator=g)[:6].view(2, 3))
    cache.begin_step()
    before = cache.resident()
    assert cache.policy.where == before
    assert any(s < 2 * E for s in before.values()) and any(s >= 2 * E for s in before.values())
    cache.evict_slots(0, 2 * E)
    after = cache.resident()
    assert after == {key: s for key, s in before.items() if s >= 2 * E}
    assert torch.all(cache.owner[:2 * E] == -1)
    assert cache.policy.where == after
    # Released slots are the policy's first victims, and a lookup after the eviction finds
    # every expert where the table says, copying the evicted ones back in.
    assert set(cache.policy.victims(2 * E)) == set(range(2 * E))
    cache.begin_step()
    ids = torch.arange(E).view(2, 4)
    slots = cache.lookup(0, ids)
    for e, s in zip(ids.flatten().tolist(), slots.flatten().tolist(), strict=True):
        assert torch.equal(cache.slots.w13[s], store.slots.w13[e])


def test_streaming_needs_two_layers_of_slots_and_not_all() -> None:
    cfg, w = checkpoint("modelopt")
    L, E = cfg.num_layers, cfg.num_experts
    store = HostExpertStore.from_weights(w, cfg)

    def make(slots: int, **kw) -> OffloadedExperts:
        return OffloadedExperts.create(store, slots, device="cpu", dtype=torch.float32, **kw)

    assert make(2 * E).streamer is not None
    assert make(2 * E - 1).streamer is None
    assert make(L * E).streamer is None
    assert prefetch.can_stream(2 * E - 1, L, E) is not None
    with pytest.raises(ValueError, match="slots"):
        prefetch.LayerStreamer(make(E).cache)
    s = make(2 * E).streamer
    assert s.min_pairs == prefetch.MIN_PAIRS_PER_EXPERT * E
    assert s.wants(torch.zeros(s.min_pairs // 2, 2, dtype=torch.long))
    assert not s.wants(torch.zeros(1, s.min_pairs - 1, dtype=torch.long))

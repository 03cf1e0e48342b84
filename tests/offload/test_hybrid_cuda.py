"""Hybrid expert execution on a GPU: the CPU part, requested by stream memory operations in the
decode graph (and eagerly), decodes the tiny model's greedy tokens; the probe and the debug
throttle."""

from __future__ import annotations

import pytest
import torch

from tests.offload.helpers import greedy_generate
from tinyserve.kernels.moe import cpu as nvfp4_cpu
from tinyserve.offload import bandwidth
from tinyserve.offload.hybrid import CpuExperts, HybridPlan, configure
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore

pytestmark = [pytest.mark.requires_cuda,
              pytest.mark.skipif(not nvfp4_cpu.available(), reason="numba is not installed")]


def _runner(cfg, weights, experts, graphs: bool):
    from tests.model.hf_tiny import build_runner

    return build_runner(cfg, weights, num_slots=2, poison=False, dtype=torch.bfloat16,
                        device="cuda", experts=experts, cuda_graphs=graphs, graph_pad_slot=1)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("plan", [HybridPlan("hybrid", 0.5, 0.0), HybridPlan("cpu", 1.0, -1e6)],
                         ids=["hybrid", "cpu"])
def test_cpu_part_in_the_decode_graph_keeps_the_tokens(graphs: bool, plan: HybridPlan) -> None:
    from tests.model.hf_tiny import checkpoint

    cfg, w = checkpoint("modelopt")
    L, E = cfg.num_layers, cfg.num_experts
    prompt = torch.randint(0, 500, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    store = HostExpertStore.from_weights(w, cfg)
    copied = OffloadedExperts.create(store, E + 2, device="cuda", max_ids=64)
    ref = greedy_generate(_runner(cfg, w, copied, graphs), prompt, 12)
    experts = OffloadedExperts.create(store, E + 2, device="cuda", max_ids=64)
    runner_cpu = CpuExperts(store, device="cuda")
    experts.set_hybrid(plan, runner_cpu)
    runner = _runner(cfg, w, experts, graphs)
    # teacher-forced on the reference's tokens, so every step compares the same context
    tokens, logits = greedy_generate(runner, prompt, 12, forced=ref[0])
    # int8 expert inputs on the CPU (kernels.moe.cpu); tests/offload/test_hybrid.py says more
    diff = (logits - ref[1]).abs().max()
    assert diff <= 5e-2 * ref[1].abs().max()
    # greedy tokens equal wherever the reference's top two are further apart than the error
    top2 = ref[1].topk(2, dim=-1).values
    clear = ((top2[:, 0] - top2[:, 1]) > 2 * diff).tolist()
    assert sum(clear) > 0
    for got, want, c in zip(tokens, ref[0], clear, strict=True):
        assert got == want or not c
    if graphs:
        assert runner.graphs is not None and runner.graphs.num_graphs >= 1
    torch.cuda.synchronize()
    assert experts.cpu_computed > 0
    experts.begin_step()
    assert experts.cache.policy.where == experts.cache.resident()
    assert experts.stats.misses < L * E * 12  # decode copied less than everything


def test_probe_and_throttle() -> None:
    store = HostExpertStore(2, 64, 2048, 512, pin=True)
    store.buffer.zero_()
    experts = OffloadedExperts.create(store, 64, device="cuda", max_ids=64)
    cache = experts.cache
    fast = bandwidth.h2d_bandwidth(cache, 8)
    cache.throttle_bytes_per_s = min(fast, 40e9) / 4
    slow = bandwidth.h2d_bandwidth(cache, 8)
    assert slow == pytest.approx(cache.throttle_bytes_per_s, rel=0.25)
    cache.throttle_bytes_per_s = 0.0
    plan = configure(experts, None, 8)
    bw = plan.bandwidths
    assert bw is not None and bw.h2d is not None and bw.cpu_overhead_s >= 0
    assert sorted(bw.split_us) == list(range(9)) and min(bw.split_us.values()) > 0
    assert experts.hybrid_plan is plan and (plan.mode == "gpu") == (experts.cpu_runner is None)

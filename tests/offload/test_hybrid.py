"""Hybrid expert execution on the CPU: the split's arithmetic, the lookup's split, and the
tiny model decoding the same greedy tokens with part or all of its misses on the CPU."""

from __future__ import annotations

import pytest
import torch

from tests.model.hf_tiny import build_runner, checkpoint
from tests.offload.helpers import greedy_generate
from tinyserve.kernels.moe import cpu as nvfp4_cpu
from tinyserve.offload import lookup as lk
from tinyserve.offload.bandwidth import Bandwidths, cpu_expert_times, probe, thread_counts
from tinyserve.offload.hybrid import CpuExperts, HybridPlan, plan_split
from tinyserve.offload.provider import CPU_MAX_TOKENS, OffloadedExperts
from tinyserve.offload.store import HostExpertStore

needs_numba = pytest.mark.skipif(not nvfp4_cpu.available(), reason="numba is not installed")
BPE = 1_769_484  # one 35B-A3B expert


def _bw(h2d: float | None, cpu_bps: float, overhead_s: float = 0.0) -> Bandwidths:
    return Bandwidths(host_read=95e9, read_bytes=1 << 30, h2d=h2d, cpu_expert_s=BPE / cpu_bps,
                      cpu_overhead_s=overhead_s, bytes_per_expert=BPE, threads=16)


def test_split_balances_copy_and_cpu_time() -> None:
    plan = plan_split(_bw(41e9, 57e9, 30e-6), "hybrid", top_k=8)
    t_copy, t_cpu, t_call = BPE / 41e9, BPE / 57e9, 30e-6
    for m in range(0, 9):
        c = lk.cpu_share(plan.a, plan.b, m)
        assert 0 <= c <= m
        # no other c finishes both sides sooner (to within one expert's rounding)
        best = min(max((m - j) * t_copy, t_call + j * t_cpu if j else 0) for j in range(m + 1))
        assert max((m - c) * t_copy, t_call + c * t_cpu if c else 0) <= best + max(t_copy, t_cpu)
    assert lk.cpu_share(plan.a, plan.b, 8) == 4
    # a laptop: slow PCIe moves most of the work to the CPU
    laptop = plan_split(_bw(12e9, 30e9, 30e-6), "hybrid", top_k=8)
    assert lk.cpu_share(laptop.a, laptop.b, 8) >= 5
    assert plan_split(_bw(12e9, 30e9), None, top_k=8).mode == "hybrid"
    # a CPU much slower than the link: auto keeps the GPU path, never slower than gpu-only
    assert plan_split(_bw(41e9, 2e9, 30e-6), None, top_k=8).mode == "gpu"
    cpu = plan_split(_bw(41e9, 57e9), "cpu", top_k=8)
    assert lk.cpu_share(cpu.a, cpu.b, 8) == 8
    assert plan_split(_bw(None, 57e9), None, top_k=8).mode == "gpu"
    with pytest.raises(ValueError, match="H2D"):
        plan_split(_bw(None, 57e9), "hybrid", top_k=8)
    with pytest.raises(ValueError, match="experts must be"):
        plan_split(_bw(41e9, 57e9), "fpga", top_k=8)
    assert "hybrid" in plan.format() and plan.as_dict()["a"] == plan.a
    # one probe, each mode's split (what decoding compares: engine.expert_mode)
    assert lk.cpu_share(*[getattr(plan.with_mode("cpu"), v) for v in "ab"], 8) == 8
    assert (plan.with_mode("gpu").a, plan.with_mode("gpu").b) == (0.0, 0.0)
    assert plan.with_mode("hybrid") == plan and plan.with_mode("cpu").bandwidths is plan.bandwidths
    with pytest.raises(ValueError, match="plan_split"):
        cpu.with_mode("hybrid")
    with pytest.raises(ValueError, match="experts must be"):
        plan.with_mode("fpga")


def test_split_takes_the_share_measured_fastest() -> None:
    """Both sides at once contend for host memory: the measured layer times, not the rates
    alone, pick the CPU's share at top_k misses and the mode."""
    from dataclasses import replace

    rates = _bw(41e9, 74e9, 30e-6)  # alone, the rates would give the CPU 5 of 8
    predicted = plan_split(rates, "hybrid", top_k=8)
    assert lk.cpu_share(predicted.a, predicted.b, 8) == 5
    measured = replace(rates, split_us={0: 350.0, 1: 320.0, 2: 290.0, 3: 250.0, 4: 262.0,
                                        5: 280.0, 6: 300.0, 7: 330.0, 8: 360.0})
    plan = plan_split(measured, None, top_k=8)
    assert plan.mode == "hybrid" and plan.auto and lk.cpu_share(plan.a, plan.b, 8) == 3
    assert plan.layer_us == {"gpu": 350.0, "cpu": 360.0, "hybrid": 250.0}
    assert "(measured)" in plan.format()
    # fewer misses scale with the rates' slope from there
    assert [lk.cpu_share(plan.a, plan.b, m) for m in (0, 2, 4, 6, 8)] == [0, 0, 0, 2, 3]
    # any saving proposes hybrid (decoding settles it: engine.expert_mode); none keeps gpu
    near = replace(rates, split_us={c: 350.0 - 10 * (c == 2) for c in range(9)})
    assert plan_split(near, None, top_k=8).mode == "hybrid"
    flat = replace(rates, split_us={c: 350.0 + c for c in range(9)})
    assert plan_split(flat, None, top_k=8).mode == "gpu"
    assert plan_split(flat, "gpu", top_k=8).auto is False


@pytest.mark.parametrize("a,b", [(0.5, 0.0), (1.0, -1e6), (0.3, 0.4)])
def test_lookup_split_leaves_the_last_misses_unloaded(a: float, b: float) -> None:
    L, E, S = 2, 16, 20
    table = torch.full((L * E + 1,), -1, dtype=torch.int32)
    owner = torch.full((S + 1,), -1, dtype=torch.int32)
    table[3], owner[7] = 7, 3  # expert 3 of layer 0 is resident in slot 7
    victims = torch.arange(S, dtype=torch.int32)
    ids = torch.tensor([[3, 9, 1], [12, 9, 5]])
    split = torch.tensor([a, b])
    slot_ids, rows, slots = lk.expert_lookup_ref(ids, 0, table, owner, victims, E, split=split)
    misses = [1, 5, 9, 12]
    c = lk.cpu_share(a, b, len(misses))
    cpu = set(misses[len(misses) - c:])
    for t in range(2):
        for j in range(3):
            e = int(ids[t, j])
            assert (int(slot_ids[t, j]) < 0) == (e in cpu)
    assert int(slot_ids[0, 0]) == 7
    loaded = sorted(int(r) for r in rows if r >= 0)
    assert loaded == [e for e in misses if e not in cpu]
    assert all(int(table[e]) == -1 for e in cpu)


@pytest.fixture(scope="module")
def tiny():
    cfg, w = checkpoint("modelopt")
    prompt = torch.randint(0, 500, (23,), generator=torch.Generator().manual_seed(4)).tolist()
    ref_tokens, ref_logits = greedy_generate(build_runner(cfg, w, num_slots=2), prompt, 16)
    return cfg, w, prompt, ref_tokens, ref_logits


@needs_numba
@pytest.mark.parametrize("plan", [HybridPlan("hybrid", 0.5, 0.0), HybridPlan("cpu", 1.0, -1e6)],
                         ids=["hybrid-0.5-0", "cpu"])
def test_cpu_part_equals_the_rounded_reference(tiny, plan: HybridPlan) -> None:
    """Against the experts' torch reference with the CPU kernel's rounding (`round_like_cpu`)
    the CPU part changes the logits by its summation order alone."""
    cfg, w, prompt, ref_tokens, _ = tiny

    def logits(plan: HybridPlan) -> tuple[torch.Tensor, int | None]:
        store = HostExpertStore.from_weights(w, cfg)
        experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cpu",
                                          dtype=torch.float32)
        experts.round_like_cpu = True
        experts.set_hybrid(plan, CpuExperts(store, device="cpu"))
        runner = build_runner(cfg, w, num_slots=2, experts=experts)
        return greedy_generate(runner, prompt, 16, forced=ref_tokens)[1], experts.cpu_computed

    (want, _), (got, computed) = logits(HybridPlan("gpu")), logits(plan)
    assert computed is not None and computed > 0
    # 2e-7 measured (fp32 rounding); an int8 rounding that the order tips the other way moves
    # one hidden value by 1/127 of its block's largest
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def _layer_outputs(cfg, w, plan: HybridPlan, x: torch.Tensor, ids: torch.Tensor,
                   weights: torch.Tensor) -> torch.Tensor:
    """Every layer's bf16 experts on (x, ids, weights) under `plan`, through the reference
    rounded as the CPU kernel rounds, every expert a miss: [layers, N, H]."""
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, cfg.num_layers * cfg.num_experts, device="cpu",
                                      dtype=torch.bfloat16)
    experts.round_like_cpu = True
    experts.set_hybrid(plan, CpuExperts(store, device="cpu"))
    out = torch.stack([experts.forward(layer, x, ids, weights)
                       for layer in range(cfg.num_layers)])
    assert out.dtype == torch.bfloat16
    assert plan.mode == "gpu" or experts.cpu_computed > 0
    return out.float()


@needs_numba
@pytest.mark.parametrize("plan", [HybridPlan("hybrid", 0.5, 0.0), HybridPlan("cpu", 1.0, -1e6)],
                         ids=["hybrid-0.5-0", "cpu"])
def test_cpu_part_joins_before_the_one_rounding(tiny, plan: HybridPlan) -> None:
    """bf16 experts: the GPU part's sum stays in fp32 until the CPU part's joins it, so a
    layer's output is gpu-only's but where the fp32 order tips a bf16 rounding (none here;
    rounding the GPU part first moved 14 % of the values)."""
    cfg, w, *_ = tiny
    g = torch.Generator().manual_seed(7)
    n, k = CPU_MAX_TOKENS, cfg.num_experts_per_tok
    x = torch.randn(n, cfg.hidden_size, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(cfg.num_experts, generator=g)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, generator=g), -1).bfloat16()
    want = _layer_outputs(cfg, w, HybridPlan("gpu"), x, ids, weights)
    got = _layer_outputs(cfg, w, plan, x, ids, weights)
    step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(2.0 ** -126))) - 7)
    diff = (got - want).abs()
    assert (diff <= step).all()  # one bf16 step at most
    assert (diff > 0).float().mean() < 0.02, (diff > 0).float().mean()


@needs_numba
@pytest.mark.parametrize("plan", [HybridPlan("hybrid", 0.5, 0.0), HybridPlan("hybrid", 0.6, 0.2),
                                  HybridPlan("cpu", 1.0, -1e6)],
                         ids=["hybrid-0.5-0", "hybrid-0.6-0.2", "cpu"])
def test_cpu_part_decodes_the_same_tokens(tiny, plan: HybridPlan) -> None:
    cfg, w, prompt, ref_tokens, ref_logits = tiny
    store = HostExpertStore.from_weights(w, cfg)
    experts = OffloadedExperts.create(store, cfg.num_experts + 2, device="cpu",
                                      dtype=torch.float32)
    experts.set_hybrid(plan, CpuExperts(store, device="cpu"))
    runner = build_runner(cfg, w, num_slots=2, experts=experts)
    tokens, logits = greedy_generate(runner, prompt, 16)
    assert tokens == ref_tokens
    # the CPU kernel rounds the experts' inputs to int8 per 16 (kernels.moe.cpu): about 1 %
    # of the largest output per expert; every routed expert of every layer on the CPU moves
    # the tiny model's logits by about 3 % of the largest
    assert (logits - ref_logits).abs().max() <= 5e-2 * ref_logits.abs().max()
    computed = experts.cpu_computed
    assert computed is not None and computed > 0
    if plan.mode == "cpu":  # the prefill (one 23-token batch: over CPU_MAX_TOKENS) copied
        experts.begin_step()
        assert experts.stats.hits > 0


@needs_numba
def test_probe_measures_the_cpu_kernel() -> None:
    store = HostExpertStore(2, 8, 128, 64, pin=False)
    store.buffer.zero_()
    bw = probe(store, top_k=4)
    assert bw.h2d is None and bw.host_read > 0 and bw.cpu_expert_s > 0
    assert bw.bytes_per_expert == store.bytes_per_expert
    assert sorted(bw.call_us) == sorted(thread_counts(nvfp4_cpu.max_threads()))
    assert bw.call_us[bw.threads] == min(bw.call_us.values())
    assert "CPU expert kernel" in bw.format()


class _SpellRunner:
    """A CpuExperts stand-in whose calls take 40 us + 25 us per expert, five times as long
    during calls spell .. spell + 2 (a slow spell of the host's)."""

    def __init__(self, spell: int) -> None:
        self.calls, self.spell = 0, spell

    def set_threads(self, threads: int) -> None:
        pass

    def time_rows(self, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> float:
        slow = self.spell <= self.calls < self.spell + 3
        self.calls += 1
        return (40e-6 + 25e-6 * rows.shape[1]) * (5 if slow else 1)


@pytest.mark.parametrize("spell", range(1, 9))
def test_cpu_rates_survive_a_slow_spell(spell: int) -> None:
    store = HostExpertStore(2, 8, 128, 64, pin=False)
    per, overhead = cpu_expert_times(store, 8, 4, _SpellRunner(spell), reps=5)
    assert per == pytest.approx(25e-6) and overhead == pytest.approx(40e-6)

"""The engine with offloaded routed experts (host store + a small expert cache) on CPU:
same greedy tokens as the all-resident engine, cache counters in EngineStats, and the
memory plan's numbers used by the builder."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tinyserve.core import SamplingParams
from tinyserve.engine.build import build_engine
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.device_memory import DeviceMemory, reference_device
from tinyserve.engine.expert_mode import settle_expert_mode
from tinyserve.engine.llm import LLM
from tinyserve.engine.planner import plan_checkpoint
from tinyserve.kernels.moe import cpu as nvfp4_cpu
from tinyserve.model.config import load_config
from tinyserve.offload.hybrid import CpuExperts, HybridPlan
from tinyserve.offload.provider import OffloadedExperts

PROMPTS = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 2, "42"]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", params=["bf16", "modelopt"])
def ckpt(request, tiny_checkpoint):
    return tiny_checkpoint(request.param)


def _generate(ckpt, **kwargs) -> tuple[list[list[int]], object, object]:
    with LLM(str(ckpt), device="cpu", max_context=96, max_seqs=3, max_num_batched_tokens=16,
             **kwargs) as llm:
        out = llm.generate(PROMPTS, GREEDY)
        return [c.token_ids for c in out], llm.engine.stats(), llm.engine.runner.model.experts


def test_offloaded_engine_generates_the_resident_tokens(ckpt) -> None:
    cfg = load_config(ckpt)
    resident, rstats, _ = _generate(ckpt)
    slots = cfg.num_experts + 2  # far fewer than the 32 routed experts of the model
    offloaded, stats, experts = _generate(ckpt, expert_cache_slots=slots)
    assert offloaded == resident
    assert isinstance(experts, OffloadedExperts) and experts.cache.num_slots == slots
    assert rstats.expert_cache_hit_rate is None and rstats.expert_cache_hits is None
    total = cfg.num_layers * cfg.num_experts
    assert stats.expert_cache_misses > total  # the cache really evicted and reloaded
    assert stats.expert_cache_hits > 0
    assert 0.0 < stats.expert_cache_hit_rate < 1.0
    assert stats.expert_cache_h2d_bytes == (stats.expert_cache_misses
                                            * experts.cache.store.bytes_per_expert)


def test_cache_holding_every_expert_is_preloaded(tiny_checkpoint) -> None:
    ckpt = tiny_checkpoint("modelopt")
    cfg = load_config(ckpt)
    resident, _, _ = _generate(ckpt)
    tokens, stats, _ = _generate(ckpt, expert_cache_slots=cfg.num_layers * cfg.num_experts)
    assert tokens == resident
    assert stats.expert_cache_misses == 0 and stats.expert_cache_hit_rate == 1.0


def test_too_small_cache_is_refused(tiny_checkpoint) -> None:
    ckpt = tiny_checkpoint("modelopt")
    with pytest.raises(ValueError, match="at least one layer"):
        LLM(str(ckpt), device="cpu", max_context=64, expert_cache_slots=3)
    with pytest.raises(ValueError, match="expert_cache_slots"):
        EngineConfig(model=str(ckpt), expert_cache_slots=0)


def test_builder_takes_the_plans_numbers(tiny_checkpoint, monkeypatch) -> None:
    """Every number of the engine is the plan's: sequences, state slots, KV pages, expert
    slots and the embedding's place (a plan for a GPU budget, built on the CPU)."""
    ckpt = tiny_checkpoint("modelopt")
    mcfg = load_config(ckpt)
    config = EngineConfig(model=str(ckpt), kv="bf16", max_context=256, page_size=16,
                          gpu_memory="2GiB", dtype="float32", device="cuda",
                          max_num_batched_tokens=64)
    full = plan_checkpoint(config, ckpt, reference_device(config))
    assert not full.experts_offloaded and full.embed_device == "cuda"
    assert full.max_seqs == 8 and full.snapshot_slots == 9 and full.state_slots == 18
    # A plan as a small budget makes it, run on the CPU (no device is touched)
    plan = replace(full, device="cpu", max_seqs=2, snapshot_slots=1, state_slots=4,
                   kv_pages=full.kv_pages // 2, expert_cache=True,
                   expert_slots=mcfg.num_experts + 3)
    cpu = replace(config, device="cpu", gpu_memory=None)
    with build_engine(cpu, plan=plan).start() as engine:
        stats = engine.stats()
        assert (stats.kv_pages_total, stats.state_slots_total) == (plan.kv_pages, 2)
        assert stats.prefix_cache_snapshot_slots == 1
        assert engine.runner.model.states.num_slots == 4
        assert engine.runner.model.experts.cache.num_slots == mcfg.num_experts + 3
        assert engine.memory_plan is plan and engine.max_context == plan.max_context
    # the CPU's own plan: 8 sequences of max_context tokens each, every expert resident
    own = plan_checkpoint(cpu, ckpt, DeviceMemory(device="cpu"))
    assert own.kv_pages == 8 * 256 // 16 and not own.expert_cache


def test_server_completions_and_metrics_with_offloaded_experts(tiny_checkpoint) -> None:
    pytest.importorskip("fastapi")
    import httpx

    from tests.server.fakes import serve
    from tinyserve.engine.build import build_engine
    from tinyserve.server.app import create_app
    from tinyserve.server.state import ServerConfig, ServerState

    ckpt = tiny_checkpoint("modelopt")
    want, _, _ = _generate(ckpt)
    engine = build_engine(EngineConfig(model=str(ckpt), device="cpu", max_context=96,
                                       max_seqs=3, max_num_batched_tokens=16,
                                       expert_cache_slots=10)).start()
    try:
        with serve(create_app(ServerState(ServerConfig(served_model_name="tiny"), engine))) \
                as url:
            ids = engine.tokenizer.encode(PROMPTS[0])
            r = httpx.post(url + "/v1/completions", timeout=60, json={
                "model": "tiny", "prompt": ids, "max_tokens": 10, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["text"]
            assert text == engine.tokenizer.decode(want[0])
            metrics = httpx.get(url + "/metrics", timeout=10).text
            assert "tinyserve:expert_cache_hit_rate" in metrics
            assert "tinyserve:expert_cache_misses_total" in metrics
    finally:
        engine.shutdown()


@pytest.mark.skipif(not __import__("tinyserve.kernels.moe.cpu", fromlist=["x"]).available(),
                    reason="numba is not installed")
def test_cpu_experts_engine_generates_the_same_tokens(tiny_checkpoint) -> None:
    """`experts="cpu"`: every decode miss computed on the CPU kernel; same greedy tokens, the
    CPU counter in EngineStats (and /metrics); "gpu" and a CPU device's auto have no CPU part."""
    ckpt = tiny_checkpoint("modelopt")
    slots = load_config(ckpt).num_experts + 2
    copied, gstats, gexperts = _generate(ckpt, expert_cache_slots=slots, experts="gpu")
    on_cpu, stats, experts = _generate(ckpt, expert_cache_slots=slots, experts="cpu")
    assert on_cpu == copied
    assert gstats.expert_cpu_computed is None and gexperts.hybrid_plan.mode == "gpu"
    assert experts.hybrid_plan.mode == "cpu" and stats.expert_cpu_computed > 0
    assert stats.expert_cache_misses < gstats.expert_cache_misses  # decode copied nothing
    _, astats, aexperts = _generate(ckpt, expert_cache_slots=slots)
    assert aexperts.hybrid_plan.mode == "gpu"  # no H2D rate to split by on a CPU device
    from tinyserve.server.metrics import ServerMetrics

    assert "tinyserve:expert_cpu_computed_total" in ServerMetrics().render(stats)


@pytest.mark.skipif(not nvfp4_cpu.available(), reason="numba is not installed")
def test_auto_hybrid_is_settled_by_decoding(tiny_checkpoint) -> None:
    """An auto plan of hybrid is kept only if it decodes fastest: the engine's first start
    decodes each way (gpu, cpu, hybrid), keeps the fastest and leaves no requests counted;
    once settled, nothing more is measured, and the tokens stay the resident ones."""
    ckpt = tiny_checkpoint("modelopt")
    cfg = load_config(ckpt)
    resident, _, _ = _generate(ckpt)
    config = EngineConfig(model=str(ckpt), device="cpu", max_context=96, max_seqs=3,
                          max_num_batched_tokens=16, expert_cache_slots=cfg.num_experts + 2)
    engine = build_engine(config)
    experts = engine.runner.model.experts
    runner = CpuExperts(experts.cache.store, device="cpu")
    experts.set_hybrid(HybridPlan("hybrid", 0.5, 0.0, auto=True), runner)
    prompts, submit = [], engine.submit
    engine.submit = lambda prompt, *args, **kwargs: (prompts.append(tuple(prompt)),
                                                     submit(prompt, *args, **kwargs))[1]
    with engine.start():
        del engine.submit
        assert len(set(prompts)) == len(prompts) == 3  # each mode its own tokens
        settled = experts.hybrid_plan
        assert settled.decode_tok_s is not None and set(settled.decode_tok_s) == {
            "gpu", "cpu", "hybrid"}
        assert settled.mode == max(settled.decode_tok_s, key=settled.decode_tok_s.__getitem__)
        assert (experts.cpu_runner is None) == (settled.mode == "gpu")
        assert (settled.a, settled.b) == {"hybrid": (0.5, 0.0), "gpu": (0, 0),
                                          "cpu": (1.0, -1e6)}[settled.mode]
        assert "tok/s (measured)" in settled.format()
        assert engine.stats().requests_submitted == engine.stats().steps == 0
        assert settle_expert_mode(engine) is None
        handles = [engine.submit(engine.tokenizer.encode(p), GREEDY) for p in PROMPTS]
        assert [[t for out in h for t in out.token_ids] for h in handles] == resident
    # nothing to settle: a plan auto left on the GPU, or one asked for
    for plan in (HybridPlan("gpu", auto=True), HybridPlan("hybrid", 0.5, 0.0)):
        experts.set_hybrid(plan, runner)
        assert settle_expert_mode(engine) is None and experts.hybrid_plan is plan

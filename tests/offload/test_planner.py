"""Memory planner: Qwen3.5-35B-A3B geometry on 6 GiB, refusals with numbers, `tinyserve plan`."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tinyserve.cli import main
from tinyserve.model.config import ModelConfig, load_config
from tinyserve.offload.planner import (
    GiB,
    MiB,
    PlanConfig,
    PlanError,
    parse_size,
    plan_checkpoint,
    plan_for_geometry,
)
from tinyserve.offload.weights import checkpoint_weight_bytes, geometry_weight_bytes

QWEN35 = ModelConfig()  # the defaults are Qwen3.5-35B-A3B's


def test_parse_size() -> None:
    assert parse_size("6GiB") == 6 * GiB
    assert parse_size("6GB") == 6 * 10**9
    assert parse_size("6G") == 6 * GiB
    assert parse_size("5500MiB") == 5500 * MiB
    assert parse_size("1.5 GiB") == 3 * GiB // 2
    assert parse_size("123") == 123
    with pytest.raises(PlanError, match="6GiB"):
        parse_size("six gigs")


def test_weight_bytes_match_the_spec() -> None:
    mixed = geometry_weight_bytes(QWEN35, "mixed")
    # specs/qwen35_moe.md §7.2: 2.706 GB with the embedding, 1.69 GB resident without it.
    assert mixed.embed / 1e9 == pytest.approx(1.017, abs=1e-3)
    assert (mixed.total - mixed.num_routed_experts * mixed.expert_bytes) / 1e9 == \
        pytest.approx(2.706, abs=2e-3)
    bf16 = geometry_weight_bytes(QWEN35, "bf16")
    assert (bf16.total - bf16.num_routed_experts * bf16.expert_bytes) / 1e9 == \
        pytest.approx(4.897, abs=2e-3)
    # nvfp4.md §6: a W4A16 expert is 1,769,484 B; 10,240 of them.
    assert mixed.expert_bytes == 1_769_484
    assert mixed.num_routed_experts == 10_240


@pytest.mark.parametrize("preset", ["mixed", "bf16"])
def test_qwen35_on_6gib_with_iso3_holds_128k(preset: str) -> None:
    w = geometry_weight_bytes(QWEN35, preset)
    plan = plan_for_geometry(QWEN35, w, PlanConfig(gpu_memory=6 * GiB, kv="iso3",
                                                   max_context=131072))
    assert plan.context_tokens >= 131072
    assert plan.kv_bytes_per_token == 4000
    assert plan.state_bytes_per_slot == 64_389_120  # 61.4 MiB
    assert plan.embed_device == "cpu"
    assert plan.experts_offloaded
    assert 0 <= plan.free_bytes < plan.expert_slot_bytes
    assert plan.gpu_bytes <= 6 * GiB
    # A non-trivial cache: at least one full layer plus change (mixed: ~1,700 slots, 16%).
    assert plan.expert_slots >= (1400 if preset == "mixed" else 300)
    assert plan.host_expert_bytes == 10_240 * 1_769_484


def test_default_context_on_6gib_iso3_reaches_128k() -> None:
    w = geometry_weight_bytes(QWEN35, "mixed")
    plan = plan_for_geometry(QWEN35, w, PlanConfig(gpu_memory=6 * GiB, kv="iso3"))
    assert plan.max_context >= 131072
    assert plan.expert_slots >= 1500


def test_bf16_kv_at_128k_is_refused_with_numbers() -> None:
    w = geometry_weight_bytes(QWEN35, "bf16")
    with pytest.raises(PlanError) as err:
        plan_for_geometry(QWEN35, w, PlanConfig(gpu_memory=6 * GiB, kv="bf16",
                                                max_context=131072))
    msg = str(err.value)
    assert "6144 MiB" in msg and "KV 2560 MiB (131072 tokens bf16)" in msg
    assert "256 slots" in msg


def test_big_budget_keeps_everything_resident() -> None:
    w = geometry_weight_bytes(QWEN35, "mixed")
    plan = plan_for_geometry(QWEN35, w, PlanConfig(gpu_memory=40 * GiB, kv="iso3"))
    assert not plan.experts_offloaded
    assert plan.embed_device == "cuda"
    assert plan.max_context == QWEN35.max_position_embeddings
    assert plan.host_expert_bytes == 0


def test_context_beyond_the_model_is_refused() -> None:
    w = geometry_weight_bytes(QWEN35, "mixed")
    with pytest.raises(PlanError, match="max_position_embeddings 262144"):
        plan_for_geometry(QWEN35, w, PlanConfig(gpu_memory=6 * GiB, max_context=300000))


@pytest.fixture(scope="module")
def tiny_nvfp4(tmp_path_factory) -> Path:
    from tinyserve.testing.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    make_tiny_checkpoint(path, fmt="modelopt")
    return path


def test_checkpoint_bytes_from_headers(tiny_nvfp4: Path) -> None:
    config = load_config(tiny_nvfp4)
    w = checkpoint_weight_bytes(tiny_nvfp4, config)
    assert w.experts_fp4
    assert w.expert_bytes == 3 * 32 * 64 // 2 + 3 * 32 * 64 // 16 + 12
    assert w.embed == 512 * 64 * 2
    assert w.num_routed_experts == 4 * 8
    plan = plan_checkpoint(tiny_nvfp4, PlanConfig(gpu_memory=1 * GiB))
    assert not plan.experts_offloaded


def test_plan_command(tiny_nvfp4: Path, capsys) -> None:
    t0 = time.perf_counter()
    assert main(["plan", str(tiny_nvfp4), "--gpu-memory", "1GiB", "--kv", "bf16",
                 "--json"]) == 0
    assert time.perf_counter() - t0 < 10
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpu_memory"] == GiB and plan["kv_format"] == "bf16"
    assert main(["plan", str(tiny_nvfp4), "--gpu-memory", "1GiB"]) == 0
    assert "expert cache" in capsys.readouterr().out
    assert main(["plan", str(tiny_nvfp4), "--gpu-memory", "10MiB", "--max-context", "512"]) == 2
    assert "needs at least" in capsys.readouterr().err


def test_small_budgets_keep_a_fixed_allocator_slack(tiny_nvfp4: Path) -> None:
    """4% of a small budget cannot hold the cuBLAS workspace and the allocator's segments: the
    slack has a floor, so a tiny model's allocator cap is not a few MiB; large budgets keep
    the proportional slack. A budget below what is fixed is refused with the numbers."""
    req = PlanConfig(gpu_memory=700 * MiB, max_context=128, prefill_chunk=32)
    plan = plan_checkpoint(tiny_nvfp4, req)
    slack = dict(plan.workspace)["allocator slack"]
    assert slack == req.allocator_slack_min == 96 * MiB
    # The allocator's share (budget less the CUDA context) covers the slack and graph pools.
    assert plan.gpu_memory - req.cuda_context >= slack + req.graph_pool
    w = geometry_weight_bytes(QWEN35, "mixed")
    big = plan_for_geometry(QWEN35, w, PlanConfig(gpu_memory=6 * GiB, kv="iso3"))
    assert dict(big.workspace)["allocator slack"] == int(0.04 * 6 * GiB)
    fixed = plan.gpu_bytes - plan.expert_cache_bytes - plan.embed_bytes
    with pytest.raises(PlanError, match=r"needs at least \d+ MiB .* budget is \d+ MiB"):
        plan_checkpoint(tiny_nvfp4, PlanConfig(gpu_memory=fixed - MiB, max_context=128,
                                               prefill_chunk=32))

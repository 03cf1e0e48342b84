"""Memory planner: one size parser, the whole-process budget, the laptop defaults on the
Qwen3.5-35B-A3B geometry, refusals with numbers, `tinyserve plan`."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest

from tinyserve.cli import main
from tinyserve.engine.config import DEFAULT_CONTEXT, EngineConfig, describe_size, parse_size
from tinyserve.engine.device_memory import (
    H200_STARTUP,
    LATE_GROWTH,
    DeviceMemory,
    reference_device,
)
from tinyserve.engine.memory_plan import PlanError
from tinyserve.engine.planner import (
    ALLOCATOR_SLACK,
    ALLOCATOR_SLACK_MIN,
    plan_checkpoint,
    plan_memory,
)
from tinyserve.engine.weight_bytes import (
    GROUPS,
    WeightBytes,
    checkpoint_weight_bytes,
    expert_slot_bytes,
    weight_group,
)
from tinyserve.model.config import ModelConfig, load_config
from tinyserve.model.loader_plan import expected_weights

MiB, GiB = 1 << 20, 1 << 30
_FP8_MIXER = ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj")


def geometry_weight_bytes(config: ModelConfig, preset: str) -> WeightBytes:
    """Weight bytes of `config`'s geometry with NVFP4 experts and the other linears like
    `preset` (specs/qwen35_moe.md §7.2): "mixed" is nvidia/Qwen3.6-35B-A3B-NVFP4 (GDN and
    attention FP8, shared experts and lm_head NVFP4), "bf16" the experts-only NVFP4 layout."""

    def linear(shape: tuple[int, ...], fmt: str) -> int:
        n = math.prod(shape)
        return {"nvfp4": n // 2 + n // 16 + 4, "fp8": n + 4, "bf16": 2 * n}[fmt]

    mixed = preset == "mixed"
    sums = dict.fromkeys((*GROUPS, "embed"), 0)
    for name, (kind, shape) in expected_weights(config).items():
        group = weight_group(name)
        if group == "experts":
            continue
        if kind != "linear":
            nbytes = math.prod(shape) * (4 if kind == "fp32" else 2)
        elif mixed and group in ("attention", "gdn") and name.rsplit(".", 1)[1] in _FP8_MIXER:
            nbytes = linear(shape, "fp8")
        elif mixed and (group == "lm_head" or group == "shared_experts"
                        and not name.endswith("shared_expert_gate")):
            nbytes = linear(shape, "nvfp4")
        else:
            nbytes = linear(shape, "bf16")
        sums[group] += nbytes
    return WeightBytes(**sums, expert_bytes=expert_slot_bytes(config, True),
                       num_routed_experts=config.num_layers * config.num_experts,
                       tied=config.tie_word_embeddings)


def resident_and_embed(w: WeightBytes) -> int:
    return w.embed + sum(b for _, b in w.resident_groups())


QWEN35 = ModelConfig()  # the defaults are Qwen3.5-35B-A3B's
MIXED = geometry_weight_bytes(QWEN35, "mixed")


def gpu(budget: str = "6GiB", **kwargs) -> EngineConfig:
    return EngineConfig(model="m", device="cuda", gpu_memory=budget, **kwargs)


def plan35(config: EngineConfig, device: DeviceMemory | None = None):
    return plan_memory(config, QWEN35, MIXED, device or reference_device(config))


@pytest.mark.parametrize("text", ["6G", "6GB", "6GiB", "6gib", "6 GiB", "6Gi", "6144M",
                                  "6144MiB", "6291456K", "6442450944"])
def test_every_way_of_writing_6_gib(text: str) -> None:
    assert parse_size(text) == 6 * GiB
    assert "6,144 MiB" in describe_size(text)


def test_size_parser_says_what_it_took_and_refuses_junk() -> None:
    assert describe_size("6GB") == "6GB read as 6 GiB (6,144 MiB)"  # G is binary, said so
    assert describe_size("6GiB") == "6GiB (6,144 MiB)"
    assert parse_size("1.5 GiB") == 3 * GiB // 2
    assert parse_size(5 * GiB) == 5 * GiB
    for junk in ("six gigs", "6X", "-1", "6 GBs", "", "1e9", "nan", "6.5"):
        with pytest.raises(ValueError, match="memory size"):
            parse_size(junk)
    for bad in ("0", "0GiB", 0, -5):
        with pytest.raises(ValueError, match="positive"):
            parse_size(bad)
    with pytest.raises(ValueError, match=r"'6' is 6 bytes.*6GiB"):
        parse_size("6")
    with pytest.raises(ValueError, match="memory size"):
        EngineConfig(model="m", gpu_memory="6 gigs")


def test_weight_bytes_match_the_spec() -> None:
    # specs/qwen35_moe.md §7.2: 2.706 GB with the embedding, 1.69 GB resident without it.
    assert MIXED.embed / 1e9 == pytest.approx(1.017, abs=1e-3)
    assert resident_and_embed(MIXED) / 1e9 == pytest.approx(2.706, abs=2e-3)
    bf16 = geometry_weight_bytes(QWEN35, "bf16")
    assert resident_and_embed(bf16) / 1e9 == pytest.approx(4.897, abs=2e-3)
    # nvfp4.md §6: a W4A16 expert is 1,769,484 B; 10,240 of them.
    assert MIXED.expert_bytes == 1_769_484
    assert MIXED.num_routed_experts == 10_240


def test_default_6gib_iso3_plan_holds_128k_and_the_cache_gets_the_rest() -> None:
    plan = plan35(gpu(kv="iso3"))
    assert plan.max_context >= 131072 and plan.context_tokens >= 131072
    assert plan.kv_bytes_per_token == 4000
    assert plan.state_bytes_per_slot == 64_389_120  # 61.4 MiB
    # one sequence: its state, two prefix-cache snapshots, the graphs' padding slot
    assert (plan.max_seqs, plan.snapshot_slots, plan.state_slots) == (1, 2, 4)
    assert plan.embed_device == "cpu" and plan.experts_offloaded
    assert plan.host_expert_bytes == 10_240 * 1_769_484
    # the whole process: outside the allocator + the allocator's cap = the budget
    assert plan.allocator_cap + plan.outside_allocator_bytes == 6 * GiB
    assert plan.gpu_bytes <= 6 * GiB and 0 <= plan.free_bytes < plan.expert_slot_bytes
    assert plan.expert_slots >= 1100  # the rest of the budget (the H200's overheads)


def test_bf16_weights_on_6gib_get_a_shorter_context() -> None:
    bf16 = geometry_weight_bytes(QWEN35, "bf16")
    plan = plan_memory(gpu(kv="iso3"), QWEN35, bf16, reference_device(gpu()))
    assert plan.experts_offloaded and plan.expert_slots >= QWEN35.num_experts
    # half of what is left after the smallest cache goes to the context
    assert 8192 <= plan.max_context < DEFAULT_CONTEXT


def test_smaller_max_context_trades_kv_for_expert_slots_and_says_so() -> None:
    default = plan35(gpu(kv="iso3"))
    short = plan35(gpu(kv="iso3", max_context=32768))
    assert short.max_context == 32768
    assert short.expert_slots > default.expert_slots + 300
    assert (short.default_context, short.default_expert_slots) == \
        (default.context_tokens, default.expert_slots)
    gained = short.expert_slots - default.expert_slots
    assert (f"--max-context 32,768 instead of the default 131,072: KV -375.0 MiB, expert "
            f"cache +{gained} slots") in short.format()
    assert "instead of the default" not in default.format()


def test_sequences_grow_only_when_asked_or_when_memory_is_spare() -> None:
    one = plan35(gpu(kv="iso3"))
    four = plan35(gpu(kv="iso3", max_seqs=4))
    assert (four.max_seqs, four.snapshot_slots, four.state_slots) == (4, 5, 10)
    assert four.expert_slots < one.expert_slots  # the states come out of the cache
    big = plan35(gpu("80GiB", kv="iso3"))
    assert not big.experts_offloaded and big.embed_device == "cuda"
    assert big.max_seqs == 8 and big.max_context == QWEN35.max_position_embeddings
    assert plan35(gpu("80GiB", kv="iso3", max_seqs=2)).max_seqs == 2


def test_bf16_kv_at_128k_is_refused_with_one_line_of_numbers() -> None:
    with pytest.raises(PlanError) as err:
        plan35(gpu(kv="bf16", max_context=131072))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("the model needs at least ")
    assert "budget is --gpu-memory 6GiB (6,144 MiB)" in msg
    assert "KV 2,560.0 MiB (131072 tokens bf16)" in msg and "256 slots" in msg
    assert "use --kv iso3" in msg


def test_big_budget_keeps_everything_resident() -> None:
    plan = plan35(gpu("40GiB", kv="iso3"))
    assert not plan.experts_offloaded and not plan.expert_cache
    assert plan.embed_device == "cuda" and plan.host_expert_bytes == 0
    assert plan.max_context == QWEN35.max_position_embeddings
    # nothing registered in host memory: no mapping cost
    assert dict((k, b) for k, b, _ in plan.outside_allocator)["host memory mappings"] == 0


def test_a_tied_embedding_is_counted_once_as_the_lm_head() -> None:
    tied = WeightBytes(**{**vars(MIXED), "lm_head": MIXED.embed, "tied": True})
    config = gpu(kv="iso3")
    plan = plan_memory(config, QWEN35, tied, reference_device(config))
    assert plan.embed_device == "cuda" and plan.embed_bytes == 0
    assert dict(plan.resident_weights)["lm_head"] == MIXED.embed
    assert 0 <= plan.free_bytes < plan.expert_slot_bytes  # the cache takes the rest
    assert "(tied)" in plan.format()


def test_context_beyond_the_model_is_refused() -> None:
    with pytest.raises(PlanError, match="max_position_embeddings 262144"):
        plan35(gpu(max_context=300000))


def test_whole_process_budget_uses_the_measured_start_up() -> None:
    """The allocator gets the budget less what lives outside it: the start-up figure
    measured on the running GPU (a laptop's is smaller than the H200's), the H200's late
    growth, and the host-memory mappings."""
    config = gpu(kv="iso3")
    ref = plan35(config)
    laptop = DeviceMemory(device="cuda", name="Laptop GPU", budget=6 * GiB,
                          budget_source="--gpu-memory 6GiB (6,144 MiB)", startup=200 * MiB,
                          startup_source="measured at start-up (NVML, this process)")
    plan = plan35(config, laptop)
    items = {k: (b, how) for k, b, how in plan.outside_allocator}
    assert items["CUDA context, libraries"] == (200 * MiB, laptop.startup_source)
    assert items["kernels, local memory, graphs"][0] == LATE_GROWTH
    assert 0 <= items["host memory mappings"][0] <= 64 * MiB  # 0 measured on the H200
    assert plan.allocator_cap == 6 * GiB - plan.outside_allocator_bytes
    assert plan.expert_slots - ref.expert_slots >= (H200_STARTUP - 200 * MiB) // (2 * MiB)
    text = plan.format()
    assert "memory plan for cuda (Laptop GPU): --gpu-memory 6GiB (6,144 MiB) for the whole " \
           "process" in text
    assert "no CUDA device here" in ref.format()


def test_cpu_plan_needs_no_budget() -> None:
    plan = plan35(EngineConfig(model="m", device="cpu", max_context=4096),
                  DeviceMemory(device="cpu"))
    assert plan.gpu_memory is None and plan.allocator_cap is None and not plan.expert_cache
    assert plan.max_seqs == 8 and plan.kv_pages == 8 * 4096 // 16
    assert plan.format().startswith("memory plan for the CPU")
    with pytest.raises(ValueError, match="--gpu-memory"):
        reference_device(EngineConfig(model="m", device="cuda"))


def test_forced_expert_cache() -> None:
    plan = plan35(gpu("40GiB", kv="iso3", expert_cache_slots=512))
    assert plan.expert_cache and plan.expert_slots == 512 and plan.experts_offloaded
    with pytest.raises(PlanError, match="at least one layer"):
        plan35(gpu(kv="iso3", expert_cache_slots=100))


@pytest.fixture(scope="module")
def tiny_nvfp4(tmp_path_factory) -> Path:
    from tinyserve.testing.tiny import make_tiny_checkpoint

    path = tmp_path_factory.mktemp("tiny") / "ckpt"
    make_tiny_checkpoint(path, fmt="modelopt")
    return path


def test_checkpoint_bytes_from_headers(tiny_nvfp4: Path) -> None:
    config = load_config(tiny_nvfp4)
    w = checkpoint_weight_bytes(tiny_nvfp4, config)
    assert (config.hidden_size, config.moe_intermediate_size) == (64, 64)
    assert w.expert_bytes == 3 * 64 * 64 // 2 + 3 * 64 * 64 // 16 + 12
    assert w.embed == 512 * 64 * 2
    assert w.num_routed_experts == 4 * 8
    cfg = gpu("2GiB")
    plan = plan_checkpoint(cfg, tiny_nvfp4, reference_device(cfg))
    assert not plan.experts_offloaded


def test_plan_command(tiny_nvfp4: Path, capsys) -> None:
    t0 = time.perf_counter()
    assert main(["plan", str(tiny_nvfp4), "--gpu-memory", "2GiB", "--kv", "bf16", "--device",
                 "cuda", "--json"]) == 0
    assert time.perf_counter() - t0 < 10
    plan = json.loads(capsys.readouterr().out)
    assert plan["gpu_memory"] == 2 * GiB and plan["kv_format"] == "bf16"
    assert plan["allocator_cap"] + plan["outside_allocator_bytes"] == 2 * GiB
    # no GPU here: a GPU budget plans for the GPU without --device, --device cpu needs none
    assert main(["plan", str(tiny_nvfp4), "--gpu-memory", "2GB"]) == 0
    out = capsys.readouterr().out
    assert "read as 2 GiB (2,048 MiB)" in out and "routed experts, all 32" in out
    assert main(["plan", str(tiny_nvfp4), "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("memory plan for the CPU")
    assert main(["plan", str(tiny_nvfp4), "--gpu-memory", "900MiB", "--max-context",
                 "512"]) == 2
    err = capsys.readouterr().err
    assert "needs at least" in err and "budget is --gpu-memory 900MiB" in err
    assert len(err.strip().splitlines()) == 1


def test_small_budgets_keep_a_fixed_allocator_slack(tiny_nvfp4: Path) -> None:
    """A share of a small budget cannot hold the cuBLAS workspace and the allocator's
    segments: the slack has a floor. A budget below what is fixed is refused with the
    numbers."""
    cfg = gpu("1200MiB", max_context=128, max_num_batched_tokens=32)
    plan = plan_checkpoint(cfg, tiny_nvfp4, reference_device(cfg))
    assert dict(plan.workspace)["allocator slack"] == ALLOCATOR_SLACK_MIN
    assert dict(plan35(gpu(kv="iso3")).workspace)["allocator slack"] == int(
        ALLOCATOR_SLACK * plan35(gpu(kv="iso3")).allocator_cap)
    fixed = plan.gpu_bytes - plan.num_routed_experts * plan.expert_slot_bytes - plan.embed_bytes
    cfg = gpu(str(fixed - MiB), max_context=128, max_num_batched_tokens=32)
    with pytest.raises(PlanError, match=r"needs at least [\d,.]+ MiB .* budget is"):
        plan_checkpoint(cfg, tiny_nvfp4, reference_device(cfg))

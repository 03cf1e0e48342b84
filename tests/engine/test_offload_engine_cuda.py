"""The engine with offloaded routed experts on CUDA (tiny NVFP4 checkpoint): greedy tokens
match the all-resident CUDA engine with a forced small expert cache (decode graphs on), with
the embedding on the host, and with a `gpu_memory` budget that makes the planner offload (that
engine is built in a fresh process, whose allocator peak must stay within the budget)."""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tinyserve.core import SamplingParams
from tinyserve.engine import build
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.device_memory import DeviceMemory
from tinyserve.engine.llm import LLM
from tinyserve.engine.planner import plan_checkpoint
from tinyserve.model.config import load_config
from tinyserve.offload.provider import OffloadedExperts

pytestmark = pytest.mark.requires_cuda

PROMPTS = ["Hello, how are you?", "The quick brown fox jumps over the lazy dog. " * 2, "42"]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
COMMON = dict(device="cuda", max_context=128, max_seqs=3, max_num_batched_tokens=32)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("modelopt")


def _run(ckpt, dtype: str, **kwargs) -> tuple[list[list[int]], object, object]:
    gc.collect()  # earlier engines' memory back before a build that may cap the allocator
    torch.cuda.empty_cache()
    with LLM(str(ckpt), dtype=dtype, **COMMON, **kwargs) as llm:
        if dtype == "float32":
            tokens = [c.token_ids for c in llm.generate(PROMPTS, GREEDY)]
        else:  # one prompt at a time: batches that do not depend on when requests arrive
            tokens = [llm.generate([p], GREEDY)[0].token_ids for p in PROMPTS]
        return tokens, llm.engine.stats(), llm.engine.runner


def _same(got: list[list[int]], want: list[list[int]], dtype: str) -> None:
    if dtype == "float32":
        assert got == want
    else:  # bf16: slot numbering changes the fused-MoE tiling, a late near-tie may flip.
        # Together the prompts would batch by arrival time (the engine loop runs beside
        # `generate`): a different batching flipped a token as early as the fourth under 10
        # parallel test workers.
        for g, w in zip(got, want, strict=True):
            common = next((i for i, (a, b) in enumerate(zip(g, w, strict=True)) if a != b), len(w))
            assert common >= len(w) // 2, (g, w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_forced_small_cache_matches_resident(ckpt, dtype: str) -> None:
    cfg = load_config(ckpt)
    want, rstats, _ = _run(ckpt, dtype)
    got, stats, runner = _run(ckpt, dtype, expert_cache_slots=cfg.num_experts + 4)
    _same(got, want, dtype)
    assert isinstance(runner.model.experts, OffloadedExperts)
    assert rstats.expert_cache_hit_rate is None
    assert stats.expert_cache_misses > cfg.num_layers * cfg.num_experts
    assert stats.expert_cache_h2d_bytes > 0


def test_embedding_on_the_host_matches_resident(ckpt, monkeypatch) -> None:
    want, _, _ = _run(ckpt, "float32")
    real = build.plan_engine

    def plan(config, path=None, **kwargs):
        p = real(config, path, **kwargs)
        return dataclasses.replace(p, embed_device="cpu", expert_cache=True,
                                   expert_slots=p.experts_per_layer + 4)

    monkeypatch.setattr(build, "plan_engine", plan)
    got, stats, runner = _run(ckpt, "float32")
    assert got == want
    assert runner.model.embed_tokens.device.type == "cpu"
    assert isinstance(runner.model.experts, OffloadedExperts)
    assert stats.expert_cache_misses > 0


# Builds one engine in a fresh process (argv[1]: JSON {model, kwargs, prompts, params}) and
# prints one line "RESULT {json}": greedy tokens (the prompts one at a time, as `_run` in
# bf16), expert-cache counters, placement, plan, and the allocator's peak. A fresh process,
# because the allocator cap set for a budget counts every byte the process still holds
# (earlier engines, fixtures, the caching allocator).
CHILD = r"""
import json, sys
import torch
from tinyserve.core import SamplingParams
from tinyserve.engine.llm import LLM

args = json.loads(sys.argv[1])
with LLM(args["model"], **args["kwargs"]) as llm:
    params = SamplingParams(**args["params"])
    done = [llm.generate([p], params)[0] for p in args["prompts"]]  # one at a time, as _run
    stats, runner, plan = llm.engine.stats(), llm.engine.runner, llm.engine.memory_plan
    experts = runner.model.experts
    out = {"tokens": [c.token_ids for c in done],
           "experts": type(experts).__name__,
           "slots": getattr(getattr(experts, "cache", None), "num_slots", None),
           "embed_device": runner.model.embed_tokens.device.type,
           "misses": stats.expert_cache_misses, "h2d_bytes": stats.expert_cache_h2d_bytes,
           "plan": None if plan is None else {
               "gpu_memory": plan.gpu_memory, "expert_slots": plan.expert_slots,
               "embed_device": plan.embed_device, "allocator_cap": plan.allocator_cap},
           "max_reserved": torch.cuda.max_memory_reserved() if torch.cuda.is_available() else 0}
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(ckpt, **kwargs) -> dict:
    """Generate PROMPTS greedily with an engine of `kwargs` in a fresh Python process."""
    root = Path(__file__).resolve().parents[2]
    args = {"model": str(ckpt), "kwargs": kwargs, "prompts": PROMPTS,
            "params": {"max_tokens": GREEDY.max_tokens, "temperature": 0.0, "ignore_eos": True}}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p))
    res = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=240)
    lines = [x for x in res.stdout.splitlines() if x.startswith("RESULT ")]
    assert res.returncode == 0 and lines, (res.returncode, res.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT "):])


def test_gpu_memory_budget_offloads(ckpt) -> None:
    want = _run(ckpt, "bfloat16")[0]  # unbudgeted, in this process (no allocator cap here)
    config = EngineConfig(model=str(ckpt), dtype="bfloat16", **COMMON)
    nothing_outside = DeviceMemory(device="cuda", budget=1 << 30, budget_source="test")
    full = plan_checkpoint(config, ckpt, nothing_outside)
    assert not full.experts_offloaded and full.embed_device == "cuda"
    # The allocator's share of a plan of 12 expert slots with the embedding on the host
    # (the allocator slack is at its floor for these budgets, so the arithmetic carries over)
    inside = (full.allocated_bytes - full.embed_bytes
              - (full.num_routed_experts - 12) * full.expert_slot_bytes)
    # ... plus what a child process holds outside the allocator (measured there at start-up;
    # resident: no host mappings), plus the device page tables of the host memory an
    # offloaded plan registers (the embedding and every routed expert)
    first = run_child(ckpt, dtype="bfloat16", gpu_memory="4GiB", **COMMON)["plan"]
    host = full.embed_bytes + full.num_routed_experts * full.expert_slot_bytes
    mappings = sum(b for _, b, _ in nothing_outside.outside_allocator(host)) - sum(
        b for _, b, _ in nothing_outside.outside_allocator(0))
    budget = inside + first["gpu_memory"] - first["allocator_cap"] + mappings
    got = run_child(ckpt, dtype="bfloat16", gpu_memory=budget, **COMMON)
    plan = got["plan"]
    assert plan["gpu_memory"] == budget and plan["embed_device"] == "cpu"
    assert got["experts"] == "OffloadedExperts"
    assert got["slots"] == plan["expert_slots"] and 8 <= plan["expert_slots"] <= 16
    assert got["embed_device"] == "cpu"
    assert got["misses"] > 0 and got["h2d_bytes"] > 0
    cap = plan["allocator_cap"]  # what the allocator may reserve under the budget
    assert got["max_reserved"] <= cap <= budget, (got["max_reserved"], cap, budget)
    _same(got["tokens"], want, "bfloat16")

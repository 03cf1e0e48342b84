"""`--experts auto` settled by decoding: where the start-up probe predicts the hybrid split
faster than gpu-only (`offload.hybrid.plan_split`), the started engine decodes a few greedy
tokens in each mode (gpu, cpu, hybrid) and keeps the fastest. The probe times one layer's
misses alone; a decode step also runs the layer's other work, its misses vary with the cache's
hits, and the copies and the CPU share the host's memory with everything else the step does,
so the prediction can be wrong either way."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any

import torch

from tinyserve.core import SamplingParams
from tinyserve.log import get_logger
from tinyserve.offload.hybrid import HybridPlan

logger = get_logger(__name__)

SETTLE_TOKENS = 32  # decode steps timed per mode
_SKIP = 4  # first steps not timed (the decode graph's capture, the cache filling)


def settle_expert_mode(engine: Any, tokens: int = SETTLE_TOKENS) -> HybridPlan | None:
    """Decode `tokens` greedy tokens of a random prompt with gpu-only, cpu-only and the auto
    plan's hybrid split, and keep the fastest (its plan's `decode_tok_s` holds every rate).
    Returns that plan, or None where nothing was left to settle (no auto plan, or auto chose
    gpu)."""
    experts = getattr(getattr(engine.runner, "model", None), "experts", None)
    plan: HybridPlan | None = getattr(experts, "hybrid_plan", None)
    if plan is None or not plan.auto or plan.mode != "hybrid" or plan.decode_tok_s:
        return None
    runner = experts.cpu_runner
    rates = {}
    for seed, mode in enumerate(("gpu", "cpu", "hybrid")):
        engine.set_expert_plan(plan.with_mode(mode), runner)
        rates[mode] = decode_rate(engine, tokens, seed)
    best = max(rates, key=rates.__getitem__)
    settled = replace(plan.with_mode(best), decode_tok_s=rates)
    engine.set_expert_plan(settled, runner)
    logger.info("experts: decoding measured %s: %s kept", ", ".join(
        f"{m} {r:.1f} tok/s" for m, r in rates.items()), best)
    return settled


def decode_rate(engine: Any, tokens: int, seed: int) -> float:
    """Decode tokens/s of one greedy request of `tokens` tokens after a short random prompt
    drawn with `seed`, its first `_SKIP` steps left out. NOTE: each mode decodes its own
    prompt: the experts of tokens decoded before stay in the cache, and a mode that repeats
    them would time hits the others paid for as misses."""
    prompt = engine.random_prompt(16, torch.Generator().manual_seed(seed))
    handle = engine.submit(prompt, SamplingParams(max_tokens=tokens + _SKIP + 1,
                                                  temperature=0.0, ignore_eos=True),
                           request_id="experts-settle")
    times: list[float] = []
    for out in handle:
        if out.error:
            raise RuntimeError(f"the expert-mode decode failed: {out.error}")
        times.extend([time.perf_counter()] * len(out.token_ids))
    timed = times[_SKIP:]
    if len(timed) < 2 or timed[-1] <= timed[0]:
        raise RuntimeError("the expert-mode decode produced too few tokens to time")
    return (len(timed) - 1) / (timed[-1] - timed[0])

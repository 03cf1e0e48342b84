"""Assemble an engine from a checkpoint path and an EngineConfig.

checkpoint -> ModelConfig, tokenizer -> the memory plan (`engine.planner`: on a GPU, the device
measured and torch's allocator capped at the budget less what lives outside it) -> weights
(without the routed experts when the plan puts them behind a cache: OffloadedExperts over a
pinned host store) -> GDN state pool (one slot per sequence, then the prefix cache's snapshot
slots, then the decode graphs' padding slot) -> KV pool -> Qwen35Model -> ModelRunner ->
Engine. Every number (sequences, KV pages, state slots, expert slots, embedding placement)
is the plan's; the work is reported to a `LoadProgress`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyserve.engine import kernel_check
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.device_memory import cap_allocator
from tinyserve.engine.loop import Engine, EngineParts
from tinyserve.engine.memory_plan import MemoryPlan
from tinyserve.engine.planner import plan_engine
from tinyserve.engine.progress import EXPERTS, PINNING, WEIGHTS, LoadProgress
from tinyserve.engine.runner import ModelRunner
from tinyserve.kv.registry import create_kv_backend
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.log import get_logger
from tinyserve.model.config import ModelConfig, load_config
from tinyserve.model.loader import load_weights, resolve_model_path
from tinyserve.model.qwen35 import Qwen35Model
from tinyserve.offload import hybrid
from tinyserve.offload.provider import load_offloaded_experts

log = get_logger(__name__)


def build_engine(config: EngineConfig, *, plan: MemoryPlan | None = None,
                 progress: LoadProgress | None = None) -> Engine:
    """Load the checkpoint and return a (not yet started) Engine, with `plan` (default: the
    plan `planner.plan_engine` makes for `config`). Raises ValueError / FileNotFoundError
    with one-line messages on bad checkpoints or impossible budgets."""
    return Engine(build_parts(config, plan=plan, progress=progress), config)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's Hugging Face tokenizer. Raises ValueError when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
                         ) from None


def expect_work(progress: LoadProgress, path: Path, mcfg: ModelConfig, plan: MemoryPlan) -> None:
    """Announce the loading work of `plan` to `progress` (from the safetensors headers)."""
    from tinyserve.model.loader import CheckpointReader
    from tinyserve.model.loader_plan import plan_weights

    with CheckpointReader(path) as reader:
        entries = plan_weights(reader, mcfg)
    experts = sum(e.nbytes for e in entries if e.is_expert) if plan.expert_cache else 0
    progress.expect(WEIGHTS, sum(e.nbytes for e in entries) - experts)
    if plan.expert_cache:
        progress.expect(EXPERTS, experts)
        if plan.is_cuda:
            progress.expect(PINNING, plan.host_expert_bytes)


def build_parts(config: EngineConfig, *, plan: MemoryPlan | None = None,
                progress: LoadProgress | None = None) -> EngineParts:
    path = resolve_model_path(config.model)
    mcfg = load_config(path)
    tokenizer = load_tokenizer(path)
    if plan is None:
        plan = plan_engine(config, path)
    device = torch.device(plan.device)
    kernel_check.check(device)  # before any weight loads: a missing compiler is one line
    dtype = config.torch_dtype
    if plan.is_cuda:
        assert plan.allocator_cap is not None
        cap_allocator(plan.allocator_cap, device.index or 0)
    progress = progress or LoadProgress()
    expect_work(progress, path, mcfg, plan)
    # NOTE: with the embedding on the host, decode graphs start from the hidden states that
    # the host gathers each step, or read the registered table (`engine.graph`).
    embed_device = "cpu" if plan.is_cuda and plan.embed_device == "cpu" else None
    progress.begin(WEIGHTS)
    weights = load_weights(path, mcfg, dtype=dtype, device=device,
                           include_experts=not plan.expert_cache,
                           on_entry=lambda n: progress.advance(WEIGHTS, n))
    if embed_device == "cpu":  # off the device before the cache and KV pool take their share
        weights["embed_tokens"] = weights["embed_tokens"].cpu()
    experts = None
    if plan.expert_cache:
        progress.begin(PINNING if plan.is_cuda else EXPERTS)
        experts = load_offloaded_experts(path, mcfg, plan, device=device, dtype=dtype,
                                         on_pinned=lambda n: progress.advance(PINNING, n),
                                         on_read=lambda n: progress.advance(EXPERTS, n))
        for stage in (PINNING, EXPERTS):  # (pinning may have been refused: a warning said so)
            progress.complete(stage)
        # the CPU part of `config.experts` (probed and logged)
        hybrid.configure(experts, config.experts, mcfg.num_experts_per_tok)
    states = GDNStatePool.for_config(mcfg, plan.state_slots, device=device, dtype=dtype)
    kv = create_kv_backend(plan.kv_format, layer_ids=list(mcfg.full_attention_layers),
                           num_kv_heads=mcfg.num_kv_heads, num_q_heads=mcfg.num_attention_heads,
                           head_dim=mcfg.head_dim,
                           num_pages=plan.kv_pages, page_size=config.page_size, device=device,
                           dtype=dtype)
    model = Qwen35Model(mcfg, weights, kv=kv, states=states, experts=experts, device=device,
                        dtype=dtype, embed_device=embed_device)
    del weights
    seqs, snaps = plan.max_seqs, plan.snapshot_slots
    # NOTE: the slot after the snapshots takes the padded rows of decode graphs (the plan
    # counts it on every device; the runner captures graphs on CUDA only).
    pad_slot = seqs + snaps if config.cuda_graphs else None
    runner = ModelRunner(model, page_size=config.page_size, cuda_graphs=config.cuda_graphs,
                         graph_pad_slot=pad_slot, keep_logits=False)
    eos = tuple(dict.fromkeys(mcfg.eos_token_ids + _tokenizer_eos(tokenizer)))
    if device.type == "cuda":
        log.info("kernels: %s", "; ".join(
            f"{k}: {v}" for k, v in kernel_check.implementations(device, kv).items()))
    log.info("%s: %d KV pages of %d tokens (%s), %d sequences (+%d prefix-cache snapshots), "
             "max context %d tokens, %s", path.name, plan.kv_pages,
             config.page_size, plan.kv_format, seqs, snaps, plan.max_context,
             f"expert cache of {plan.expert_slots} slots" if plan.expert_cache
             else "experts resident")
    return EngineParts(runner=runner, tokenizer=tokenizer, model_config=mcfg,
                       num_kv_pages=plan.kv_pages, num_state_slots=seqs,
                       max_context=plan.max_context, eos_token_ids=eos, state_pool=states,
                       snapshot_slots=tuple(range(seqs, seqs + snaps)), memory_plan=plan)


def _tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()

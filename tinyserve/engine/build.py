"""Assemble an engine from a checkpoint path and an EngineConfig.

checkpoint -> ModelConfig, tokenizer -> (CUDA) memory plan for --gpu-memory: allocator cap,
expert offload, embedding placement, KV pages -> weights (without the routed experts when they
are offloaded: OffloadedExperts over a pinned host store) -> GDN state pool (one slot per
sequence, then the prefix cache's snapshot slots) -> KV pool (from the plan, the memory left,
or max_context x max_seqs on CPU) -> Qwen35Model -> ModelRunner -> Engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyserve.engine import kernel_check
from tinyserve.engine.config import EngineConfig
from tinyserve.engine.loop import Engine, EngineParts
from tinyserve.engine.runner import ModelRunner
from tinyserve.kv.registry import create_kv_backend, kv_bytes_per_token
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.log import get_logger
from tinyserve.model.config import ModelConfig, load_config
from tinyserve.model.loader import load_weights, resolve_model_path
from tinyserve.model.qwen35 import Qwen35Model
from tinyserve.offload import hybrid
from tinyserve.offload.planner import MemoryPlan, PlanConfig, PlanError, plan_checkpoint
from tinyserve.offload.provider import OffloadedExperts
from tinyserve.offload.store import HostExpertStore

log = get_logger(__name__)

# Activations and workspace kept free on the GPU beside the weights, states and KV pool.
_GPU_RESERVE = 512 * 2**20


def build_engine(config: EngineConfig) -> Engine:
    """Load the checkpoint and return a (not yet started) Engine. Raises ValueError /
    FileNotFoundError with one-line messages on bad checkpoints or impossible budgets."""
    return Engine(build_parts(config), config)


def load_tokenizer(path: str | Path) -> Any:
    """The checkpoint's Hugging Face tokenizer. Raises ValueError when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise ValueError(f"{path}: cannot load the tokenizer ({type(exc).__name__}: "
                         f"{str(exc).strip().splitlines()[0] if str(exc).strip() else ''})"
                         ) from None


def build_parts(config: EngineConfig) -> EngineParts:
    path = resolve_model_path(config.model)
    mcfg = load_config(path)
    tokenizer = load_tokenizer(path)
    device = torch.device(config.resolved_device)
    kernel_check.check(device)  # before any weight loads: a missing compiler is one line
    dtype = config.torch_dtype
    num_snap = config.num_snapshot_slots
    # NOTE: one more slot after the snapshots for the padded rows of decode graphs (kept on
    # every device, as the planner counts it; the runner captures graphs on CUDA only).
    pad_slot = config.max_seqs + num_snap
    graphs = config.cuda_graphs
    plan = memory_plan(config, path, device) if device.type == "cuda" else None
    if plan is not None and config.gpu_memory is not None:
        cap_allocator(plan, device)
    slots = config.expert_cache_slots
    if slots is None and plan is not None and plan.experts_offloaded:
        slots = plan.expert_slots
    # NOTE: with the embedding on the host, decode graphs start from the hidden states that
    # the host gathers each step (`engine.graph`).
    embed_device = "cpu" if plan is not None and plan.embed_device == "cpu" else None
    weights = load_weights(path, mcfg, dtype=dtype, device=device,
                           include_experts=slots is None)
    if embed_device == "cpu":  # off the device before the cache and KV pool take their share
        weights["embed_tokens"] = weights["embed_tokens"].cpu()
    experts = None if slots is None else offloaded_experts(path, mcfg, slots, config, device,
                                                           dtype)
    states = GDNStatePool.for_config(mcfg, pad_slot + int(graphs), device=device, dtype=dtype)
    num_pages = kv_pages(config, mcfg, device, path, plan=plan)
    kv = create_kv_backend(config.kv, layer_ids=list(mcfg.full_attention_layers),
                           num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
                           num_pages=num_pages, page_size=config.page_size, device=device,
                           dtype=dtype)
    model = Qwen35Model(mcfg, weights, kv=kv, states=states, experts=experts, device=device,
                        dtype=dtype, embed_device=embed_device)
    del weights
    runner = ModelRunner(model, page_size=config.page_size, device=device, cuda_graphs=graphs,
                         graph_pad_slot=pad_slot if graphs else None, keep_logits=False)
    max_context = min(mcfg.max_position_embeddings, num_pages * config.page_size,
                      config.max_context or mcfg.max_position_embeddings)
    eos = tuple(dict.fromkeys(mcfg.eos_token_ids + _tokenizer_eos(tokenizer)))
    if device.type == "cuda":
        log.info("kernels: %s", "; ".join(
            f"{k}: {v}" for k, v in kernel_check.implementations(device, config.kv).items()))
    log.info("%s: %d KV pages of %d tokens (%s), %d state slots (+%d prefix-cache snapshots), "
             "max context %d tokens, %s", path.name, num_pages, config.page_size, config.kv,
             config.max_seqs, num_snap, max_context,
             "experts resident" if slots is None else f"expert cache of {slots} slots")
    return EngineParts(runner=runner, tokenizer=tokenizer, model_config=mcfg,
                       num_kv_pages=num_pages, num_state_slots=config.max_seqs,
                       max_context=max_context, eos_token_ids=eos, state_pool=states,
                       snapshot_slots=tuple(range(config.max_seqs, config.max_seqs + num_snap)),
                       snapshot_interval=config.prefix_snapshot_interval, memory_plan=plan)


def plan_config(config: EngineConfig, gpu_memory: int,
                max_position: int | None = None) -> PlanConfig:
    """The planner's request for this engine config and a GPU budget in bytes (max_context
    capped at the model's `max_position` when given, as the engine caps it)."""
    context = config.max_context
    if context is not None and max_position is not None:
        context = min(context, max_position)
    return PlanConfig(gpu_memory=gpu_memory, kv=config.kv, max_context=context,
                      max_seqs=config.max_seqs, page_size=config.page_size,
                      prefill_chunk=config.max_num_batched_tokens,
                      extra_state_slots=config.num_snapshot_slots + int(config.cuda_graphs),
                      dtype_bytes=config.torch_dtype.itemsize)


def memory_plan(config: EngineConfig, path: Path, device: torch.device) -> MemoryPlan | None:
    """The memory plan for `gpu_memory`. Raises PlanError (a ValueError) with the numbers when
    the model cannot fit. Without `gpu_memory` the plan is for the device's free memory, and
    None (every expert resident, as without a plan) when even that plan fails."""
    budget = config.gpu_memory_bytes
    max_position = load_config(path).max_position_embeddings
    if budget is not None:
        return plan_checkpoint(path, plan_config(config, budget, max_position))
    free, _ = torch.cuda.mem_get_info(device)
    try:
        return plan_checkpoint(path, plan_config(config, free, max_position))
    except PlanError as exc:
        log.warning("no memory plan for the free GPU memory (%s): all experts resident", exc)
        return None


def cap_allocator(plan: MemoryPlan, device: torch.device) -> None:
    """Cap the caching allocator at the budget (less the CUDA context the plan reserves) so
    that an allocation past it fails loudly instead of using the rest of a bigger card."""
    total = torch.cuda.get_device_properties(device).total_memory
    context = dict(plan.workspace).get("cuda context", 0)
    fraction = min(1.0, max(plan.gpu_memory - context, 1) / total)
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    log.info("GPU allocator capped at %.2f GiB of %.2f GiB", fraction * total / 2**30,
             total / 2**30)


def offloaded_experts(path: Path, mcfg: ModelConfig, num_slots: int, config: EngineConfig,
                      device: torch.device, dtype: torch.dtype) -> OffloadedExperts:
    """The checkpoint's routed experts in a pinned host store behind `num_slots` cache slots
    on `device` (at least one layer's experts; all of them preloaded when they fit), with the
    CPU part of `config.experts` (`offload.hybrid.configure`: probed and logged)."""
    store = HostExpertStore.from_checkpoint(path, mcfg, dtype=dtype)
    experts = OffloadedExperts.create(
        store, num_slots, device=device, dtype=dtype,
        max_ids=config.max_num_batched_tokens * mcfg.num_experts_per_tok)
    if num_slots >= mcfg.num_layers * mcfg.num_experts:
        experts.cache.preload_all()
    hybrid.configure(experts, config.experts, mcfg.num_experts_per_tok)
    return experts


def kv_pages(config: EngineConfig, mcfg: ModelConfig, device: torch.device,
             path: Path | None = None, plan: MemoryPlan | None = None) -> int:
    """Number of KV pages: `num_kv_pages` when given; on CPU enough for max_seqs sequences of
    max_context tokens; on CUDA the memory plan's number when `gpu_memory` is given or the plan
    offloads experts; else what the free memory leaves after the weights and states (capped
    at that same need). Raises ValueError when not even one page fits."""
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if device.type == "cuda" and plan is None and config.gpu_memory is not None \
            and path is not None:
        plan = memory_plan(config, path, device)  # (not None with gpu_memory)
    if device.type == "cuda" and plan is not None and (
            config.gpu_memory is not None or plan.experts_offloaded):
        return plan.kv_pages
    context = min(config.max_context or mcfg.max_position_embeddings,
                  mcfg.max_position_embeddings)
    need = -(-context // config.page_size) * config.max_seqs
    if device.type != "cuda":
        return need
    page_bytes = config.page_size * kv_bytes_per_token(
        config.kv, len(mcfg.full_attention_layers), mcfg.num_kv_heads, mcfg.head_dim)
    free, _ = torch.cuda.mem_get_info(device)
    budget = config.gpu_memory_bytes
    available = free if budget is None else min(free, budget - torch.cuda.memory_allocated(device))
    usable = int((available - _GPU_RESERVE) * config.kv_memory_fraction)
    pages = min(need, usable // page_bytes)
    if pages < 1:
        raise ValueError(f"no GPU memory left for the KV cache: {available / 2**30:.2f} GiB "
                         f"available after the weights, {_GPU_RESERVE / 2**30:.2f} GiB reserved "
                         f"for activations; raise --gpu-memory or lower --max-seqs")
    return pages


def _tokenizer_eos(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return (eos,) if isinstance(eos, int) else ()

"""Assemble an engine from a checkpoint path and an EngineConfig.

checkpoint -> ModelConfig, tokenizer, weights -> GDN state pool (one slot per sequence, then
the prefix cache's snapshot slots) ->
KV pool (sized from the memory left, or from max_context x max_seqs on CPU) -> Qwen35Model ->
ModelRunner -> Engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyserve.engine.config import EngineConfig
from tinyserve.engine.loop import Engine, EngineParts
from tinyserve.engine.runner import ModelRunner
from tinyserve.kv.registry import create_kv_backend, kv_bytes_per_token
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.log import get_logger
from tinyserve.model.config import ModelConfig, load_config
from tinyserve.model.loader import load_weights, resolve_model_path
from tinyserve.model.qwen35 import Qwen35Model

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
    dtype = config.torch_dtype
    weights = load_weights(path, mcfg, dtype=dtype, device=device)
    num_snap = config.num_snapshot_slots
    # NOTE: one more slot after the snapshots for the padded rows of captured decode graphs.
    pad_slot = config.max_seqs + num_snap
    graphs = config.cuda_graphs and device.type == "cuda"
    states = GDNStatePool.for_config(mcfg, pad_slot + int(graphs), device=device, dtype=dtype)
    num_pages = kv_pages(config, mcfg, device, path)
    kv = create_kv_backend(config.kv, layer_ids=list(mcfg.full_attention_layers),
                           num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
                           num_pages=num_pages, page_size=config.page_size, device=device,
                           dtype=dtype)
    model = Qwen35Model(mcfg, weights, kv=kv, states=states, device=device, dtype=dtype)
    del weights
    runner = ModelRunner(model, page_size=config.page_size, device=device, cuda_graphs=graphs,
                         graph_pad_slot=pad_slot if graphs else None)
    max_context = min(mcfg.max_position_embeddings, num_pages * config.page_size,
                      config.max_context or mcfg.max_position_embeddings)
    eos = tuple(dict.fromkeys(mcfg.eos_token_ids + _tokenizer_eos(tokenizer)))
    log.info("%s: %d KV pages of %d tokens (%s), %d state slots (+%d prefix-cache snapshots), "
             "max context %d tokens", path.name, num_pages, config.page_size, config.kv,
             config.max_seqs, num_snap, max_context)
    return EngineParts(runner=runner, tokenizer=tokenizer, model_config=mcfg,
                       num_kv_pages=num_pages, num_state_slots=config.max_seqs,
                       max_context=max_context, eos_token_ids=eos, state_pool=states,
                       snapshot_slots=tuple(range(config.max_seqs, config.max_seqs + num_snap)),
                       snapshot_interval=config.prefix_snapshot_interval)


def kv_pages(config: EngineConfig, mcfg: ModelConfig, device: torch.device,
             path: Path | None = None) -> int:
    """Number of KV pages: `num_kv_pages` when given; on CPU enough for max_seqs sequences of
    max_context tokens; on CUDA with `gpu_memory` the memory planner's number; on CUDA without
    it what the free memory leaves after the weights and states (capped at that same need).
    Raises ValueError when not even one page fits."""
    if config.num_kv_pages is not None:
        return config.num_kv_pages
    if device.type == "cuda" and config.gpu_memory is not None and path is not None:
        from tinyserve.offload.planner import PlanConfig, plan_checkpoint

        plan = plan_checkpoint(path, PlanConfig(
            gpu_memory=config.gpu_memory_bytes, kv=config.kv, max_context=config.max_context,
            max_seqs=config.max_seqs, page_size=config.page_size,
            prefill_chunk=config.max_num_batched_tokens,
            extra_state_slots=config.num_snapshot_slots + int(config.cuda_graphs)))
        if plan.experts_offloaded:
            log.warning("the plan offloads experts, which the engine does not do yet: all "
                        "experts are loaded onto the GPU")
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

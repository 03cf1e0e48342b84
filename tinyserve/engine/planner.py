"""The memory planner and `tinyserve plan` (specs/qwen35_moe.md §7).

`EngineConfig` + model geometry and weight bytes + `DeviceMemory` -> one `MemoryPlan` for
`plan`, `run`, `bench` and `LLM`. On a GPU: all resident if it fits (whole or `DEFAULT_CONTEXT`
context), else the embedding to host RAM, else the experts behind a cache of at least one layer
with one sequence and `DEFAULT_CONTEXT` tokens (or half what is left). CPU: all resident.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from tinyserve.engine.config import DEFAULT_CONTEXT, DEFAULT_MAX_SEQS, EngineConfig
from tinyserve.engine.device_memory import DeviceMemory, device_memory
from tinyserve.engine.memory_plan import GiB, MemoryPlan, MiB, PlanError, mib
from tinyserve.engine.weight_bytes import WeightBytes, checkpoint_weight_bytes
from tinyserve.kv.registry import kv_bytes_per_token, resolve_kv
from tinyserve.kv.state_pool import GDNStatePool

GRAPH_POOL = 64 * MiB  # CUDA-graph private pools of the decode graphs
# NOTE: the slack covers the caching allocator's rounding and fragmentation and transient
# buffers (sampler, expert-miss lists, cuBLAS/Triton scratch): a share of the cap, never below
# the floor (the cuBLAS workspace and the allocator's 2/20 MiB segments do not shrink with
# the budget). bench/memory_budget.py measures it.
ALLOCATOR_SLACK = 0.06
ALLOCATOR_SLACK_MIN = 96 * MiB
ALLOCATOR_SLACK_MAX = 1 * GiB  # a big budget's slack need not grow with it


def activation_bytes_per_token(config: Any, dtype_bytes: int = 2) -> int:
    """Peak live activations per prefill token in one layer (hidden, mixer, MoE pairs)."""
    c, d = config, dtype_bytes
    hidden = 4 * c.hidden_size * d  # residual, normed input, mixer out, MoE out
    mixer = max(
        # GDN: qkv before/after conv, z, fp32 q/k/v with key heads repeated, fp32 output
        (2 * c.linear_conv_dim + c.linear_value_dim) * d
        + (3 * c.linear_num_value_heads * c.linear_key_head_dim + c.linear_value_dim) * 4,
        # attention: q|gate, k, v, output
        (3 * c.num_attention_heads * c.head_dim + 2 * c.num_kv_heads * c.head_dim) * d)
    # fused MoE: fp32 intermediate [pairs, F] and per-pair output [pairs, H]; router fp32
    moe = (c.num_experts_per_tok * (c.moe_intermediate_size + c.hidden_size) * 4
           + c.num_experts * 4 + 2 * c.shared_expert_intermediate_size * d)
    return hidden + mixer + moe


class _Sizes:
    """The byte arithmetic of one (config, model, weights, device)."""

    def __init__(self, config: EngineConfig, model: Any, weights: WeightBytes,
                 device: DeviceMemory) -> None:
        self.cfg, self.model, self.w, self.dev = config, model, weights, device
        self.dtype_bytes = config.dtype_on(device.device).itemsize
        self.kv = resolve_kv(config.kv, model.head_dim, device.is_cuda)
        self.kv_tok = kv_bytes_per_token(self.kv, len(model.full_attention_layers),
                                         model.num_kv_heads, model.head_dim)
        if self.kv == "bf16":  # NOTE: that pool stores the model dtype (fp32 on the CPU)
            self.kv_tok = self.kv_tok * self.dtype_bytes // 2
        self.per_slot = GDNStatePool.bytes_per_slot(model, self.dtype_bytes)
        self.scratch_tok = 2 * model.num_kv_heads * model.head_dim * self.dtype_bytes
        self.page = config.page_size
        self.max_pos = model.max_position_embeddings
        self.embed = 0 if weights.tied else weights.embed  # tied: it is the lm_head

    def state_slots(self, seqs: int) -> int:
        return seqs + self.cfg.snapshot_slots(seqs) + int(self.cfg.cuda_graphs)

    def pages(self, tokens: int) -> int:
        if self.cfg.num_kv_pages is not None:
            return self.cfg.num_kv_pages
        return -(-tokens // self.page)

    def outside(self, embed_device: str, expert_cache: bool) -> tuple[tuple[str, int, str], ...]:
        mapped = self.embed if embed_device == "cpu" else 0
        mapped += self.w.num_routed_experts * self.w.expert_bytes if expert_cache else 0
        return self.dev.outside_allocator(mapped)

    def workspace(self, tokens: int, seqs: int, cap: int) -> tuple[tuple[str, int], ...]:
        m, cfg = self.model, self.cfg
        items = [
            ("prefill activations", cfg.max_num_batched_tokens
             * activation_bytes_per_token(m, self.dtype_bytes)),
            # extend attention reads one layer's prefix as K and V in the model dtype
            ("attention scratch", min(tokens, self.pages(tokens) * self.page) * self.scratch_tok),
            ("logits", seqs * m.vocab_size * 4 * 2),
            # a penalised sequence's token counts on the device (engine/sampler.TokenCounts):
            # tokens seen (bool) and output counts (fp32)
            ("penalty counts", seqs * m.vocab_size * 5),
        ]
        if cfg.cuda_graphs:
            items.append(("cuda graphs", GRAPH_POOL))
        slack = min(ALLOCATOR_SLACK_MAX, max(ALLOCATOR_SLACK_MIN, int(cap * ALLOCATOR_SLACK)))
        items.append(("allocator slack", slack))
        return tuple(items)

    def make(self, *, tokens: int, seqs: int, embed_device: str, expert_cache: bool,
             slots: int) -> MemoryPlan:
        """The plan of these choices; on a GPU its `free_bytes` < 0 when it does not fit."""
        dev, cfg, m = self.dev, self.cfg, self.model
        cuda = dev.is_cuda
        pages = self.pages(tokens) if cuda or cfg.num_kv_pages is not None \
            else self.pages(tokens) * seqs
        outside = self.outside(embed_device, expert_cache) if cuda else ()
        cap = dev.budget - sum(b for _, b, _ in outside) if cuda else 0
        return MemoryPlan(
            device=dev.device, device_name=dev.name, gpu_memory=dev.budget,
            budget_source=dev.budget_source, outside_allocator=outside,
            resident_weights=self.w.resident_groups(), embed_device=embed_device,
            embed_bytes=self.embed, workspace=self.workspace(tokens, seqs, cap) if cuda else (),
            prefill_chunk=cfg.max_num_batched_tokens, max_seqs=seqs,
            snapshot_slots=cfg.snapshot_slots(seqs), state_slots=self.state_slots(seqs),
            state_bytes_per_slot=self.per_slot, kv_format=self.kv,
            kv_bytes_per_token=self.kv_tok, page_size=self.page, kv_pages=pages,
            max_context=min(tokens, self.max_pos, self.pages(tokens) * self.page),
            expert_slot_bytes=self.w.expert_bytes, expert_slots=slots,
            num_routed_experts=self.w.num_routed_experts, experts_per_layer=m.num_experts,
            expert_cache=expert_cache)


def plan_memory(config: EngineConfig, model: Any, weights: WeightBytes,
                device: DeviceMemory) -> MemoryPlan:
    """Plan `config` for geometry `model` (a ModelConfig) with `weights` on `device`.
    Raises PlanError (one line, with the numbers)."""
    s, cfg = _Sizes(config, model, weights, device), config
    if cfg.max_context is not None and cfg.max_context > s.max_pos:
        raise PlanError(f"max_context {cfg.max_context} exceeds the model's "
                        f"max_position_embeddings {s.max_pos}")
    forced = cfg.expert_cache_slots
    n, min_slots = weights.num_routed_experts, model.num_experts
    if forced is not None and forced < min_slots:
        raise PlanError(f"expert_cache_slots {forced} is fewer than one layer's {min_slots} "
                        f"experts: the cache must hold at least one layer")
    if forced is not None:
        forced = min(forced, n)
    tokens = min(cfg.max_context or s.max_pos, s.max_pos)
    if not device.is_cuda:
        seqs = cfg.max_seqs or min(DEFAULT_MAX_SEQS, cfg.max_num_batched_tokens)
        return s.make(tokens=tokens, seqs=seqs, embed_device="cpu",
                      expert_cache=forced is not None, slots=forced or n)
    plan = _plan_gpu(s, tokens, forced)
    if cfg.max_context is not None and plan.experts_offloaded and forced is None:
        try:
            default = _plan_gpu(_Sizes(replace(cfg, max_context=None), model, weights, device),
                                s.max_pos, None)
        except PlanError:
            return plan
        if default.experts_offloaded and default.context_tokens != plan.context_tokens:
            plan = replace(plan, default_context=default.context_tokens,
                           default_expert_slots=default.expert_slots)
    return plan


def _plan_gpu(s: _Sizes, tokens: int, forced: int | None) -> MemoryPlan:
    """The first plan that fits, in the module docstring's order (PlanError when none does)."""
    cfg, n = s.cfg, s.w.num_routed_experts
    seqs = cfg.max_seqs or 1

    def resident(context: int, num_seqs: int, embed_device: str) -> MemoryPlan:
        return s.make(tokens=context, seqs=num_seqs, embed_device=embed_device,
                      expert_cache=False, slots=n)

    def cached(tokens: int, slots: int, embed_device: str) -> MemoryPlan:
        return s.make(tokens=tokens, seqs=seqs, embed_device=embed_device, expert_cache=True,
                      slots=slots)

    # Steps 1 and 2: everything resident, with the model's whole context or else (without
    # --max-context) the default one: resident experts beat a big cache.
    contexts = [tokens] if cfg.max_context is not None or cfg.num_kv_pages is not None \
        else sorted({tokens, min(DEFAULT_CONTEXT, tokens)}, reverse=True)
    for context in contexts if forced is None else ():
        plan = resident(context, seqs, "cuda")
        if plan.free_bytes >= 0:
            most = min(DEFAULT_MAX_SEQS, cfg.max_num_batched_tokens)
            while cfg.max_seqs is None and plan.max_seqs < most:
                more = resident(context, plan.max_seqs + 1, "cuda")
                if more.free_bytes < 0:
                    break
                plan = more
            return plan
        if not s.w.tied and (plan := resident(context, seqs, "cpu")).free_bytes >= 0:
            return plan
    # Step 3: offload the experts.
    embed_device = "cuda" if s.w.tied else "cpu"
    min_slots = s.model.num_experts
    if cfg.max_context is None and cfg.num_kv_pages is None:
        spare = cached(0, min_slots, embed_device).free_bytes
        tokens = min(DEFAULT_CONTEXT, s.max_pos, max(spare, 0) // 2 // (s.kv_tok + s.scratch_tok))
        tokens = tokens // s.page * s.page
        if tokens < s.page:
            _refuse(s, cached(s.page, min_slots, embed_device))
    left = cached(tokens, 0, embed_device).free_bytes  # what the expert cache may take
    slots = forced if forced is not None else min(n, max(left, 0) // s.w.expert_bytes)
    plan = cached(tokens, slots, embed_device)
    if slots < min_slots or plan.free_bytes < 0:
        _refuse(s, plan if forced else cached(tokens, min_slots, embed_device))
    return plan


def _refuse(s: _Sizes, plan: MemoryPlan) -> NoReturn:
    """Raise PlanError with what `plan` (with the smallest expert cache allowed) needs."""
    parts = [  # (what, bytes, note): the whole need
        ("outside torch's allocator", plan.outside_allocator_bytes, ""),
        ("weights", plan.resident_weight_bytes, ""),
        ("embedding", plan.embed_bytes if plan.embed_device == "cuda" else 0, ""),
        ("workspace", plan.workspace_bytes, ""),
        ("GDN states", plan.state_bytes, f" ({plan.state_slots} slots)"),
        ("KV", plan.kv_bytes, f" ({plan.context_tokens} tokens {plan.kv_format})"),
        ("expert cache", plan.expert_cache_bytes,
         f" (at least {plan.expert_slots} slots of {plan.expert_slot_bytes / MiB:.2f} MiB)")]
    shown = ", ".join(f"{what} {mib(b)}{note}" for what, b, note in parts
                      if b or what != "embedding")
    hints = ["lower --max-context" if s.cfg.max_context else "",
             "lower --max-seqs" if s.cfg.max_seqs and s.cfg.max_seqs > 1 else "",
             "use --kv iso3" if s.kv == "bf16" else "", "raise --gpu-memory"]
    raise PlanError(f"the model needs at least {mib(plan.gpu_bytes)} of GPU memory but the "
                    f"budget is {s.dev.budget_source}: {shown}; {', '.join(h for h in hints if h)}")


def plan_checkpoint(config: EngineConfig, path: str | Path, device: DeviceMemory) -> MemoryPlan:
    """Plan checkpoint directory `path` from its config files and safetensors headers."""
    from tinyserve.model.config import load_config

    model = load_config(path)
    dtype_bytes = config.dtype_on(device.device).itemsize
    return plan_memory(config, model, checkpoint_weight_bytes(path, model, dtype_bytes), device)


def plan_engine(config: EngineConfig, path: str | Path | None = None, *,
                allow_reference: bool = False) -> MemoryPlan:
    """The plan of `config` on its device (a GPU is measured; `allow_reference`: the
    reference GPU when there is none here)."""
    from tinyserve.model.loader import resolve_model_path

    path = resolve_model_path(config.model) if path is None else Path(path)
    return plan_checkpoint(config, path, device_memory(config, measure=not allow_reference))


def plan_command(args: Any) -> int:
    """`tinyserve plan MODEL ...`: print the plan `tinyserve run` makes with the same flags."""
    config = EngineConfig.from_args(args)
    plan = plan_engine(config, allow_reference=True)
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.format())
    return 0

"""GPU memory planner and `tinyserve plan` (specs/qwen35_moe.md §7).

A checkpoint (or a bare geometry) and a `--gpu-memory` budget -> a frozen `MemoryPlan`:
resident non-expert weights, embedding placement (a CPU row gather when memory is tight),
workspace (CUDA context, the largest prefill chunk's activations, attention scratch, graph
pools), GDN state slots, KV pages, and the GPU expert-cache slots that get what is left.
Only config files and safetensors headers are read, so planning a 20 GB checkpoint takes a
moment. Anything that cannot fit raises `PlanError` with the numbers.

Order of decisions:
1. fixed = resident weights (without the embedding) + workspace + GDN states + KV.
2. Everything (all routed experts and the embedding) fits -> all resident.
3. All experts fit without the embedding -> experts resident, embedding on the CPU.
4. Otherwise the experts are offloaded (pinned host store + GPU slot cache), the embedding
   stays on the CPU, and the cache gets the rest; it must hold at least one layer's experts
   (a prefill chunk can route to all of them).
Without `--max-context`, the KV pool gets the model's whole context when everything is
resident, else `kv_fraction` of what remains after the fixed part (capped at the model's
max_position_embeddings).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from typing import Any

from tinyserve.kv.registry import kv_bytes_per_token
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.offload.weights import WeightBytes, checkpoint_weight_bytes

MiB = 1 << 20
GiB = 1 << 30


class PlanError(ValueError):
    """The model cannot run within the budget; the message carries the numbers."""


@dataclass(frozen=True)
class PlanConfig:
    """What the user asks of the plan (CLI defaults come from these fields)."""

    gpu_memory: int
    kv: str = "bf16"
    max_context: int | None = None
    max_seqs: int = 2
    page_size: int = 16
    prefill_chunk: int = 2048
    extra_state_slots: int = 0  # e.g. GDN snapshots kept by the prefix cache
    cuda_context: int = 320 * MiB  # CUDA context, cuBLAS workspaces, allocator slack
    graph_pool: int = 64 * MiB  # CUDA-graph private pools
    allocator_slack: float = 0.04  # fraction of the budget: allocator rounding, transient buffers
    # NOTE: the slack never goes below this: a small model under a small budget still needs the
    # cuBLAS workspace (32 MiB on sm_90) and the allocator's 2/20 MiB segments, which do not
    # shrink with the budget (a 4% slack left a tiny model ~64 MiB for everything).
    allocator_slack_min: int = 96 * MiB
    # NOTE: 0.27 makes the default 6 GiB iso3 plan of 35B-A3B hold 128k+ tokens (the design
    # target) and still leave ~1,500 expert slots.
    kv_fraction: float = 0.27  # share of the free memory given to KV without --max-context
    embed: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype_bytes: int = 2  # model dtype on the GPU (bf16)

    def __post_init__(self) -> None:
        if self.gpu_memory <= 0:
            raise PlanError(f"the GPU memory budget must be positive, got {self.gpu_memory}")
        if self.max_seqs < 1 or self.page_size < 1 or self.prefill_chunk < 1:
            raise PlanError("max_seqs, page_size and prefill_chunk must be >= 1")
        if self.max_context is not None and self.max_context < 1:
            raise PlanError(f"max_context must be >= 1, got {self.max_context}")
        if self.embed not in ("auto", "cpu", "cuda"):
            raise PlanError(f"embed must be auto, cpu or cuda, got {self.embed!r}")


@dataclass(frozen=True)
class MemoryPlan:
    """Where every byte of the GPU budget goes. All sizes in bytes."""

    gpu_memory: int
    resident_weights: tuple[tuple[str, int], ...]  # (group, bytes) on the GPU, no embedding
    embed_device: str  # "cuda" | "cpu" (row gather on the host)
    embed_bytes: int
    workspace: tuple[tuple[str, int], ...]  # (item, bytes)
    prefill_chunk: int
    state_slots: int
    state_bytes_per_slot: int
    kv_format: str
    kv_bytes_per_token: int
    page_size: int
    kv_pages: int
    max_context: int
    max_seqs: int
    expert_slot_bytes: int
    expert_slots: int
    num_routed_experts: int
    experts_per_layer: int

    @property
    def resident_weight_bytes(self) -> int:
        return sum(b for _, b in self.resident_weights)

    @property
    def workspace_bytes(self) -> int:
        return sum(b for _, b in self.workspace)

    @property
    def state_bytes(self) -> int:
        return self.state_slots * self.state_bytes_per_slot

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.page_size * self.kv_bytes_per_token

    @property
    def context_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * self.expert_slot_bytes

    @property
    def experts_offloaded(self) -> bool:
        return self.expert_slots < self.num_routed_experts

    @property
    def host_expert_bytes(self) -> int:
        """Pinned host RAM for the expert store (0 when every expert is resident)."""
        return self.num_routed_experts * self.expert_slot_bytes if self.experts_offloaded else 0

    @property
    def gpu_bytes(self) -> int:
        embed = self.embed_bytes if self.embed_device == "cuda" else 0
        return (self.resident_weight_bytes + embed + self.workspace_bytes + self.state_bytes
                + self.kv_bytes + self.expert_cache_bytes)

    @property
    def free_bytes(self) -> int:
        return self.gpu_memory - self.gpu_bytes

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["resident_weights"] = dict(self.resident_weights)
        d["workspace"] = dict(self.workspace)
        for name in ("resident_weight_bytes", "workspace_bytes", "state_bytes", "kv_bytes",
                     "context_tokens", "expert_cache_bytes", "experts_offloaded",
                     "host_expert_bytes", "gpu_bytes", "free_bytes"):
            d[name] = getattr(self, name)
        return d

    def format(self) -> str:
        """A human-readable table of the plan."""

        def m(n: int) -> str:
            return f"{n / MiB:10.1f} MiB"

        rows = [f"GPU budget                      {m(self.gpu_memory)}"]
        rows += [f"  weights: {g:<21}{m(b)}" for g, b in self.resident_weights]
        if self.embed_device == "cuda":
            rows.append(f"  embedding (GPU)               {m(self.embed_bytes)}")
        else:
            rows.append(f"  embedding: CPU row gather ({self.embed_bytes / MiB:.1f} MiB host RAM)")
        rows += [f"  workspace: {w:<19}{m(b)}" for w, b in self.workspace]
        gdn = f"GDN states, {self.state_slots} slots"
        rows.append(f"  {gdn:<30}{m(self.state_bytes)}")
        kv = f"KV {self.kv_format}, {self.context_tokens} tokens"
        rows.append(f"  {kv:<30}{m(self.kv_bytes)}")
        pct = 100.0 * self.expert_slots / self.num_routed_experts
        layers = max(1, self.num_routed_experts // self.experts_per_layer)
        rows.append(f"  expert cache: {self.expert_slots} of {self.num_routed_experts} slots "
                    f"({pct:.1f}%, {self.expert_slots / layers:.0f} per layer)")
        rows.append(f"                                {m(self.expert_cache_bytes)}")
        rows.append(f"  unused                        {m(self.free_bytes)}")
        rows.append(f"max context {self.max_context} tokens, {self.max_seqs} sequences, "
                    f"prefill chunk {self.prefill_chunk} tokens")
        if self.experts_offloaded:
            rows.append(f"host RAM: pinned expert store {self.host_expert_bytes / GiB:.2f} GiB")
        return "\n".join(rows)


def parse_size(text: str | int) -> int:
    """'6GiB' / '6GB' / '6000MiB' / '512M' / '6442450944' -> bytes (G/M/K alone are binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(i?)(B?)\s*", text, re.IGNORECASE)
    if not m:
        raise PlanError(f"cannot read the memory size {text!r} (write e.g. 6GiB, 6GB or 5500MiB)")
    value, unit, i, b = m.groups()
    power = " KMGT".index(unit.upper()) if unit else 0
    base = 1000 if (b and not i and unit) else 1024
    return int(float(value) * base**power)


# -------------------------------------------------------------------------------- planning


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


def _workspace(config: Any, req: PlanConfig, max_context: int) -> tuple[tuple[str, int], ...]:
    c = config
    chunk = req.prefill_chunk
    logits_rows = max(req.max_seqs, 1)
    return (
        ("cuda context", req.cuda_context),
        ("prefill activations", chunk * activation_bytes_per_token(c, req.dtype_bytes)),
        # extend attention reads one layer's prefix as bf16 K and V
        ("attention scratch", max_context * 2 * c.num_kv_heads * c.head_dim * req.dtype_bytes),
        ("logits", logits_rows * c.vocab_size * 4 * 2),
        # a penalised sequence's token counts on the device (engine/sampler.TokenCounts):
        # tokens seen (bool) and output counts (fp32)
        ("penalty counts", logits_rows * c.vocab_size * 5),
        ("cuda graphs", req.graph_pool),
        # NOTE: measured on an H200 with a 6 GiB cap: the caching allocator's rounding and
        # transient buffers (sampler, expert-miss lists, cuBLAS/Triton scratch) took ~300 MiB
        # beyond the items above, and the first decode step ran out of memory without this.
        ("allocator slack", max(req.allocator_slack_min,
                                int(req.gpu_memory * req.allocator_slack))),
    )


def plan_for_geometry(config: Any, weights: WeightBytes, request: PlanConfig) -> MemoryPlan:
    """Plan a model of `config`'s geometry whose weights take `weights` bytes.

    Raises PlanError (with the numbers) when it cannot fit.
    """
    c, req = config, request
    kv_tok = kv_bytes_per_token(req.kv, len(c.full_attention_layers), c.num_kv_heads,
                                c.head_dim)
    state_slots = req.max_seqs + req.extra_state_slots
    state_per_slot = GDNStatePool.bytes_per_slot(c, req.dtype_bytes)
    states = state_slots * state_per_slot
    resident = weights.resident_groups()
    resident_total = sum(b for _, b in resident)
    n_experts, slot_bytes = weights.num_routed_experts, weights.expert_bytes
    all_experts = n_experts * slot_bytes
    embed = weights.embed
    if weights.tied:  # the embedding is the lm_head: always on the GPU, counted in `resident`
        embed = 0
    page = req.page_size
    max_pos = c.max_position_embeddings

    def pages(tokens: int) -> int:
        return -(-tokens // page)

    def fixed(tokens: int) -> int:
        ws = sum(b for _, b in _workspace(c, req, tokens))
        return resident_total + ws + states + pages(tokens) * page * kv_tok

    if req.max_context is not None and req.max_context > max_pos:
        raise PlanError(f"max_context {req.max_context} exceeds the model's "
                        f"max_position_embeddings {max_pos}")
    budget = req.gpu_memory

    def make(tokens: int, embed_device: str, slots: int) -> MemoryPlan:
        return MemoryPlan(
            gpu_memory=budget, resident_weights=resident, embed_device=embed_device,
            embed_bytes=weights.embed, workspace=_workspace(c, req, tokens),
            prefill_chunk=req.prefill_chunk, state_slots=state_slots,
            state_bytes_per_slot=state_per_slot, kv_format=req.kv, kv_bytes_per_token=kv_tok,
            page_size=page, kv_pages=pages(tokens), max_context=tokens,
            max_seqs=req.max_seqs, expert_slot_bytes=slot_bytes, expert_slots=slots,
            num_routed_experts=n_experts, experts_per_layer=c.num_experts)

    # Steps 2 and 3: everything resident.
    tokens = req.max_context if req.max_context is not None else max_pos
    if req.embed != "cpu" and fixed(tokens) + all_experts + embed <= budget:
        return make(tokens, "cuda", n_experts)
    if req.embed != "cuda" and fixed(tokens) + all_experts <= budget:
        return make(tokens, "cpu", n_experts)

    # Step 4: offload the experts.
    embed_dev = "cuda" if req.embed == "cuda" or weights.tied else "cpu"
    embed_gpu = embed if embed_dev == "cuda" else 0
    min_slots = c.num_experts
    if req.max_context is None:
        spare = budget - fixed(0) - embed_gpu - min_slots * slot_bytes
        per_token = kv_tok + 2 * c.num_kv_heads * c.head_dim * req.dtype_bytes
        tokens = min(max_pos, int(req.kv_fraction * max(spare, 0)) // per_token // page * page)
        if tokens < page:
            raise PlanError(
                f"no room for a KV cache: {budget / MiB:.0f} MiB budget, "
                f"{(fixed(0) + embed_gpu) / MiB:.0f} MiB for weights, workspace and GDN states, "
                f"{min_slots * slot_bytes / MiB:.0f} MiB for the smallest expert cache "
                f"({min_slots} slots)")
    left = budget - fixed(tokens) - embed_gpu
    slots = min(n_experts, max(left, 0) // slot_bytes)
    if slots < min_slots:
        need = fixed(tokens) + embed_gpu + min_slots * slot_bytes
        parts = (f"weights {resident_total / MiB:.0f} MiB"
                 + (f", embedding {embed_gpu / MiB:.0f} MiB" if embed_gpu else "")
                 + f", workspace {sum(b for _, b in _workspace(c, req, tokens)) / MiB:.0f} MiB"
                 + f", GDN states {states / MiB:.0f} MiB ({state_slots} slots)"
                 + f", KV {pages(tokens) * page * kv_tok / MiB:.0f} MiB "
                 f"({tokens} tokens {req.kv})"
                 + f", expert cache {min_slots * slot_bytes / MiB:.0f} MiB "
                 f"(at least {min_slots} slots of {slot_bytes / MiB:.2f} MiB)")
        raise PlanError(f"the model needs at least {need / MiB:.0f} MiB of GPU memory but the "
                        f"budget is {budget / MiB:.0f} MiB: {parts}; lower --max-context or "
                        f"--max-seqs, use --kv iso3, or raise --gpu-memory")
    return make(tokens, embed_dev, int(slots))


def plan_checkpoint(path: Any, request: PlanConfig) -> MemoryPlan:
    """Plan a checkpoint directory, reading only its config files and safetensors headers."""
    from tinyserve.model.config import load_config

    config = load_config(path)
    return plan_for_geometry(config, checkpoint_weight_bytes(path, config, request.dtype_bytes),
                             request)


def plan_command(args: Any) -> int:
    """`tinyserve plan MODEL --gpu-memory 6GiB --kv iso3 [--max-context N] [--max-seqs N]`."""
    from tinyserve.model.loader import resolve_model_path

    if args.gpu_memory is None:
        budget = _free_gpu_memory()
    else:
        budget = parse_size(args.gpu_memory)
    fields: dict[str, Any] = {"gpu_memory": budget, "kv": args.kv,
                              "max_context": args.max_context}
    if args.max_seqs is not None:
        fields["max_seqs"] = args.max_seqs
    plan = plan_checkpoint(resolve_model_path(args.model), PlanConfig(**fields))
    print(json.dumps(plan.as_dict(), indent=2) if args.json else plan.format())
    return 0


def _free_gpu_memory() -> int:
    import torch

    if not torch.cuda.is_available():
        raise PlanError("no CUDA device here: give the budget with --gpu-memory (e.g. 6GiB)")
    free, _ = torch.cuda.mem_get_info()
    return int(free)

"""Bytes of a checkpoint's weights by placement group, for the memory planner, from its
safetensors headers alone, as the weights take them on the GPU."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUPS = ("lm_head", "attention", "gdn", "shared_experts", "routers", "norms")


@dataclass(frozen=True)
class WeightBytes:
    """GPU bytes of each weight group; `expert_bytes` is one routed expert's slot."""

    embed: int
    lm_head: int
    attention: int
    gdn: int
    shared_experts: int
    routers: int
    norms: int
    expert_bytes: int
    num_routed_experts: int
    tied: bool = False

    def resident_groups(self) -> tuple[tuple[str, int], ...]:
        """(group, bytes) always on the GPU: every non-expert weight except the embedding
        (a tied embedding is the lm_head and stays)."""
        return tuple((g, getattr(self, g)) for g in GROUPS)


def expert_slot_bytes(config: Any, fp4: bool, dtype_bytes: int = 2) -> int:
    """Bytes of one expert slot: NVFP4 codes + E4M3 block scales + fp32 globals, or dense."""
    n = 3 * config.moe_intermediate_size * config.hidden_size
    return n // 2 + n // 16 + 3 * 4 if fp4 else n * dtype_bytes


_GROUP_OF = ((".self_attn.", "attention"), (".linear_attn.", "gdn"),
             (".mlp.shared_expert", "shared_experts"), (".mlp.experts", "experts"))


def weight_group(name: str) -> str:
    """The group of weight `name`: one of `GROUPS`, "embed" or "experts"."""
    if name in ("lm_head", "embed_tokens"):
        return "lm_head" if name == "lm_head" else "embed"
    if name.endswith(".mlp.gate"):
        return "routers"
    return next((g for part, g in _GROUP_OF if part in name), "norms")


def checkpoint_weight_bytes(path: str | Path, config: Any, dtype_bytes: int = 2) -> WeightBytes:
    """Weight bytes of a checkpoint directory, from its safetensors headers alone."""
    from tinyserve.model.loader import CheckpointReader
    from tinyserve.model.loader_plan import plan_weights

    with CheckpointReader(path) as reader:
        plans = plan_weights(reader, config)
    sums = dict.fromkeys((*GROUPS, "embed"), 0)
    fp4 = True
    for p in plans:
        group = weight_group(p.name)
        if group == "experts":
            fp4 = fp4 and p.storage in ("modelopt", "compressed-tensors")
        elif p.storage == "dense":
            sums[group] += math.prod(p.shape) * (4 if p.kind == "fp32" else dtype_bytes)
        else:
            sums[group] += p.nbytes
    raw = {p.name: p.raw.get("weight") for p in plans}
    embed_raw = raw.get("embed_tokens")
    if config.tie_word_embeddings and raw.get("lm_head", embed_raw) == embed_raw:
        sums["lm_head"] = sums["embed"]  # no lm_head tensor of its own: the embedding is it
    return WeightBytes(**sums, expert_bytes=expert_slot_bytes(config, fp4, dtype_bytes),
                       num_routed_experts=config.num_layers * config.num_experts,
                       tied=bool(config.tie_word_embeddings))

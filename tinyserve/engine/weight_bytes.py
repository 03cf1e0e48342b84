"""Bytes of a model's weights by placement group, for the memory planner.

`checkpoint_weight_bytes(path, config)` reads safetensors headers only (the loader's plan);
`geometry_weight_bytes(config, preset)` computes the same from shapes for a checkpoint that is
not on disk (e.g. the real Qwen3.5-35B-A3B in tests). Sizes are what the weights take on the
GPU: dense weights in the model dtype (the GDN fp32 parameters in fp32), NVFP4 and FP8 as
stored, one routed expert as one fused-MoE slot (`kernels.moe.fused.ExpertSlots`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GROUPS = ("lm_head", "attention", "gdn", "shared_experts", "routers", "norms")

# Formats of each group for checkpoints that are not on disk (specs/qwen35_moe.md §7.2).
PRESETS: dict[str, dict[str, str]] = {
    # nvidia/Qwen3.6-35B-A3B-NVFP4 (MIXED_PRECISION): GDN/attention FP8, shared + lm_head NVFP4
    "mixed": {"mixer": "fp8", "shared": "nvfp4", "lm_head": "nvfp4"},
    # experts-only NVFP4 (nvidia 122B/397B layout, most compressed-tensors checkpoints)
    "bf16": {"mixer": "bf16", "shared": "bf16", "lm_head": "bf16"},
}
_FP8_MIXER = ("in_proj_qkv", "in_proj_z", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj")


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
    experts_fp4: bool = True
    tied: bool = False

    def resident_groups(self) -> tuple[tuple[str, int], ...]:
        """(group, bytes) always on the GPU: every non-expert weight except the embedding
        (a tied embedding is the lm_head and stays)."""
        return tuple((g, getattr(self, g)) for g in GROUPS)

    @property
    def total(self) -> int:
        embed = 0 if self.tied else self.embed
        return (embed + sum(b for _, b in self.resident_groups())
                + self.num_routed_experts * self.expert_bytes)


def expert_slot_bytes(config: Any, fp4: bool, dtype_bytes: int = 2) -> int:
    """Bytes of one expert slot: NVFP4 codes + E4M3 block scales + fp32 globals, or dense."""
    n = 3 * config.moe_intermediate_size * config.hidden_size
    return n // 2 + n // 16 + 3 * 4 if fp4 else n * dtype_bytes


def _group(name: str) -> str:
    if name == "lm_head":
        return "lm_head"
    if name == "embed_tokens":
        return "embed"
    if ".self_attn." in name:
        return "attention"
    if ".linear_attn." in name:
        return "gdn"
    if ".mlp.shared_expert" in name:
        return "shared_experts"
    if name.endswith(".mlp.gate"):
        return "routers"
    if ".mlp.experts" in name:
        return "experts"
    return "norms"


def _linear_bytes(shape: tuple[int, ...], fmt: str, dtype_bytes: int) -> int:
    n = math.prod(shape)
    if fmt == "nvfp4":
        return n // 2 + n // 16 + 4
    if fmt == "fp8":
        return n + 4
    return n * dtype_bytes


def geometry_weight_bytes(config: Any, preset: str = "mixed", dtype_bytes: int = 2,
                          experts_fp4: bool = True) -> WeightBytes:
    """Weight bytes of `config`'s geometry quantized like `preset` ("mixed" or "bf16")."""
    from tinyserve.model.loader_plan import expected_weights

    fmts = PRESETS[preset]
    sums = dict.fromkeys((*GROUPS, "embed", "experts"), 0)
    for name, (kind, shape) in expected_weights(config).items():
        group = _group(name)
        if group == "experts":
            continue
        if kind == "fp32":
            nbytes = math.prod(shape) * 4
        elif kind != "linear":
            nbytes = math.prod(shape) * dtype_bytes
        elif group in ("attention", "gdn") and name.rsplit(".", 1)[1] in _FP8_MIXER:
            nbytes = _linear_bytes(shape, fmts["mixer"], dtype_bytes)
        elif group == "shared_experts" and not name.endswith("shared_expert_gate"):
            nbytes = _linear_bytes(shape, fmts["shared"], dtype_bytes)
        elif group == "lm_head":
            nbytes = _linear_bytes(shape, fmts["lm_head"], dtype_bytes)
        else:
            nbytes = _linear_bytes(shape, "bf16", dtype_bytes)
        sums[group] += nbytes
    return _finish(config, sums, experts_fp4, dtype_bytes)


def checkpoint_weight_bytes(path: str | Path, config: Any, dtype_bytes: int = 2) -> WeightBytes:
    """Weight bytes of a checkpoint directory, from its safetensors headers alone."""
    from tinyserve.model.loader import CheckpointReader
    from tinyserve.model.loader_plan import plan_weights

    with CheckpointReader(path) as reader:
        plans = plan_weights(reader, config)
    sums = dict.fromkeys((*GROUPS, "embed", "experts"), 0)
    fp4 = True
    for p in plans:
        group = _group(p.name)
        if group == "experts":
            fp4 = fp4 and p.storage in ("modelopt", "compressed-tensors")
            continue
        if p.storage == "dense":
            per = 4 if p.kind == "fp32" else dtype_bytes
            sums[group] += math.prod(p.shape) * per
        else:
            sums[group] += p.nbytes
    if config.tie_word_embeddings and not any(p.name == "lm_head" and p.raw.get("weight")
                                              != _raw_of(plans, "embed_tokens") for p in plans):
        sums["lm_head"] = sums["embed"]
    return _finish(config, sums, fp4, dtype_bytes)


def _raw_of(plans: list, name: str) -> str | None:
    return next((p.raw.get("weight") for p in plans if p.name == name), None)


def _finish(config: Any, sums: dict[str, int], fp4: bool, dtype_bytes: int) -> WeightBytes:
    return WeightBytes(
        embed=sums["embed"], lm_head=sums["lm_head"], attention=sums["attention"],
        gdn=sums["gdn"], shared_experts=sums["shared_experts"], routers=sums["routers"],
        norms=sums["norms"], expert_bytes=expert_slot_bytes(config, fp4, dtype_bytes),
        num_routed_experts=config.num_layers * config.num_experts, experts_fp4=fp4,
        tied=bool(config.tie_word_embeddings))

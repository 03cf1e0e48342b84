"""Tiny random Qwen3.5-MoE models in transformers and the same weights under canonical names,
for parity tests of the tinyserve model (CPU, fp32)."""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import DenseWeight
from tinyserve.engine.runner import ModelRunner
from tinyserve.kv.bf16 import BF16KVBackend
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.model.config import ModelConfig
from tinyserve.model.qwen35 import Qwen35Model

# The spec's tiny model (qwen35_moe.md §5) and a second geometry: head_dim 128 (rotary 32) and
# three value heads per key head.
TINY = dict(
    vocab_size=256, hidden_size=64, num_hidden_layers=4,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, rms_norm_eps=1e-6,
    max_position_embeddings=512, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 1, 1], "mrope_interleaved": True},
)
WIDE = dict(
    TINY, num_hidden_layers=5,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention",
                 "full_attention"],
    num_attention_heads=4, num_key_value_heads=1, head_dim=128,
    linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
    linear_value_head_dim=8, num_experts=6, num_experts_per_tok=3,
    rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "mrope_section": [6, 5, 5], "mrope_interleaved": True},
)

_LINEARS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj",
            "k_proj", "v_proj", "o_proj", "mlp.gate", "gate_proj", "up_proj", "down_proj",
            "shared_expert_gate")


def hf_model(spec: dict[str, Any], seed: int = 0) -> Any:
    """An fp32 `Qwen3_5MoeForCausalLM` with random norms, A_log and dt_bias."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    cfg = Qwen3_5MoeTextConfig(**spec)
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("A_log"):
                p.copy_(torch.empty(p.shape).uniform_(0.01, 4, generator=gen).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.08)
    return model


def model_config(spec: dict[str, Any]) -> ModelConfig:
    rope = spec["rope_parameters"]
    return ModelConfig(
        vocab_size=spec["vocab_size"], hidden_size=spec["hidden_size"],
        num_layers=spec["num_hidden_layers"], layer_types=tuple(spec["layer_types"]),
        num_attention_heads=spec["num_attention_heads"],
        num_kv_heads=spec["num_key_value_heads"], head_dim=spec["head_dim"],
        rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
        linear_num_key_heads=spec["linear_num_key_heads"],
        linear_num_value_heads=spec["linear_num_value_heads"],
        linear_key_head_dim=spec["linear_key_head_dim"],
        linear_value_head_dim=spec["linear_value_head_dim"],
        linear_conv_kernel_dim=spec["linear_conv_kernel_dim"],
        num_experts=spec["num_experts"], num_experts_per_tok=spec["num_experts_per_tok"],
        moe_intermediate_size=spec["moe_intermediate_size"],
        shared_expert_intermediate_size=spec["shared_expert_intermediate_size"],
        rms_norm_eps=spec["rms_norm_eps"],
        max_position_embeddings=spec["max_position_embeddings"],
        tie_word_embeddings=spec["tie_word_embeddings"], eos_token_ids=(0,),
    )


def canonical_weights(model: Any) -> dict[str, Any]:
    """HF state_dict -> canonical names (prefix stripped, experts split per expert)."""
    out: dict[str, Any] = {}
    for key, t in model.state_dict().items():
        t = t.detach().clone()
        name = key.removeprefix("model.").removesuffix(".weight")
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            F = t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj"] = DenseWeight(t[e, :F].contiguous())
                out[f"{base}{e}.up_proj"] = DenseWeight(t[e, F:].contiguous())
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj"] = DenseWeight(t[e].contiguous())
        elif name.endswith("conv1d"):
            out[name] = t[:, 0, :].contiguous()
        elif name == "lm_head" or name.endswith(_LINEARS):
            out[name] = DenseWeight(t)
        else:
            out[name] = t
    return out


def build_runner(spec: dict[str, Any], weights: dict[str, Any], *, num_pages: int = 32,
                 page_size: int = 4, num_slots: int = 4, poison: bool = True,
                 dtype: torch.dtype = torch.float32) -> ModelRunner:
    """A CPU model + runner over fresh bf16-backend pages and GDN slots, poisoned with NaN."""
    cfg = model_config(spec)
    kv = BF16KVBackend(layer_ids=list(cfg.full_attention_layers), num_kv_heads=cfg.num_kv_heads,
                       head_dim=cfg.head_dim, num_pages=num_pages, page_size=page_size,
                       device="cpu", dtype=dtype)
    states = GDNStatePool.for_config(cfg, num_slots, device="cpu", dtype=dtype)
    if poison:
        for t in (kv.k_cache, kv.v_cache, states.conv, states.recurrent):
            t.fill_(float("nan"))
    model = Qwen35Model(cfg, weights, kv=kv, states=states, device="cpu", dtype=dtype)
    return ModelRunner(model, page_size=page_size)

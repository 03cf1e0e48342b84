"""Tiny random Qwen3.5-MoE checkpoints for tests, `tinyserve demo` and benchmarks.

`make_tiny_checkpoint(path, fmt=..., seed=..., **overrides)` writes a complete checkpoint
(config, generation config, tokenizer, safetensors) of a random
`transformers.Qwen3_5MoeForCausalLM` (specs/qwen35_moe.md §5), norms, A_log and dt_bias
randomised so that none is a no-op. Formats: "bf16" (flat text config, per-expert keys, one
file); "bf16-official" (nested `text_config` + `vision_config`, `model.language_model.`
prefix, fused 3-D experts, dummy vision and MTP tensors, two shards); "modelopt",
"compressed-tensors" and "modelopt-mixed" (the "bf16" one through `quantize_checkpoint`).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinyserve.model.config import default_layer_types
from tinyserve.model.quantize import CheckpointWriter, quantize_checkpoint
from tinyserve.testing.tokenizer import save_tiny_tokenizer

StateTransform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
FORMATS = ("bf16", "bf16-official", "modelopt", "compressed-tensors", "modelopt-mixed")

# specs/qwen35_moe.md §5, with room in the vocabulary for the tiny tokenizer (500 ids).
TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 32,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [2, 1, 1], "mrope_interleaved": True},
}

# Overrides for ISO KV (head_dim % 128 == 0) and 3 value heads per key head.
TINY_CONFIG_HD128: dict[str, Any] = {
    "head_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 6,
}


def tiny_text_config(**overrides: Any) -> dict[str, Any]:
    """TINY_CONFIG with `overrides`; layer_types and mrope_section follow the overrides when
    they are not given themselves."""
    cfg = json.loads(json.dumps(TINY_CONFIG))
    if "num_hidden_layers" in overrides and "layer_types" not in overrides:
        cfg["layer_types"] = list(default_layer_types(
            overrides["num_hidden_layers"], overrides.get("full_attention_interval", 4)))
    cfg.update(overrides)
    rope = cfg["rope_parameters"]
    if "rope_parameters" not in overrides:
        half = int(cfg["head_dim"] * rope["partial_rotary_factor"]) // 2
        base, rem = divmod(half, 3)
        rope["mrope_section"] = [base + (rem >= 1), base + (rem >= 2), base]
    return cfg


def make_tiny_checkpoint(path: str | Path, *, fmt: str = "bf16", seed: int = 0,
                         transform: StateTransform | None = None,
                         **config_overrides: Any) -> Path:
    """Write a tiny random checkpoint to directory `path` (created) and return it.

    `config_overrides` are Qwen3_5MoeTextConfig fields applied over TINY_CONFIG (e.g.
    `**TINY_CONFIG_HD128`). The same (fmt, seed, overrides) always gives the same bytes.
    `transform` rewrites the random state dict (HF names, fused experts) before it is written
    (`bench.routing`'s realistic routing). Raises ValueError for an unknown format.
    """
    if fmt not in FORMATS:
        raise ValueError(f"unknown tiny checkpoint format {fmt!r} (expected one of {FORMATS})")
    path = Path(path)
    if fmt in ("modelopt", "compressed-tensors", "modelopt-mixed"):
        with tempfile.TemporaryDirectory(prefix="tiny-bf16-") as tmp:
            src = make_tiny_checkpoint(tmp, fmt="bf16", seed=seed, transform=transform,
                                       **config_overrides)
            if fmt == "modelopt-mixed":
                return quantize_checkpoint(src, path, "modelopt", recipe="mixed",
                                           overwrite=True)
            return quantize_checkpoint(src, path, fmt, overwrite=True)
    path.mkdir(parents=True, exist_ok=True)
    text = tiny_text_config(**config_overrides)
    specials = save_tiny_tokenizer(path)
    eos, im_end = specials["<|endoftext|>"], specials["<|im_end|>"]
    if max(specials.values()) >= text["vocab_size"]:
        raise ValueError(f"vocab_size {text['vocab_size']} is too small for the tiny tokenizer "
                         f"({max(specials.values()) + 1} ids)")
    text.update(eos_token_id=eos, pad_token_id=None, bos_token_id=None,
                model_type="qwen3_5_moe_text", dtype="bfloat16")
    state = random_state_dict(text, seed)
    if transform is not None:
        state = transform(state)
    gen = {"eos_token_id": [eos, im_end], "pad_token_id": eos, "bos_token_id": None}
    (path / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    if fmt == "bf16":
        cfg = {"architectures": ["Qwen3_5MoeForCausalLM"], **text}
        tensors = _per_expert(state)
        max_bytes = 1 << 40
    else:
        cfg = _official_config(text)
        tensors = _official_tensors(state, text, seed)
        max_bytes = sum(t.numel() * t.element_size() for t in tensors.values()) // 2 + 1
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    with CheckpointWriter(path, max_shard_bytes=max_bytes, overwrite=True) as writer:
        for name, t in tensors.items():
            writer.add(name, t)
    return path


def random_state_dict(text: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """The state dict (HF names, fused experts) of a random Qwen3_5MoeForCausalLM, norms,
    A_log and dt_bias randomised; BF16 except A_log and linear_attn.norm (F32)."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    keys = set(Qwen3_5MoeTextConfig().to_dict())
    hf_cfg = Qwen3_5MoeTextConfig(**{k: v for k, v in text.items() if k in keys})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5MoeForCausalLM(hf_cfg)
        state = dict(model.state_dict())
        gen = torch.Generator().manual_seed(seed + 1)
        for name, t in state.items():
            if name.endswith("linear_attn.norm.weight"):  # plain w (init ones)
                t = 1.0 + 0.1 * torch.randn(t.shape, generator=gen)
            elif name.endswith("norm.weight"):  # 1 + w (init zeros)
                t = 0.1 * torch.randn(t.shape, generator=gen)
            elif name.endswith("A_log"):
                t = torch.log(torch.empty(t.shape).uniform_(1.0, 16.0, generator=gen))
            elif name.endswith("dt_bias"):
                t = 0.5 * torch.randn(t.shape, generator=gen)
            fp32 = name.endswith(("A_log", "linear_attn.norm.weight"))
            state[name] = t.detach().to(torch.float32 if fp32 else torch.bfloat16).contiguous()
    return state


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base, f = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = t[e, :f].clone()
                out[f"{base}{e}.up_proj.weight"] = t[e, f:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = t[e].clone()
        else:
            out[name] = t
    return out


def _official_config(text: dict[str, Any]) -> dict[str, Any]:
    text = dict(text)
    text["partial_rotary_factor"] = text["rope_parameters"]["partial_rotary_factor"]
    vision = {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32,
              "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": text["hidden_size"], "num_position_embeddings": 16}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": text["tie_word_embeddings"], "image_token_id": 500,
            "video_token_id": 501, "vision_start_token_id": 502, "vision_end_token_id": 503,
            "text_config": text, "vision_config": vision}


def _official_tensors(state: dict[str, torch.Tensor], text: dict[str, Any],
                      seed: int) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    gen = torch.Generator().manual_seed(seed + 2)
    h = text["hidden_size"]

    def rand(*shape: int) -> torch.Tensor:
        return (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)

    out["model.visual.patch_embed.proj.weight"] = rand(32, 3, 2, 16, 16)
    out["model.visual.blocks.0.attn.qkv.weight"] = rand(96, 32)
    out["model.visual.merger.linear_fc2.weight"] = rand(h, 128)
    for name, t in state.items():
        out[name.replace("model.", "model.language_model.", 1)
            if name.startswith("model.") else name] = t
    f = text["moe_intermediate_size"]
    out["mtp.fc.weight"] = rand(h, 2 * h)
    out["mtp.norm.weight"] = rand(h)
    out["mtp.layers.0.mlp.experts.gate_up_proj"] = rand(text["num_experts"], 2 * f, h)
    out["mtp.layers.0.mlp.experts.down_proj"] = rand(text["num_experts"], h, f)
    return out

"""Tiny checkpoints (`testing.tiny`) loaded into the tinyserve model and into transformers'
Qwen3_5MoeForCausalLM, for parity tests (CPU, fp32)."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path
from typing import Any

import torch

from tinyserve.engine.runner import ModelRunner
from tinyserve.kernels.nvfp4.ref import dequantize
from tinyserve.kv.bf16 import BF16KVBackend
from tinyserve.kv.state_pool import GDNStatePool
from tinyserve.model.config import ModelConfig, load_config
from tinyserve.model.loader import load_weights
from tinyserve.model.qwen35 import Qwen35Model
from tinyserve.testing.tiny import TINY_CONFIG_HD128, make_tiny_checkpoint, tiny_text_config

# "tiny": the spec's §5 model; "hd128": head_dim 128 and three value heads per key head.
GEOMETRIES: dict[str, dict[str, Any]] = {"tiny": {}, "hd128": dict(TINY_CONFIG_HD128)}
_ROOT = Path(tempfile.mkdtemp(prefix="tinyserve-parity-"))


@functools.cache
def checkpoint(fmt: str, geometry: str = "tiny") -> tuple[ModelConfig, dict[str, Any]]:
    """(config, canonical fp32 weights) of a tiny checkpoint, written once per process: the
    checkpoint's own linears (`fuse=False`, as `hf_state_dict` maps them); the model fuses
    the same-input ones itself."""
    path = make_tiny_checkpoint(_ROOT / f"{geometry}-{fmt}", fmt=fmt,
                                **GEOMETRIES[geometry])
    cfg = load_config(path)
    return cfg, load_weights(path, cfg, dtype=torch.float32, fuse=False)


@functools.cache
def hf_reference(fmt: str, geometry: str = "tiny") -> Any:
    """transformers' model (fp32) running the checkpoint's weights, dequantized for NVFP4/FP8.

    bf16 checkpoints load through `from_pretrained` (independent of tinyserve's loader);
    quantized ones get the dequantized canonical weights.
    """
    from transformers import (
        AutoModelForCausalLM,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeTextConfig,
    )

    checkpoint(fmt, geometry)
    path = _ROOT / f"{geometry}-{fmt}"
    if fmt.startswith("bf16"):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    text = tiny_text_config(**GEOMETRIES[geometry])
    keys = set(Qwen3_5MoeTextConfig().to_dict())
    model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**{k: v for k, v in text.items()
                                                          if k in keys}))
    model.load_state_dict(hf_state_dict(*checkpoint(fmt, geometry)), strict=True)
    return model.float().eval()


def hf_state_dict(cfg: ModelConfig, weights: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Canonical weights -> the in-memory HF state dict (fused experts), dense fp32."""
    sd: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if ".mlp.experts." in name:
            continue
        t = dequantize(w, torch.float32) if not isinstance(w, torch.Tensor) else w.float()
        if name == "lm_head":
            sd["lm_head.weight"] = t
        elif name.endswith(("A_log", "dt_bias")):
            sd["model." + name] = t
        elif name.endswith("conv1d"):
            sd[f"model.{name}.weight"] = t.unsqueeze(1)
        else:
            sd[f"model.{name}.weight"] = t
    for L in range(cfg.num_layers):
        p = f"layers.{L}.mlp.experts"
        E = range(cfg.num_experts)

        def get(e: int, proj: str, p: str = p) -> torch.Tensor:
            return dequantize(weights[f"{p}.{e}.{proj}"], torch.float32)

        sd[f"model.{p}.gate_up_proj"] = torch.stack(
            [torch.cat([get(e, "gate_proj"), get(e, "up_proj")]) for e in E])
        sd[f"model.{p}.down_proj"] = torch.stack([get(e, "down_proj") for e in E])
    return sd


def build_runner(cfg: ModelConfig, weights: dict[str, Any], *, num_pages: int = 32,
                 page_size: int = 4, num_slots: int = 4, poison: bool = True,
                 dtype: torch.dtype = torch.float32, device: str = "cpu", experts: Any = None,
                 **runner_kwargs: Any) -> ModelRunner:
    """A model + runner over fresh bf16-backend pages and GDN slots, poisoned with NaN;
    `experts`: a routed-experts provider (the model then leaves the expert weights alone),
    `runner_kwargs`: more ModelRunner arguments (cuda_graphs, graph_pad_slot)."""
    kv = BF16KVBackend(layer_ids=list(cfg.full_attention_layers), num_kv_heads=cfg.num_kv_heads,
                       num_q_heads=cfg.num_attention_heads, head_dim=cfg.head_dim,
                       num_pages=num_pages, page_size=page_size, device=device, dtype=dtype)
    states = GDNStatePool.for_config(cfg, num_slots, device=device, dtype=dtype)
    if poison:
        for t in (kv.k_cache, kv.v_cache, states.conv, states.recurrent):
            t.fill_(float("nan"))
    model = Qwen35Model(cfg, weights, kv=kv, states=states, experts=experts, device=device,
                        dtype=dtype)
    return ModelRunner(model, page_size=page_size, **runner_kwargs)


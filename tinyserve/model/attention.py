"""Gated full attention of Qwen3.5-MoE (`self_attn`): q/gate interleaved by head, per-head
q_norm / k_norm (1 + w), partial RoPE, paged attention through the KV backend, sigmoid output
gate."""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import ForwardContext, LinearWeight
from tinyserve.model.linear import linear
from tinyserve.model.norm import rms_norm
from tinyserve.model.rope import PartialRoPE


class GatedAttention:
    """One full-attention mixer. `kv` is any KV backend (`kv.base.KVBackend` interface)."""

    def __init__(self, layer_id: int, config: Any, w: dict[str, Any], rope: PartialRoPE) -> None:
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.rope = rope
        self.q_proj: LinearWeight = w["q_proj"]
        self.k_proj: LinearWeight = w["k_proj"]
        self.v_proj: LinearWeight = w["v_proj"]
        self.o_proj: LinearWeight = w["o_proj"]
        self.q_norm: torch.Tensor = w["q_norm"]
        self.k_norm: torch.Tensor = w["k_norm"]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, kv: Any,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, hidden] (normed) -> [N, hidden]. `cos_sin` from `rope.cos_sin(ctx.positions)`."""
        N = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        # NOTE: q_proj rows are [q_h | gate_h] per head h, not [all q | all gates].
        qg = linear(x, self.q_proj).view(N, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(N, H * D)
        q = rms_norm(q, self.q_norm, self.eps)  # [N, H, D]
        k = rms_norm(linear(x, self.k_proj).view(N, Hkv, D), self.k_norm, self.eps)
        v = linear(x, self.v_proj).view(N, Hkv, D)
        cos, sin = cos_sin
        q = self.rope.apply(q, cos, sin)
        k = self.rope.apply(k, cos, sin)
        o = kv.forward(self.layer_id, q.contiguous(), k.contiguous(), v.contiguous(), ctx,
                       D ** -0.5)  # [N, H, D]
        o = o.reshape(N, H * D) * torch.sigmoid(gate)
        return linear(o, self.o_proj)

"""Gated full attention of Qwen3.5-MoE (`self_attn`): q/gate interleaved by head, per-head
q_norm / k_norm (1 + w), partial RoPE, paged attention through the KV backend, sigmoid output
gate (Triton kernels on CUDA). q/k/v run as one `SplitLinear` (the kernels and the KV stores
read row-strided [N, H, D] inputs)."""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import ForwardContext, LinearWeight
from tinyserve.model.linear import SplitLinear, kernels_enabled, linear
from tinyserve.model.rope import PartialRoPE


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [N, H, D] (gate may be a strided view) -> x * sigmoid(gate) as [N, H * D]."""
    if kernels_enabled(x.device) and x.stride(-1) == 1 and gate.stride(-1) == 1:
        from tinyserve.kernels import glue

        return glue.sigmoid_mul(x, gate)
    return sigmoid_mul_ref(x, gate)


def sigmoid_mul_ref(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Pure-torch `sigmoid_mul`."""
    n = x.shape[0]
    return x.reshape(n, -1) * torch.sigmoid(gate.reshape(n, -1))


class GatedAttention:
    """One full-attention mixer. `kv` is any KV backend (`kv.base.KVBackend` interface)."""

    def __init__(self, layer_id: int, config: Any, w: dict[str, Any], rope: PartialRoPE) -> None:
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        self.rope = rope
        self.qkv_proj = SplitLinear.of(w, "qkv_proj", ("q_proj", "k_proj", "v_proj"))
        self.o_proj: LinearWeight = w["o_proj"]
        self.q_norm: torch.Tensor = w["q_norm"]
        self.k_norm: torch.Tensor = w["k_norm"]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, kv: Any,
                cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, hidden] (normed) -> [N, hidden]. `cos_sin` from `rope.cos_sin(ctx.positions)`."""
        N = x.shape[0]
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        qg, k, v = self.qkv_proj.split(x, (2 * H * D, Hkv * D, Hkv * D))
        # NOTE: q_proj rows are [q_h | gate_h] per head h, not [all q | all gates].
        qg = qg.view(N, H, 2 * D)
        q, gate = qg[..., :D], qg[..., D:]  # [N, H, D] views
        cos, sin = cos_sin
        q = self.rope.norm_apply(q, self.q_norm, self.eps, cos, sin)  # [N, H, D] contiguous
        k = self.rope.norm_apply(k.view(N, Hkv, D), self.k_norm, self.eps, cos, sin)
        # NOTE: a decode step hands v over as a row-strided view: the backends' stores take
        # [N, Hkv, D] of any row stride (unit head and last strides), and decode attention
        # reads the cache only. Prefill attention gets contiguous K/V (one copy).
        v = (v if ctx.is_decode else v.contiguous()).view(N, Hkv, D)
        o = kv.forward(self.layer_id, q, k, v, ctx, D ** -0.5)  # [N, H, D]
        return linear(sigmoid_mul(o.reshape(N, H, D), gate), self.o_proj)

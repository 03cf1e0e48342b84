"""Gated DeltaNet mixer of Qwen3.5-MoE (`linear_attn`), batched over varlen sequences.

The causal conv and the gated delta rule (`kernels/gdn/`) read each sequence's conv and
recurrent state at `ctx.state_slots[b]` (prefix length 0: zeros) and write it back in place; a
pure-decode batch takes the recurrent path, anything else the chunked varlen one. The four
projections run as two `SplitLinear`s (the kernels read row-strided inputs).
"""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.core import ForwardContext, LinearWeight
from tinyserve.kernels import gdn as gdn_kernels
from tinyserve.model.linear import SplitLinear, linear
from tinyserve.model.norm import gated_rms_norm


class GatedDeltaNet:
    """One GDN mixer. `states` is a `kv.state_pool.GDNStatePool` (duck-typed here)."""

    def __init__(self, layer_id: int, config: Any, w: dict[str, Any]) -> None:
        self.layer_id = layer_id
        self.Hk = config.linear_num_key_heads
        self.Hv = config.linear_num_value_heads
        self.dk = config.linear_key_head_dim
        self.dv = config.linear_value_head_dim
        self.eps = config.rms_norm_eps
        self.in_proj_qkvz = SplitLinear.of(w, "in_proj_qkvz", ("in_proj_qkv", "in_proj_z"))
        self.in_proj_ba = SplitLinear.of(w, "in_proj_ba", ("in_proj_b", "in_proj_a"))
        self.out_proj: LinearWeight = w["out_proj"]
        self.conv_weight: torch.Tensor = w["conv1d"]  # [C, K] model dtype
        self.A_log: torch.Tensor = w["A_log"]  # [Hv] fp32
        self.dt_bias: torch.Tensor = w["dt_bias"]  # [Hv] fp32
        self.norm: torch.Tensor = w["norm"]  # [dv], plain weight

    def forward(self, x: torch.Tensor, ctx: ForwardContext, states: Any) -> torch.Tensor:
        """x [N, hidden] (normed) -> [N, hidden]; updates the pool's states of this layer."""
        N = x.shape[0]
        Hk, Hv, dk, dv = self.Hk, self.Hv, self.dk, self.dv
        C = self.conv_weight.shape[0]
        # qkv [N, C]: q | k | v, contiguous channel blocks; z [N, Hv * dv]
        qkv, z = self.in_proj_qkvz.split(x, (C, Hv * dv))
        z = z.view(N, Hv, dv)
        b, a = self.in_proj_ba.split(x, (Hv, Hv))
        # b [N, Hv]: beta = sigmoid(b) inside the kernel;
        # a [N, Hv]: g = -exp(A_log) * softplus(a + dt_bias)

        conv_pool = states.conv_state(self.layer_id)  # [slots, C, K-1] model dtype
        rec_pool = states.recurrent_state(self.layer_id)  # [slots, Hv, dk, dv] fp32
        slots = ctx.state_slots
        decode = ctx.is_decode
        if decode:
            y = gdn_kernels.causal_conv1d_update(qkv, self.conv_weight, conv_pool, slots)
        else:
            has_state = ctx.prefix_lens > 0
            y = gdn_kernels.causal_conv1d_prefill(qkv, self.conv_weight, conv_pool, slots,
                                                  ctx.cu_seqlens, has_state)
        kd = Hk * dk
        q = y[:, :kd].view(N, Hk, dk)
        k = y[:, kd:2 * kd].view(N, Hk, dk)
        v = y[:, 2 * kd:].view(N, Hv, dv)
        args = (q, k, v, a, b, self.A_log, self.dt_bias, rec_pool, slots)
        if decode:
            o = gdn_kernels.gdn_decode(*args)  # [N, Hv, dv] model dtype
        else:
            o = gdn_kernels.gdn_prefill(*args, ctx.cu_seqlens, has_state)
        o = gated_rms_norm(o, z, self.norm, self.eps)
        return linear(o.reshape(N, Hv * dv), self.out_proj)

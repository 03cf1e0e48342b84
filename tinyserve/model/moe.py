"""Sparse MoE block of Qwen3.5-MoE and the resident experts provider.

Router: fp32 softmax over the router logits, top-k, ALWAYS renormalised over the top k, cast to
the model dtype. Shared expert: SwiGLU MLP scaled by sigmoid(shared_expert_gate(x)).

Experts provider interface (resident here; an offloaded one lives in `offload/`):
`forward(layer_id, x [N, H], topk_ids [N, k] int64, topk_weights [N, k]) -> [N, H]`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from tinyserve.core import DenseWeight, FP8Weight, LinearWeight
from tinyserve.model.linear import kernels_enabled, linear


def swiglu_mlp(x: torch.Tensor, gate: LinearWeight, up: LinearWeight,
               down: LinearWeight) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), x [N, H] -> [N, H]."""
    return linear(F.silu(linear(x, gate)) * linear(x, up), down)


def route(x: torch.Tensor, router: LinearWeight, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, H] -> (topk_ids [N, k] int64, topk_weights [N, k] in x.dtype, renormalised)."""
    logits = linear(x, router)  # [N, E] model dtype
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(x.dtype)


class ResidentExperts:
    """Every routed expert of the given layers held as LinearWeights on one device.

    `weights` maps canonical names (`layers.{L}.mlp.experts.{e}.{gate,up,down}_proj`) to
    weights already on the compute device.

    On CUDA (kernels enabled) each layer's experts are packed once into slot buffers (slot =
    expert id) and run by the fused-MoE kernel (`kernels/fused_moe.py`); elsewhere, or with
    `use_kernel=False`, the per-expert torch loop runs (the reference of the kernel).
    """

    def __init__(self, weights: dict[str, Any], config: Any, layer_ids: Iterable[int], *,
                 use_kernel: bool | None = None) -> None:
        self.num_experts = config.num_experts
        self.experts: dict[int, list[tuple[LinearWeight, LinearWeight, LinearWeight]]] = {}
        self.slots: dict[int, Any] = {}
        layer_ids = list(layer_ids)
        first = weights[f"layers.{layer_ids[0]}.mlp.experts.0.gate_proj"] if layer_ids else None
        device = _device_of(first) if first is not None else torch.device("cpu")
        self.use_kernel = kernels_enabled(device) if use_kernel is None else use_kernel
        for L in layer_ids:
            p = f"layers.{L}.mlp.experts"
            experts = [(weights[f"{p}.{e}.gate_proj"], weights[f"{p}.{e}.up_proj"],
                        weights[f"{p}.{e}.down_proj"]) for e in range(self.num_experts)]
            if self.use_kernel:
                from tinyserve.kernels.fused_moe import pack_expert_slots

                dtype = first.weight.dtype if isinstance(first, DenseWeight) else torch.bfloat16
                self.slots[L] = pack_expert_slots(experts, device, dtype)
            else:
                self.experts[L] = experts

    @property
    def capturable(self) -> bool:
        """Whether `forward` runs without host synchronisation (CUDA-graph safe): the kernel."""
        return self.use_kernel

    def forward(self, layer_id: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
        """Σ_j topk_weights[:, j] * Expert_{topk_ids[:, j]}(x); x [N, H] -> [N, H] in x.dtype."""
        if self.use_kernel:
            from tinyserve.kernels.fused_moe import fused_moe

            return fused_moe(x, topk_ids, topk_weights, self.slots[layer_id])
        return self._forward_loop(layer_id, x, topk_ids, topk_weights)

    def _forward_loop(self, layer_id: int, x: torch.Tensor, topk_ids: torch.Tensor,
                      topk_weights: torch.Tensor) -> torch.Tensor:
        experts = self.experts[layer_id]
        out = torch.zeros_like(x)
        # NOTE: experts in ascending order and index_add_, like HF's eager loop.
        for e in torch.unique(topk_ids).tolist():
            token_idx, slot = torch.where(topk_ids == e)
            y = swiglu_mlp(x[token_idx], *experts[e])
            y = y * topk_weights[token_idx, slot, None]
            out.index_add_(0, token_idx, y.to(out.dtype))
        return out


def _device_of(w: LinearWeight) -> torch.device:
    return (w.weight if isinstance(w, (DenseWeight, FP8Weight)) else w.packed).device


class SparseMoE:
    """Router + routed experts (through the provider) + gated shared expert, one layer."""

    def __init__(self, layer_id: int, config: Any, w: dict[str, Any], experts: Any) -> None:
        self.layer_id = layer_id
        self.top_k = config.num_experts_per_tok
        self.router: LinearWeight = w["gate"]
        self.shared = (w["shared_expert.gate_proj"], w["shared_expert.up_proj"],
                       w["shared_expert.down_proj"])
        self.shared_gate: LinearWeight = w["shared_expert_gate"]
        self.experts = experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]."""
        shared = swiglu_mlp(x, *self.shared)
        ids, weights = route(x, self.router, self.top_k)
        routed = self.experts.forward(self.layer_id, x, ids, weights)
        shared = torch.sigmoid(linear(x, self.shared_gate)) * shared
        return routed + shared

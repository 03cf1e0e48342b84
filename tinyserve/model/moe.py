"""Sparse MoE block of Qwen3.5-MoE and the resident experts provider (`experts_api`).

Router: fp32 softmax, top-k, ALWAYS renormalised over the top k, cast to the model dtype.
Shared expert: SwiGLU MLP scaled by sigmoid(shared_expert_gate(x)). On CUDA the glue runs as
Triton kernels beside the torch references here (`*_ref`); an NVFP4 shared expert gets a slot
of its own so that a provider with `accepts_shared` runs it with the routed experts in the
launches of the CUDA MoE decode (where `fuses_shared_expert`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F

from tinyserve.core import DenseWeight, FP8Weight, LinearWeight, NVFP4Weight
from tinyserve.kernels.moe.fused import (
    ExpertSlots,
    fuses_shared_expert,
    pack_expert_slots,
    single_expert_slots,
)
from tinyserve.model.experts_api import ExpertsProvider
from tinyserve.model.linear import SplitLinear, kernels_enabled, linear

ROUTER_KERNEL_MAX_N = 256  # the router kernel up to this many tokens, torch above


def swiglu_mlp(x: torch.Tensor, gate: LinearWeight, up: LinearWeight,
               down: LinearWeight) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)), x [N, H] -> [N, H]."""
    return linear(silu_mul(linear(x, gate), linear(x, up)), down)


def topk_softmax(logits: torch.Tensor, top_k: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (unit column stride) -> (ids [N, k] int64 in descending
    probability, weights [N, k] in `dtype`): fp32 softmax, top-k, renormalised, cast."""
    if kernels_enabled(logits.device) and logits.shape[0] <= ROUTER_KERNEL_MAX_N:
        from tinyserve.kernels.moe import router as router_kernels

        return router_kernels.topk_softmax(logits, top_k, dtype)
    return topk_softmax_ref(logits, top_k, dtype)


def topk_softmax_ref(logits: torch.Tensor, top_k: int,
                     dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `topk_softmax`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [N, F] in the model dtype (one kernel on CUDA)."""
    if kernels_enabled(gate.device) and gate.dim() == 2:
        from tinyserve.kernels import glue

        return glue.silu_mul(gate, up)
    return silu_mul_ref(gate, up)


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Pure-torch `silu_mul`."""
    return F.silu(gate) * up


def gated_add(routed: torch.Tensor, gate_logit: torch.Tensor,
              shared: torch.Tensor) -> torch.Tensor:
    """routed + sigmoid(gate_logit) * shared; routed, shared [N, H], gate_logit [N, 1], all in
    the model dtype (one kernel on CUDA)."""
    if kernels_enabled(routed.device):
        from tinyserve.kernels import glue

        return glue.gated_add(routed, gate_logit, shared)
    return gated_add_ref(routed, gate_logit, shared)


def gated_add_ref(routed: torch.Tensor, gate_logit: torch.Tensor,
                  shared: torch.Tensor) -> torch.Tensor:
    """Pure-torch `gated_add`."""
    return routed + torch.sigmoid(gate_logit) * shared


class ResidentExperts(ExpertsProvider):
    """Every routed expert of the given layers (`weights`: canonical names -> weights on the
    compute device). With kernels, each layer is packed once into slot buffers (slot = expert
    id) for the fused-MoE kernel; else the per-expert torch loop runs (its reference)."""

    def __init__(self, weights: dict[str, Any], config: Any, layer_ids: Iterable[int], *,
                 use_kernel: bool | None = None) -> None:
        self.experts: dict[int, list[tuple[LinearWeight, LinearWeight, LinearWeight]]] = {}
        self.slots: dict[int, Any] = {}
        for L in layer_ids:
            p = f"layers.{L}.mlp.experts"
            self.experts[L] = [tuple(weights[f"{p}.{e}.{proj}_proj"] for proj in
                                     ("gate", "up", "down")) for e in range(config.num_experts)]
        first = next(iter(self.experts.values()), [(None,)])[0][0]
        device = _device_of(first) if first is not None else torch.device("cpu")
        self.use_kernel = kernels_enabled(device) if use_kernel is None else use_kernel
        if self.use_kernel:
            dtype = first.weight.dtype if isinstance(first, DenseWeight) else torch.bfloat16
            self.slots = {L: pack_expert_slots(self.experts.pop(L), device, dtype)
                          for L in list(self.experts)}

    @property
    def capturable(self) -> bool:  # the kernel: no host synchronisation
        return self.use_kernel

    @property
    def accepts_shared(self) -> bool:  # the fused-MoE kernel takes it along
        return self.use_kernel

    def forward(self, layer_id: int, x: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, *, shared_slots: ExpertSlots | None = None,
                shared_logit: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_j topk_weights[:, j] * Expert_{topk_ids[:, j]}(x) (+ sigmoid(shared_logit) *
        shared expert, kernel only); x [N, H] -> [N, H] in x.dtype."""
        if self.use_kernel:
            from tinyserve.kernels.moe.fused import fused_moe

            return fused_moe(x, topk_ids, topk_weights, self.slots[layer_id],
                             shared_slots=shared_slots, shared_logit=shared_logit)
        if shared_slots is not None:
            raise ValueError("the shared expert rides along with the kernel only")
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
    """Router + routed experts (through the provider) + gated shared expert, one layer.

    Where kernels run, `gate_up` [2F, H] and `router_gate` [E + 1, H] run as one GEMM each
    when the storages allow. `shared_slots`: the NVFP4 shared expert as slot 0 of its own
    ExpertSlots when the provider takes it along.
    """

    def __init__(self, layer_id: int, config: Any, w: dict[str, Any],
                 experts: ExpertsProvider) -> None:
        self.layer_id = layer_id
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.num_experts
        self.experts = experts
        gate, up = w["shared_expert.gate_proj"], w["shared_expert.up_proj"]
        self.down: LinearWeight = w["shared_expert.down_proj"]
        # NOTE: fused weights only where kernels run, so the CPU path (and its parity with
        # transformers) keeps the separate projections.
        fuse = kernels_enabled(_device_of(w["gate"]))
        self.shared_slots: ExpertSlots | None = None
        if fuse and experts.accepts_shared and _swiglu_fp4(gate, up, self.down):
            self.shared_slots, gate_up, gate, up, self.down = _shared_slot(gate, up, self.down)
            self.gate_up = SplitLinear((gate, up), gate_up, fuse=False)
        else:
            self.gate_up = SplitLinear((gate, up), fuse=fuse)
        self.router_gate = SplitLinear((w["gate"], w["shared_expert_gate"]), fuse=fuse)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, H] (normed) -> [N, H]."""
        router_logits, gate_logit = self.router_gate.split(x, (self.num_experts, 1))
        ids, weights = topk_softmax(router_logits, self.top_k, x.dtype)
        if (self.shared_slots is not None
                and fuses_shared_expert(x, weights, self.shared_slots, gate_logit)):
            # routed + sigmoid(gate_logit) * shared in the CUDA decode's launches
            return self.experts.forward(self.layer_id, x, ids, weights,
                                        shared_slots=self.shared_slots, shared_logit=gate_logit)
        routed = self.experts.forward(self.layer_id, x, ids, weights)
        return gated_add(routed, gate_logit, self.shared(x))

    def shared(self, x: torch.Tensor) -> torch.Tensor:
        """The ungated shared expert through its own GEMVs: x [N, H] -> [N, H]."""
        f = self.down.shape[1]
        return linear(silu_mul(*self.gate_up.split(x, (f, f))), self.down)  # [N, H]


def _swiglu_fp4(gate: LinearWeight, up: LinearWeight, down: LinearWeight) -> bool:
    # NVFP4 gate, up [F, H] and down [H, F]: the routed experts' slot format
    if not all(isinstance(w, NVFP4Weight) for w in (gate, up, down)):
        return False
    f, h = gate.shape
    return tuple(up.shape) == (f, h) and tuple(down.shape) == (h, f) and h % 16 == 0 == f % 16


def _shared_slot(gate: NVFP4Weight, up: NVFP4Weight, down: NVFP4Weight
                 ) -> tuple[ExpertSlots, NVFP4Weight | None, NVFP4Weight, NVFP4Weight,
                            NVFP4Weight]:
    """The shared expert as slot 0 of its own ExpertSlots, and (gate_up or None when the gate
    and up global scales differ, gate, up, down) as views of that slot's bytes."""
    slots = single_expert_slots(gate, up, down)
    f = gate.shape[0]
    assert slots.w13_scale is not None and slots.w2_scale is not None
    w13, s13 = slots.w13[0], slots.w13_scale[0]  # [2F, H/2], [2F, H/16]
    g, u = gate.global_scale, up.global_scale
    gate_up = NVFP4Weight(w13, s13, g) if g == u else None
    return (slots, gate_up, NVFP4Weight(w13[:f], s13[:f], g), NVFP4Weight(w13[f:], s13[f:], u),
            NVFP4Weight(slots.w2[0], slots.w2_scale[0], down.global_scale))

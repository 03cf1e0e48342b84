"""The KV-backend interface: one object owns the paged K/V store of every full-attention layer
and the attention over it. `bf16`, `iso3` and `iso4` implement it (see `kv.registry`)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from tinyserve.core import ForwardContext


class KVBackend(ABC):
    """Paged KV store + attention for the full-attention layers of a model. Token t of a
    sequence sits in slot page_ids[t // page_size] * page_size + t % page_size; pages
    0 .. num_pages-1 are usable, one extra may serve as padding."""

    name: str = ""

    def __init__(self, *, layer_ids: list[int], num_kv_heads: int, head_dim: int,
                 num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        self.layer_ids = list(layer_ids)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.device = torch.device(device)
        self.dtype = dtype

    @classmethod
    @abstractmethod
    def bytes_per_token(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one token occupies in the store (K and V, all layers)."""

    @abstractmethod
    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        """Store the new tokens' K/V at `ctx.slot_mapping` and attend causally over each
        sequence's cached prefix and its new tokens. q [N, Hq, D], k and v [N, Hkv, D] (model dtype,
        post-norm, post-RoPE) -> [N, Hq, D] in the model dtype."""

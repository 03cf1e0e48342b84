"""GDN state pool: per (GDN layer, slot) conv state [slots, C, K-1] (model dtype, oldest input
first) and fp32 recurrent state [slots, Hv, dk, dv]. A sequence holds one slot from admission
to finish.
"""

from __future__ import annotations

from typing import Any

import torch

from tinyserve.kv.allocator import PageAllocator


class GDNStatePool:
    """Conv and recurrent states of the GDN layers for `num_slots` sequences. Raises
    ValueError on a bad slot id or a double free, RuntimeError when no slot is free."""

    def __init__(self, *, layer_ids: list[int], num_slots: int, conv_dim: int,
                 conv_kernel: int, num_v_heads: int, k_head_dim: int, v_head_dim: int,
                 device: torch.device | str, dtype: torch.dtype) -> None:
        self.layer_ids = list(layer_ids)
        self.num_slots = num_slots
        self.device = torch.device(device)
        self.dtype = dtype
        self._index = {L: i for i, L in enumerate(self.layer_ids)}
        n = len(self.layer_ids)
        self.conv = torch.zeros(n, num_slots, conv_dim, conv_kernel - 1, dtype=dtype,
                                device=self.device)
        self.recurrent = torch.zeros(n, num_slots, num_v_heads, k_head_dim, v_head_dim,
                                     dtype=torch.float32, device=self.device)
        self._slots = PageAllocator(num_slots)

    @classmethod
    def for_config(cls, config: Any, num_slots: int, *, device: torch.device | str,
                   dtype: torch.dtype) -> GDNStatePool:
        """A pool sized for a `model.config.ModelConfig`."""
        return cls(layer_ids=list(config.linear_attention_layers), num_slots=num_slots,
                   conv_dim=config.linear_conv_dim, conv_kernel=config.linear_conv_kernel_dim,
                   num_v_heads=config.linear_num_value_heads,
                   k_head_dim=config.linear_key_head_dim,
                   v_head_dim=config.linear_value_head_dim, device=device, dtype=dtype)

    @staticmethod
    def bytes_per_slot(config: Any, dtype_bytes: int = 2) -> int:
        """Bytes of one sequence's state over all GDN layers (35B-A3B: 64.4 MB)."""
        per_layer = (config.linear_num_value_heads * config.linear_key_head_dim
                     * config.linear_value_head_dim * 4
                     + config.linear_conv_dim * (config.linear_conv_kernel_dim - 1) * dtype_bytes)
        return len(config.linear_attention_layers) * per_layer

    @property
    def num_free(self) -> int:
        return self._slots.num_free

    def alloc(self) -> int:
        """Take a free slot. Its contents are stale: a fresh sequence (prefix 0) ignores them."""
        got = self._slots.alloc(1)
        if got is None:
            raise RuntimeError(f"no free GDN state slot (all {self.num_slots} in use)")
        return got[0]

    def free(self, slot: int) -> None:
        self._check(slot)
        if self._slots.refcount(slot) == 0:
            raise ValueError(f"double free of GDN state slot {slot}")
        self._slots.free([slot])

    def copy_slot(self, src: int, dst: int) -> None:
        """Copy slot `src`'s state of every layer into slot `dst` (prefix-cache snapshots),
        on the pool's device stream, ordered with the forwards around it."""
        self._check(src)
        self._check(dst)
        if src != dst:
            self.conv[:, dst].copy_(self.conv[:, src])
            self.recurrent[:, dst].copy_(self.recurrent[:, src])

    def conv_state(self, layer_id: int) -> torch.Tensor:
        """[slots, C, K-1] view of one layer's conv states."""
        return self.conv[self._index[layer_id]]

    def recurrent_state(self, layer_id: int) -> torch.Tensor:
        """[slots, Hv, dk, dv] fp32 view of one layer's recurrent states."""
        return self.recurrent[self._index[layer_id]]

    def _check(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.num_slots:
            raise ValueError(f"GDN state slot {slot!r} is out of range [0, {self.num_slots})")

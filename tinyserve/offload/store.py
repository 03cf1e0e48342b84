"""Host expert store: every routed expert in (pinned) host memory, in the fused-MoE slot layout.

An `ExpertSlots` with num_layers * num_experts rows (row = layer * E + expert) whose fields
view ONE host buffer, so a miss is a plain row copy (`offload.lookup`). The buffer is a plain
allocation registered with the CUDA driver (mapped: kernels read it zero-copy), not the pinned
caching allocator, which would round 18 GB up to a power of two. It fills expert by expert as
the loader yields them, so peak RAM stays near the final size. When registration fails or RAM
looks short, a warning gives the numbers and the store stays pageable (the cache then copies
misses through the torch references, one host sync each).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tinyserve.core import LinearWeight, NVFP4Weight
from tinyserve.kernels.moe.fused import ExpertSlots, write_slot
from tinyserve.kernels.moe.host_rows import register_mapped
from tinyserve.log import get_logger

logger = get_logger(__name__)

_ALIGN = 4096


def slot_fields(num_rows: int, hidden: int, inter: int, *, fp4: bool,
                dtype: torch.dtype) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """(field, shape, dtype) of an ExpertSlots with `num_rows` rows (kernels.moe.fused)."""
    r, h, f = num_rows, hidden, inter
    if fp4:
        return [("w13", (r, 2 * f, h // 2), torch.uint8), ("w13_scale", (r, 2 * f, h // 16),
                                                             torch.uint8),
                ("w13_global", (r, 2), torch.float32), ("w2", (r, h, f // 2), torch.uint8),
                ("w2_scale", (r, h, f // 16), torch.uint8), ("w2_global", (r,), torch.float32)]
    return [("w13", (r, 2 * f, h), dtype), ("w2", (r, h, f), dtype)]


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _available_ram() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostExpertStore:
    """All routed experts of a model in host memory (see the module docstring).

    Args:
        num_layers, num_experts, hidden_size, intermediate_size: the geometry.
        fp4: NVFP4 slots (else dense slots in `dtype`).
        pin: register the buffer with CUDA (default: when CUDA is available).
        on_pinned: called with the bytes of each piece registered (load progress).
    Attributes:
        slots: ExpertSlots over the buffer, row = layer * num_experts + expert.
        pinned: whether the buffer is registered (device-addressable).
        nbytes: exact size of the buffer.
    """

    def __init__(self, num_layers: int, num_experts: int, hidden_size: int,
                 intermediate_size: int, *, fp4: bool = True,
                 dtype: torch.dtype = torch.bfloat16, pin: bool | None = None,
                 on_pinned: Callable[[int], None] | None = None) -> None:
        self.num_layers, self.num_experts = num_layers, num_experts
        rows = num_layers * num_experts
        fields = slot_fields(rows, hidden_size, intermediate_size, fp4=fp4, dtype=dtype)
        offsets, total = [], 0
        for _, shape, dt in fields:
            offsets.append(total)
            total += -(-_nbytes(shape, dt) // _ALIGN) * _ALIGN
        self.nbytes = total
        self.bytes_per_expert = sum(_nbytes(shape[1:], dt) for _, shape, dt in fields)
        want_pin = torch.cuda.is_available() if pin is None else pin
        avail = _available_ram()
        if avail is not None and total > avail:
            logger.warning("expert store needs %.2f GiB of host RAM but only %.2f GiB is "
                           "available; expect swapping", total / 2**30, avail / 2**30)
            want_pin = False if pin is None else want_pin
        self.buffer = torch.empty(total, dtype=torch.uint8)
        self.pinned = bool(want_pin) and register_mapped(
            self.buffer, "expert store (every expert-cache miss then waits for the host)",
            on_pinned)
        views: dict[str, torch.Tensor] = {}
        for (name, shape, dt), off in zip(fields, offsets, strict=True):
            views[name] = self.buffer[off:off + _nbytes(shape, dt)].view(dt).view(shape)
        self.slots = ExpertSlots(**views)
        self._pending: dict[tuple[int, int], dict[str, LinearWeight]] = {}
        self._filled = torch.zeros(rows, dtype=torch.bool)

    @classmethod
    def for_config(cls, config: Any, *, fp4: bool = True, dtype: torch.dtype = torch.bfloat16,
                   pin: bool | None = None,
                   on_pinned: Callable[[int], None] | None = None) -> HostExpertStore:
        return cls(config.num_layers, config.num_experts, config.hidden_size,
                   config.moe_intermediate_size, fp4=fp4, dtype=dtype, pin=pin,
                   on_pinned=on_pinned)

    def add(self, name: str, weight: Any) -> bool:
        """Take one canonical weight; True if it was a routed expert's (and is now stored)."""
        from tinyserve.model.loader import parse_expert_name

        parsed = parse_expert_name(name)
        if parsed is None:
            return False
        layer, expert, proj = parsed
        parts = self._pending.setdefault((layer, expert), {})
        parts[proj] = weight
        if len(parts) == 3:
            del self._pending[(layer, expert)]
            row = layer * self.num_experts + expert
            write_slot(self.slots, row, parts["gate_proj"], parts["up_proj"],
                       parts["down_proj"])
            self._filled[row] = True
        return True

    @property
    def complete(self) -> bool:
        return bool(self._filled.all()) and not self._pending

    def check_complete(self) -> None:
        """Raise ValueError naming the first expert that never arrived."""
        if not self.complete:
            missing = (~self._filled).nonzero()
            row = int(missing[0]) if len(missing) else -1
            raise ValueError(f"expert store incomplete: layer {row // self.num_experts} expert "
                             f"{row % self.num_experts} is missing "
                             f"({int((~self._filled).sum())} experts in all)")

    @classmethod
    def from_weights(cls, weights: dict[str, Any], config: Any, *,
                     dtype: torch.dtype = torch.bfloat16,
                     pin: bool | None = None) -> HostExpertStore:
        """A store holding the routed experts of a canonical weight dict."""
        probe = weights["layers.0.mlp.experts.0.gate_proj"]
        store = cls.for_config(config, fp4=isinstance(probe, NVFP4Weight), dtype=dtype, pin=pin)
        for name, w in weights.items():
            store.add(name, w)
        store.check_complete()
        return store

    @classmethod
    def from_checkpoint(cls, path: str | Path, config: Any, *,
                        dtype: torch.dtype = torch.bfloat16, pin: bool | None = None,
                        on_pinned: Callable[[int], None] | None = None,
                        on_read: Callable[[int], None] | None = None) -> HostExpertStore:
        """Read only the routed experts of a checkpoint, shard by shard, into a new store.
        `on_pinned(nbytes)` after each piece of the buffer is registered, `on_read(nbytes)`
        after each checkpoint entry is stored (its bytes on disk): load progress."""
        from tinyserve.model.loader import CheckpointReader
        from tinyserve.model.loader_plan import plan_weights

        with CheckpointReader(path) as reader:
            plans = [p for p in plan_weights(reader, config) if p.is_expert]
            fp4 = all(p.storage in ("modelopt", "compressed-tensors") for p in plans)
            store = cls.for_config(config, fp4=fp4, dtype=dtype, pin=pin, on_pinned=on_pinned)
            for p in plans:
                for name, w in p.load(reader, dtype, torch.device("cpu")):
                    store.add(name, w)
                if on_read is not None:
                    on_read(p.nbytes)
        store.check_complete()
        return store

"""EngineConfig: what the engine is asked for, and the one memory-size parser.

Frozen; what depends on the device and the checkpoint (sequences, KV pages, expert-cache
slots) is decided and returned by the memory plan (`engine.planner`). The CLI takes its
defaults from these fields; `tinyserve plan | run | bench` and `LLM` share one planner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from tinyserve.kv.registry import KV_CHOICES

_DTYPES = ("float32", "bfloat16", "float16")
# Sequences decoded at once on the CPU, and the most the GPU plan grows to on its own.
DEFAULT_MAX_SEQS = 8
# Context the GPU plan gives each sequence without --max-context when the experts are
# offloaded (the design target: >= 128k tokens at 6 GiB with iso3 on 35B-A3B).
DEFAULT_CONTEXT = 131072

_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d+)?|\.\d+)\s*(?:([kmgt])(i?b?)|(b))?\s*", re.IGNORECASE)
SIZE_HELP = ("a memory size: 6GiB, 6G, 6GB, 6144M or bytes (K, M, G, T are binary, "
             "as GPU memory is counted: 6G = 6GB = 6GiB = 6,442,450,944 bytes)")


def parse_size(value: str | int) -> int:
    """'6GiB', '6G', '6GB', '6 gib', '6144M', '1.5GiB', '6442450944' or an int -> bytes.

    K, M, G and T are binary however written (6GB = 6GiB: a "6 GB" card has 6,144 MiB). A bare
    number is whole bytes, at least 1 MiB ('6' is refused). Raises ValueError (one line, with
    examples) for anything else and for sizes that are not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"cannot read {value!r} as {SIZE_HELP}")
    size = value
    if isinstance(value, str):
        m = _SIZE_RE.fullmatch(value)
        if m is None:
            raise ValueError(f"cannot read {value!r} as {SIZE_HELP}")
        number, prefix = m.group(1), (m.group(2) or "").lower()
        if not prefix and "." in number:
            raise ValueError(f"cannot read {value!r} as {SIZE_HELP}: bytes must be a whole number")
        size = round(float(number) * 1024 ** _POWERS[prefix])
        if not prefix and 0 < size < 2**20:
            raise ValueError(f"{value!r} is {size} bytes, surely not meant: give the unit "
                             f"(e.g. {value.strip()}GiB)")
    if size <= 0:
        raise ValueError(f"a memory size must be positive, got {value!r}")
    return size


def describe_size(value: str | int) -> str:
    """How `parse_size` read `value`, for the printed plan: '6GB read as 6 GiB (6,144 MiB)'."""
    size = parse_size(value)
    mib = f"{size / 2**20:,.1f}".removesuffix(".0")
    m = _SIZE_RE.fullmatch(value) if isinstance(value, str) else None
    if m is None or m.group(2) is None:  # bytes
        return f"{size:,} bytes ({mib} MiB)"
    if m.group(3).lower() == "ib":  # already written as a binary unit
        return f"{value.strip()} ({mib} MiB)"
    return f"{value.strip()} read as {m.group(1)} {m.group(2).upper()}iB ({mib} MiB)"


EXPERT_MODES = ("gpu", "cpu", "hybrid", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings (the CLI flags of the same names).

    kv: a `kv.registry` name or "auto". device: "cuda[:N]", "cpu" or None (cuda when there).
    dtype: None = float32 on CPU, bfloat16 on CUDA. gpu_memory: the whole process's GPU budget
    (`parse_size`; None: the free memory). max_context / max_seqs: None lets the plan decide.
    max_num_batched_tokens: the token budget of a step (prefill chunk). num_kv_pages: fixes the
    KV pool. prefix_snapshot_slots: GDN snapshots the prefix cache may keep (None: max_seqs + 1);
    prefix_snapshot_interval: also snapshot every this many prefill tokens (a multiple of
    page_size). expert_cache_slots: force offloaded experts behind this many GPU slots (None: the
    plan decides on CUDA; resident on CPU). experts: where decode misses run (`EXPERT_MODES`:
    copied to the GPU, the CPU, split by the start-up probe, or auto: `engine.expert_mode`).
    """

    model: str
    kv: str = "auto"
    device: str | None = None
    dtype: str | None = None
    gpu_memory: str | int | None = None
    max_context: int | None = None
    max_seqs: int | None = None
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    num_kv_pages: int | None = None
    prefix_cache: bool = True
    prefix_snapshot_slots: int | None = None
    prefix_snapshot_interval: int = 0
    cuda_graphs: bool = True
    expert_cache_slots: int | None = None
    experts: str = "auto"

    def __post_init__(self) -> None:
        for name, choices in (("kv", KV_CHOICES), ("dtype", _DTYPES), ("experts", EXPERT_MODES)):
            value = getattr(self, name)
            if value is not None and value not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        for name, low in (("max_seqs", 1), ("max_num_batched_tokens", 1), ("page_size", 1),
                          ("max_context", 2), ("num_kv_pages", 1), ("expert_cache_slots", 1),
                          ("prefix_snapshot_slots", 0)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if self.max_seqs is not None and self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_seqs ({self.max_seqs})")
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)
        if self.prefix_snapshot_interval < 0 or self.prefix_snapshot_interval % self.page_size:
            raise ValueError(f"prefix_snapshot_interval must be a non-negative multiple of "
                             f"page_size ({self.page_size}), got {self.prefix_snapshot_interval}")

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> EngineConfig:
        """From parsed CLI arguments: attributes that are missing or None keep the defaults."""
        names = {f.name for f in fields(cls)}
        values = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        for flag, name in (("no_prefix_cache", "prefix_cache"), ("no_cuda_graph", "cuda_graphs")):
            if getattr(args, flag, False):
                values[name] = False
        values.update(overrides)
        return cls(**values)

    def snapshot_slots(self, max_seqs: int) -> int:
        """GDN state slots for prefix-cache snapshots with `max_seqs` sequences."""
        if not self.prefix_cache:
            return 0
        return max_seqs + 1 if self.prefix_snapshot_slots is None else self.prefix_snapshot_slots

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def torch_dtype(self) -> Any:
        return self.dtype_on(self.resolved_device)

    def dtype_on(self, device: str) -> Any:
        """The model's torch dtype on `device`: `dtype`, else float32 on the CPU and bfloat16
        on CUDA."""
        import torch

        if self.dtype is not None:
            return getattr(torch, self.dtype)
        return torch.float32 if device == "cpu" else torch.bfloat16

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_size(self.gpu_memory)

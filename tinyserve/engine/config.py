"""EngineConfig: what the engine is asked for. Frozen; derived values are properties."""

from __future__ import annotations

import re
from dataclasses import dataclass, fields
from typing import Any

from tinyserve.kv.registry import KV_BACKEND_NAMES

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_DTYPES = ("float32", "bfloat16", "float16")


def parse_bytes(value: str | int) -> int:
    """'6GiB', '6 GB', '512MiB', '1e9' or an int -> bytes. Raises ValueError."""
    if isinstance(value, int):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a memory size (e.g. 6GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    model: checkpoint directory (or Hugging Face repo id).
    kv: KV cache format (`kv.registry` names). device: "cuda", "cpu" or None (cuda when
    available). dtype: "float32" / "bfloat16" / "float16" or None (float32 on CPU, bfloat16
    on CUDA). max_context: cap on prompt + output tokens (None: the model's and the pool's).
    max_seqs: most sequences in one step. max_num_batched_tokens: token budget of one step
    (prefill chunk size). page_size: tokens per KV page. gpu_memory: budget for the whole
    engine on the GPU ("6GiB"; None: what the device has free). num_kv_pages: fixes the KV
    pool size. kv_memory_fraction: share of the memory left after the weights that the KV
    pool may take when no number of pages is given. prefix_cache: reuse cached prompt
    prefixes (KV pages + GDN state snapshots) across requests. prefix_snapshot_slots: GDN state
    snapshots the prefix cache may keep (each costs a sequence's whole GDN state, ~61 MiB on
    35B-A3B; every running request keeps its newest one, so with fewer slots than running
    requests they displace each other, least recently used first). prefix_snapshot_interval:
    also snapshot every this many prefill tokens (a multiple of page_size; 0: only at the end
    of each prompt and request). cuda_graphs:
    replay CUDA graphs for decode steps on CUDA (`--no-cuda-graph` turns them off).
    expert_cache_slots: force offloaded routed experts (pinned host store + a GPU slot cache
    of this many slots, at least one layer's experts) on any device; None: on CUDA the memory
    planner decides, on CPU every expert is resident.
    experts: where offloaded experts that miss the GPU cache run during decode: "gpu" (copied),
    "cpu" (computed on the CPU), "hybrid" (split by the start-up bandwidth probe) or None
    (hybrid where the probe predicts it faster, else gpu).
    """

    model: str
    kv: str = "bf16"
    device: str | None = None
    dtype: str | None = None
    max_context: int | None = None
    max_seqs: int = 8
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    gpu_memory: str | int | None = None
    num_kv_pages: int | None = None
    kv_memory_fraction: float = 0.9
    prefix_cache: bool = True
    prefix_snapshot_slots: int = 4
    prefix_snapshot_interval: int = 0
    cuda_graphs: bool = True
    expert_cache_slots: int | None = None
    # Hybrid expert execution (offload.hybrid): "gpu", "cpu", "hybrid" or None (the probe
    # decides); applies when the routed experts are offloaded.
    experts: str | None = None

    def __post_init__(self) -> None:
        if self.kv not in KV_BACKEND_NAMES:
            raise ValueError(f"kv must be one of {', '.join(KV_BACKEND_NAMES)}, got {self.kv!r}")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_seqs", "max_num_batched_tokens", "page_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_seqs ({self.max_seqs})")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ValueError(f"num_kv_pages must be >= 1, got {self.num_kv_pages}")
        if not 0.0 < self.kv_memory_fraction <= 1.0:
            raise ValueError(f"kv_memory_fraction must be in (0, 1], got "
                             f"{self.kv_memory_fraction}")
        if self.gpu_memory is not None:
            parse_bytes(self.gpu_memory)
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise ValueError(f"expert_cache_slots must be >= 1, got {self.expert_cache_slots}")
        if self.experts is not None and self.experts not in ("gpu", "cpu", "hybrid"):
            raise ValueError(f"experts must be gpu, cpu or hybrid, got {self.experts!r}")
        if self.prefix_snapshot_slots < 0:
            raise ValueError(f"prefix_snapshot_slots must be >= 0, got "
                             f"{self.prefix_snapshot_slots}")
        if self.prefix_snapshot_interval < 0 or self.prefix_snapshot_interval % self.page_size:
            raise ValueError(f"prefix_snapshot_interval must be a non-negative multiple of "
                             f"page_size ({self.page_size}), got {self.prefix_snapshot_interval}")

    @classmethod
    def from_args(cls, args: Any, **overrides: Any) -> EngineConfig:
        """From parsed CLI arguments: attributes that are missing or None keep the defaults."""
        names = {f.name for f in fields(cls)}
        values = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        if getattr(args, "no_prefix_cache", False):
            values["prefix_cache"] = False
        if getattr(args, "no_cuda_graph", False):
            values["cuda_graphs"] = False
        values.update(overrides)
        return cls(**values)

    @property
    def num_snapshot_slots(self) -> int:
        """GDN state slots kept for prefix-cache snapshots (0 when the cache is off)."""
        return self.prefix_snapshot_slots if self.prefix_cache else 0

    @property
    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def torch_dtype(self) -> Any:
        import torch

        if self.dtype is not None:
            return getattr(torch, self.dtype)
        return torch.float32 if self.resolved_device == "cpu" else torch.bfloat16

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_bytes(self.gpu_memory)

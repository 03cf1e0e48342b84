"""EngineConfig: what the engine is asked for, and the one memory-size parser.

Frozen; derived values are properties; what depends on the device and the checkpoint (the
number of sequences when `max_seqs` is None, the KV pages, the expert-cache slots) is decided
by the memory plan (`engine.planner`), which returns it. The CLI takes its defaults from these
fields (`cli.py`), and `tinyserve plan | run | bench` and the offline `LLM` all build one of
these and hand it to the same planner.
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

    K, M, G and T are binary whichever way they are written (6GB = 6GiB = 6 x 2**30 bytes):
    GPU memory comes in binary units (a "6 GB" card has 6,144 MiB; nvidia-smi counts MiB).
    A number without a unit is bytes and must be whole (and at least 1 MiB: '6' is refused,
    not read as 6 bytes). Raises ValueError (one line, with examples) for anything else, and
    for sizes that are not positive.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"cannot read {value!r} as {SIZE_HELP}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"a memory size must be positive, got {value}")
        return value
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
    if isinstance(value, int) or re.fullmatch(r"\s*\d+\s*[bB]?\s*", value):
        return f"{size:,} bytes ({mib} MiB)"
    m = _SIZE_RE.fullmatch(value)
    assert m is not None
    number, prefix = m.group(1), (m.group(2) or "").upper()
    if m.group(3).lower() == "ib":  # already written as a binary unit
        return f"{value.strip()} ({mib} MiB)"
    return f"{value.strip()} read as {number} {prefix}iB ({mib} MiB)"


# `--experts`: where offloaded experts that miss the GPU cache run during decode (default
# "gpu": every miss is copied to the GPU).
EXPERT_MODES = ("gpu", "cpu", "hybrid", "auto")


@dataclass(frozen=True)
class EngineConfig:
    """Engine settings.

    model: checkpoint directory (or Hugging Face repo id).
    kv: KV cache format (`kv.registry` names, or "auto": `kv.registry.resolve_kv`; the plan
    says what it resolved to). device: "cuda", "cpu" or None (cuda when
    available). dtype: "float32" / "bfloat16" / "float16" or None (float32 on CPU, bfloat16
    on CUDA).
    gpu_memory: what the whole process may use on the GPU, as the driver counts it (CUDA
    context and libraries included): "6GiB" (`parse_size`; None: the device's free memory).
    max_context: cap on prompt + output tokens of one sequence (None: on a GPU whose budget
    makes the plan offload the experts, DEFAULT_CONTEXT tokens, or less when that would take
    more than half the memory the expert cache could have; else the model's whole context).
    max_seqs: most sequences decoded at once (None: 1 on a GPU when the experts are offloaded,
    else as many as spare memory holds up to DEFAULT_MAX_SEQS; DEFAULT_MAX_SEQS on the CPU).
    Each costs a GDN state slot (61 MiB on 35B-A3B) and its share of the KV pages.
    max_num_batched_tokens: token budget of one step (prefill chunk size). page_size: tokens
    per KV page. num_kv_pages: fixes the KV pool size.
    prefix_cache: reuse cached prompt prefixes (KV pages + GDN state snapshots) across
    requests. prefix_snapshot_slots: GDN state snapshots the prefix cache may keep (None: one
    per sequence and one more; each costs a sequence's whole GDN state; every running request
    keeps its newest one, so with fewer slots than running requests they displace each other,
    least recently used first). prefix_snapshot_interval: also snapshot every this many
    prefill tokens (a multiple of page_size; 0: only at the end of each prompt and request).
    cuda_graphs: replay CUDA graphs for decode steps on CUDA (`--no-cuda-graph` turns them
    off). expert_cache_slots: force offloaded routed experts (pinned host store + a GPU slot
    cache of this many slots, at least one layer's experts) on any device; None: on CUDA the
    memory plan decides, on CPU every expert is resident.
    experts: where offloaded experts that miss the GPU cache run during decode: "gpu" (copied),
    "cpu" (computed on the CPU), "hybrid" (split by the start-up bandwidth probe) or "auto"
    (hybrid where the probe predicts it faster, else gpu).
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
    # Hybrid expert execution (offload.hybrid): "gpu", "cpu", "hybrid" or "auto" (the probe
    # decides); applies when the routed experts are offloaded.
    experts: str = "gpu"

    def __post_init__(self) -> None:
        if self.kv not in KV_CHOICES:
            raise ValueError(f"kv must be one of {', '.join(KV_CHOICES)}, got {self.kv!r}")
        if self.device is not None and not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.dtype is not None and self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        for name in ("max_seqs", "max_num_batched_tokens", "page_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_seqs is not None and self.max_num_batched_tokens < self.max_seqs:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                             f">= max_seqs ({self.max_seqs})")
        if self.max_context is not None and self.max_context < 2:
            raise ValueError(f"max_context must be >= 2, got {self.max_context}")
        if self.num_kv_pages is not None and self.num_kv_pages < 1:
            raise ValueError(f"num_kv_pages must be >= 1, got {self.num_kv_pages}")
        if self.gpu_memory is not None:
            parse_size(self.gpu_memory)
        if self.expert_cache_slots is not None and self.expert_cache_slots < 1:
            raise ValueError(f"expert_cache_slots must be >= 1, got {self.expert_cache_slots}")
        if self.experts not in EXPERT_MODES:
            raise ValueError(f"experts must be one of {', '.join(EXPERT_MODES)}, got "
                             f"{self.experts!r}")
        if self.prefix_snapshot_slots is not None and self.prefix_snapshot_slots < 0:
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

    def snapshot_slots(self, max_seqs: int) -> int:
        """GDN state slots kept for prefix-cache snapshots with `max_seqs` sequences (0 when
        the cache is off)."""
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
        import torch

        if self.dtype is not None:
            return getattr(torch, self.dtype)
        return torch.float32 if self.resolved_device == "cpu" else torch.bfloat16

    @property
    def gpu_memory_bytes(self) -> int | None:
        return None if self.gpu_memory is None else parse_size(self.gpu_memory)

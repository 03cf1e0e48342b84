"""MemoryPlan: where every byte of the budget goes, and its printout (`tinyserve plan` and
`tinyserve run` print the same `format()`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

MiB = 1 << 20
GiB = 1 << 30


class PlanError(ValueError):
    """The model cannot run within the budget; the one-line message carries the numbers."""


def mib(n: int) -> str:
    return f"{n / MiB:,.1f} MiB"


@dataclass(frozen=True)
class MemoryPlan:
    """The engine's memory in bytes, decided before anything is loaded. On a GPU
    `gpu_memory` bounds the whole process: `outside_allocator` (item, bytes, how known) + torch's
    allocator capped at `allocator_cap`. default_context / default_expert_slots: the plan
    without --max-context, when --max-context changed it.
    """

    device: str
    device_name: str
    gpu_memory: int | None
    budget_source: str
    outside_allocator: tuple[tuple[str, int, str], ...]
    resident_weights: tuple[tuple[str, int], ...]  # (group, bytes), no embedding
    embed_device: str  # "cuda" | "cpu" (row gather from host RAM)
    embed_bytes: int  # 0 when tied to the lm_head (a resident weight)
    workspace: tuple[tuple[str, int], ...]
    prefill_chunk: int
    max_seqs: int
    snapshot_slots: int
    state_slots: int
    state_bytes_per_slot: int
    kv_format: str
    kv_bytes_per_token: int
    page_size: int
    kv_pages: int
    max_context: int
    expert_slot_bytes: int
    expert_slots: int
    num_routed_experts: int
    experts_per_layer: int
    expert_cache: bool = False
    default_context: int | None = None
    default_expert_slots: int | None = None

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def outside_allocator_bytes(self) -> int:
        return sum(b for _, b, _ in self.outside_allocator)

    @property
    def allocator_cap(self) -> int | None:  # what torch's allocator may reserve
        return None if self.gpu_memory is None else self.gpu_memory - self.outside_allocator_bytes

    @property
    def resident_weight_bytes(self) -> int:
        return sum(b for _, b in self.resident_weights)

    @property
    def workspace_bytes(self) -> int:
        return sum(b for _, b in self.workspace)

    @property
    def state_bytes(self) -> int:
        return self.state_slots * self.state_bytes_per_slot

    @property
    def kv_bytes(self) -> int:
        return self.kv_pages * self.page_size * self.kv_bytes_per_token

    @property
    def context_tokens(self) -> int:
        return self.kv_pages * self.page_size

    @property
    def expert_cache_bytes(self) -> int:
        return self.expert_slots * self.expert_slot_bytes

    @property
    def experts_offloaded(self) -> bool:  # fewer GPU slots than routed experts
        return self.expert_cache and self.expert_slots < self.num_routed_experts

    @property
    def host_expert_bytes(self) -> int:  # the pinned host expert store
        return self.num_routed_experts * self.expert_slot_bytes if self.expert_cache else 0

    @property
    def allocated_bytes(self) -> int:  # in torch's allocator (on the CPU: host RAM)
        embed = self.embed_bytes if self.embed_device == self.device.split(":")[0] else 0
        experts = (self.expert_cache_bytes if self.expert_cache
                   else self.num_routed_experts * self.expert_slot_bytes)
        return (self.resident_weight_bytes + embed + self.workspace_bytes + self.state_bytes
                + self.kv_bytes + experts)

    @property
    def gpu_bytes(self) -> int:  # the process's planned device memory
        return self.outside_allocator_bytes + self.allocated_bytes if self.is_cuda else 0

    @property
    def free_bytes(self) -> int:
        return 0 if self.gpu_memory is None else self.gpu_memory - self.gpu_bytes

    def as_dict(self) -> dict[str, Any]:
        """The fields and the derived figures (every property), for `tinyserve plan --json`."""
        d = asdict(self)
        d["outside_allocator"] = {k: {"bytes": b, "source": s}
                                  for k, b, s in self.outside_allocator}
        d["resident_weights"] = dict(self.resident_weights)
        d["workspace"] = dict(self.workspace)
        d.update({name: getattr(self, name) for name, attr in vars(MemoryPlan).items()
                  if isinstance(attr, property) and name != "is_cuda"})
        return d

    def format(self) -> str:
        def row(label: str, n: int, note: str = "") -> str:
            return f"    {label:<34}{mib(n):>14}" + (f"  ({note})" if note else "")

        rows = self._header()
        rows += [row("weights: " + g, b) for g, b in self.resident_weights]
        if self.embed_device == self.device.split(":")[0]:
            rows.append(row("embedding", self.embed_bytes, "" if self.embed_bytes else "tied"))
        else:
            rows.append(f"    embedding: host RAM, row gather ({mib(self.embed_bytes)})")
        rows += [row("workspace: " + w, b) for w, b in self.workspace]
        seqs = f"{self.max_seqs} sequence{'s' * (self.max_seqs != 1)}"
        parts = [seqs, f"{self.snapshot_slots} prefix snapshots" * bool(self.snapshot_slots),
                 "1 graph padding" * (self.state_slots > self.max_seqs + self.snapshot_slots)]
        rows.append(row(f"GDN states, {self.state_slots} slots", self.state_bytes,
                        ", ".join(p for p in parts if p)))
        rows.append(row(f"KV {self.kv_format}, {self.context_tokens:,} tokens", self.kv_bytes,
                        f"{self.kv_bytes_per_token:,} B/token"))
        n, slots = self.num_routed_experts, self.expert_slots
        if self.expert_cache:
            layers = max(1, n // max(1, self.experts_per_layer))
            rows.append(row(f"expert cache, {slots:,} of {n:,} slots", self.expert_cache_bytes,
                            f"{100.0 * slots / n:.1f}%, {slots / layers:.0f} per layer"))
        else:
            rows.append(row(f"routed experts, all {n:,}", n * self.expert_slot_bytes))
        if self.is_cuda:
            rows.append(row("unused", self.free_bytes))
        rows.append(f"context {self.max_context:,} tokens per sequence, {seqs} at a time, "
                    f"prefill chunk {self.prefill_chunk:,} tokens")
        if self.default_context is not None and self.default_expert_slots is not None:
            dkv = (self.context_tokens - self.default_context) * self.kv_bytes_per_token / MiB
            rows.append(f"--max-context {self.max_context:,} instead of the default "
                        f"{self.default_context:,}: KV {dkv:+,.1f} MiB, expert cache "
                        f"{slots - self.default_expert_slots:+,} slots")
        if self.expert_cache:
            rows.append(f"host RAM: pinned expert store {self.host_expert_bytes / GiB:.2f} GiB")
        return "\n".join(rows)

    def _header(self) -> list[str]:
        if not self.is_cuda:
            return ["memory plan for the CPU (host RAM; no GPU budget)"]
        assert self.gpu_memory is not None and self.allocator_cap is not None
        name = f" ({self.device_name})" if self.device_name else ""
        outside = [f"    {item:<34}{mib(b):>14}  ({how})" for item, b, how in
                   self.outside_allocator]
        return [f"memory plan for {self.device}{name}: {self.budget_source} for the whole process",
                f"  {'outside torch allocator':<36}{mib(self.outside_allocator_bytes):>14}",
                *outside, f"  {'torch allocator, capped at':<36}{mib(self.allocator_cap):>14}"]

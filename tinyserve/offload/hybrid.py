"""Hybrid expert execution: a layer's cache misses split between PCIe copies and the CPU.

Decode at a small GPU budget is bound by PCIe, while host RAM reads faster. Of a decode layer's
m distinct misses the GPU copies m - c while the CPU computes c from the pinned store in place
(`kernels.moe.cpu`), with c making both finish together:

    (m - c) * t_copy = t_call + c * t_cpu   ->   c = (m * t_copy - t_call) / (t_copy + t_cpu)

(t_copy = bytes per expert / H2D rate, t_cpu per expert, t_call per layer; all from the
start-up probe, `offload.bandwidth`). The lookup kernel applies the split (a, b) = (t_copy,
t_call) / (t_copy + t_cpu) on the device, so it needs no host sync; CPU-computed experts are
not cached. On CUDA the CPU part runs in stream order (`CpuExperts`): a kernel writes x and
the routing into pinned memory and the GPU part's pairs (the CPU's at weight 0) on the
device, and the stream raises the request flag of the CPU worker
(`kernels.moe.cpu.HostWorker`, spinning on it) before the layer's miss copies, then waits for its
answer flag and a kernel adds the answer from pinned memory (`kernels.moe.cpu_exchange`), with
stream memory operations for the flags (`cuStreamWriteValue32` / `cuStreamWaitValue32`,
capturable in the decode graph; no host function, no driver thread and no copy-engine
transfer in the path).
Modes (`--experts`): "gpu", "cpu" (every miss on the CPU), "hybrid"; None ("auto") picks
hybrid when the probe predicts it faster, and the started engine then keeps whichever of the
three decodes fastest (`engine.expert_mode`). Streamed prefill and batches over
`CPU_MAX_TOKENS` tokens (`offload.provider`) stay on the GPU.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from tinyserve.kernels import cuda_launch
from tinyserve.kernels.moe import cpu as nvfp4_cpu
from tinyserve.kernels.moe import cpu_exchange
from tinyserve.log import get_logger
from tinyserve.offload.bandwidth import Bandwidths, device_seconds, probe
from tinyserve.offload.lookup import cpu_share

logger = get_logger(__name__)

EXPERT_MODES = ("gpu", "cpu", "hybrid")
_ALL = -1.0e6  # b of the "cpu" split: every miss


def _check_mode(mode: str) -> None:
    if mode not in EXPERT_MODES:
        raise ValueError(f"experts must be one of {', '.join(EXPERT_MODES)}, got {mode!r}")


@dataclass(frozen=True)
class HybridPlan:
    """The chosen mode and its split (a, b); `bandwidths` is the probe behind it (None: none
    ran) and `layer_us` the time of a decode layer's top_k misses per mode: measured with both
    sides at once where the probe did (`Bandwidths.split_us`), else predicted from the
    rates. `auto`: chosen by auto, which a hybrid choice leaves for decoding to settle
    (`engine.expert_mode`); `decode_tok_s`: what that measured per mode."""

    mode: str
    a: float = 0.0
    b: float = 0.0
    bandwidths: Bandwidths | None = None
    layer_us: dict[str, float] | None = None
    auto: bool = False
    decode_tok_s: dict[str, float] | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "a": self.a, "b": self.b, "layer_us": self.layer_us,
                "auto": self.auto, "decode_tok_s": self.decode_tok_s,
                "bandwidths": None if self.bandwidths is None else self.bandwidths.as_dict()}

    def with_mode(self, mode: str) -> HybridPlan:
        """This plan's probe with `mode`'s split ("hybrid": this plan's own)."""
        _check_mode(mode)
        if mode == "hybrid" and self.mode != "hybrid":
            raise ValueError("a hybrid split comes from plan_split")
        a, b = {"gpu": (0.0, 0.0), "cpu": (1.0, _ALL), "hybrid": (self.a, self.b)}[mode]
        return replace(self, mode=mode, a=a, b=b)

    def format(self) -> str:
        head = f"experts           {self.mode}" + (" (auto)" if self.auto else "")
        if self.mode == "hybrid":
            head += f" (of m misses, CPU takes {self.a:.2f} * m - {self.b:.2f})"
        lines = [head]
        if self.bandwidths is not None:
            lines.append(f"bandwidth         {self.bandwidths.format()}")
        if self.layer_us:
            how = "measured" if self.bandwidths and self.bandwidths.split_us else "predicted"
            lines.append("layer misses      " + ", ".join(
                f"{k} {v:.0f} us" for k, v in self.layer_us.items()) + f" ({how})")
        if self.decode_tok_s:
            lines.append("decode            " + ", ".join(
                f"{k} {v:.1f} tok/s" for k, v in self.decode_tok_s.items()) + " (measured)")
        return "\n".join(lines)


def plan_split(bw: Bandwidths, mode: str | None, top_k: int) -> HybridPlan:
    """The plan for `mode` (None: auto, hybrid where its layer time is below gpu-only's) from
    probe `bw`: a from the two rates alone, b such that a layer of top_k misses gives the CPU
    the share that measured fastest (`split_us`; without it, the share the rates predict).
    Raises ValueError for an unknown mode or a split that needs the H2D rate when the probe
    has none."""
    if mode is not None:
        _check_mode(mode)
    if bw.h2d is None:
        if mode == "hybrid":
            raise ValueError("the hybrid split needs the H2D rate (a CUDA device)")
        if mode == "cpu":
            return HybridPlan("cpu", 1.0, _ALL, bw)
        return HybridPlan("gpu", bandwidths=bw, auto=mode is None)
    t_copy = bw.bytes_per_expert / bw.h2d
    t_cpu, t_call = bw.cpu_expert_s, bw.cpu_overhead_s
    a, b = t_copy / (t_copy + t_cpu), t_call / (t_copy + t_cpu)
    m = top_k
    if sorted(bw.split_us) == list(range(m + 1)):  # both at once contend for host memory
        c = min(bw.split_us, key=lambda i: (bw.split_us[i], i))
        b = a * m - c
        us = {"gpu": bw.split_us[0], "cpu": bw.split_us[m], "hybrid": bw.split_us[c]}
    else:
        c = cpu_share(a, b, m)
        us = {"gpu": m * t_copy * 1e6, "cpu": (t_call + m * t_cpu) * 1e6,
              "hybrid": max((m - c) * t_copy, t_call + c * t_cpu if c else 0.0) * 1e6}
    auto = mode is None
    if auto:
        mode = "hybrid" if us["hybrid"] < us["gpu"] else "gpu"
    return HybridPlan("hybrid", a, b, bw, us, auto).with_mode(mode)


@dataclass
class _Entry:
    """Buffers of one (layer, batch size) CPU call on CUDA (kept for the graphs' lifetime)."""

    stage: torch.Tensor  # [N, H + 2k] fp32 pinned: x | rows (int32 bits) | weights
    answer: torch.Tensor  # [N, H] fp32 pinned, written by the CPU worker
    desc: torch.Tensor  # int64 descriptor (kernels.moe.cpu.host_descriptor)
    number: int  # its request number at the worker


class CpuExperts:
    """Runs the CPU share of a layer's experts in stream order (module docstring).

    `start(layer, x, ids, slot_ids, weights)` requests the CPU work of the pairs whose slot is
    -1 and returns the GPU part's pairs, and `join(out)` adds its result to the GPU part's
    output; `computed` counts the distinct experts computed so far. The kernel runs on
    `threads` CPU threads (`set_threads`; the probe picks the fastest count).
    """

    def __init__(self, store: Any, *, device: torch.device | str) -> None:
        nvfp4_cpu.check_slots(store.slots)
        self.threads = nvfp4_cpu.max_threads()
        self.store = store
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self._worker = nvfp4_cpu.HostWorker(pin=True) if self.cuda else None
        if self._worker is not None:  # the device addresses of its request and answer flags
            w = self._worker
            self._go, self._done = (flags_address(w.flags, i) for i in (w.GO, w.DONE))
        self._entries: dict[tuple[int, int, int], _Entry] = {}
        self._pending: _Entry | torch.Tensor | None = None  # started, not joined (CPU: its y)
        self._inline_count = 0
        self._timing: dict[int, list[Any]] = {}  # k -> static inputs and graph of time_rows

    def set_threads(self, threads: int) -> None:
        """Run the following calls on `threads` threads (calls already queued included)."""
        self.threads = nvfp4_cpu.check_threads(threads)
        for e in self._entries.values():
            e.desc[nvfp4_cpu.D_THREADS] = threads

    @property
    def computed(self) -> int:
        """Distinct (layer, expert) computations run on the CPU so far."""
        return self._inline_count + sum(int(e.desc[nvfp4_cpu.D_COUNT])
                                        for e in self._entries.values())

    def start(self, layer: int, x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor,
              weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Request the CPU work of `layer`'s pairs with slot_ids < 0 on the current stream (the
        GPU work queued after it runs while the CPU computes). x [N, H]; ids, slot_ids (int32),
        weights [N, k] on the device. Returns the GPU part's (slot_ids, weights): the CPU's
        pairs at slot 0 with weight 0."""
        if not self.cuda:
            rows = torch.where(slot_ids < 0, ids.long() + layer * self.store.num_experts, -1)
            self._inline_count += len(set(rows[rows >= 0].tolist()))
            self._pending = nvfp4_cpu.moe_cpu(x, rows, weights, self.store.slots,
                                              threads=self.threads)
            return cpu_exchange.gpu_part_ref(slot_ids, weights)
        e = self._entry(layer, *ids.shape)
        gpu_part = cpu_exchange.write_request(x.contiguous(), ids.contiguous(),
                                              slot_ids.contiguous(), weights.contiguous(),
                                              e.stage)
        stream_write(torch.cuda.current_stream(self.device), self._go, e.number)
        self._pending = e
        return gpu_part

    def join(self, out: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`out` [N, H] (the GPU part of the layer's experts, best in float32: then the layer's
        sum is rounded once) plus the CPU part of the last `start`, in fp32 rounded to `dtype`
        (None: out's). On CUDA the current stream's next work waits until the CPU answered.
        NOTE: one stream for both: a wait on a separate stream can hold the GPU work queued
        behind it on a shared hardware queue, serialising the two."""
        e, self._pending = self._pending, None
        if e is None:
            raise RuntimeError("join() without a start()")
        if isinstance(e, torch.Tensor):
            return cpu_exchange.add_answer_ref(out, e, dtype)
        stream = torch.cuda.current_stream(self.device)
        stream_wait(stream, self._done, e.number)
        stream_write(stream, self._done, 0)
        return cpu_exchange.add_answer(out.contiguous(), e.answer, dtype)

    def time_rows(self, x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor) -> float:
        """Seconds of one CPU call over store `rows` [1, k] (any layers) as a decode layer
        pays it: on CUDA the request, the answer and its sum captured in a CUDA graph (one
        per k, kept) and timed between events on the device; elsewhere the inline call."""
        slot = torch.where(rows >= 0, -1, 0).to(torch.int32)
        ids = torch.where(rows >= 0, rows, 0)  # rows relative to layer 0's base: any row
        if not self.cuda:
            t = time.perf_counter()
            self.start(0, x, ids, slot, weights)
            self.join(torch.zeros_like(x))
            return time.perf_counter() - t
        k = rows.shape[1]
        static = self._timing.get(k)
        if static is None:
            dev = self.device
            static = [x.to(dev), ids.to(dev), slot.to(dev), weights.to(dev)]
            base = torch.zeros_like(static[0], dtype=torch.bfloat16)
            self.start(0, *static)  # buffers made and the first call run outside the capture
            self.join(base)
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.start(0, *static)
                self.join(base)
            static.append(graph)
            self._timing[k] = static
        for dst, src in zip(static[:4], (x, ids, slot, weights), strict=True):
            dst.copy_(src)
        return device_seconds(static[4].replay)

    def _entry(self, layer: int, n: int, k: int) -> _Entry:
        key = (layer, n, k)
        e = self._entries.get(key)
        if e is None:
            h = self.store.slots.hidden_size
            pin = dict(dtype=torch.float32, pin_memory=True)
            stage, answer = torch.zeros(n, h + 2 * k, **pin), torch.zeros(n, h, **pin)
            with torch.inference_mode(False):  # `set_threads` writes it from any thread
                desc = nvfp4_cpu.host_descriptor(self.store.slots, stage, answer, k,
                                                 layer * self.store.num_experts, self.threads)
            e = _Entry(stage, answer, desc, self._worker.add(desc))
            self._entries[key] = e
        return e


def flags_address(flags: torch.Tensor, index: int) -> int:
    """The device address of int32 `flags[index]` (pinned host memory, mapped)."""
    address = ctypes.c_uint64()
    cuda_launch.check(cuda_launch.driver().cuMemHostGetDevicePointer_v2(
        ctypes.byref(address), ctypes.c_void_p(flags.data_ptr()), 0), "cuMemHostGetDevicePointer")
    return address.value + 4 * index


def stream_write(stream: Any, address: int, value: int) -> None:
    """Queue `*address = value` (int32, after the stream's earlier work and a memory fence)."""
    cuda_launch.check(cuda_launch.driver().cuStreamWriteValue32_v2(
        ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(address), ctypes.c_uint32(value),
        0), "cuStreamWriteValue32")


def stream_wait(stream: Any, address: int, value: int) -> None:
    """Hold the stream's later work until `*address == value` (int32)."""
    eq = 1  # CU_STREAM_WAIT_VALUE_EQ
    cuda_launch.check(cuda_launch.driver().cuStreamWaitValue32_v2(
        ctypes.c_void_p(stream.cuda_stream), ctypes.c_uint64(address), ctypes.c_uint32(value),
        eq), "cuStreamWaitValue32")


def configure(experts: Any, mode: str | None, top_k: int) -> HybridPlan:
    """Probe and give `experts` (an `OffloadedExperts`) the plan for `mode` ("auto" or None,
    the default: the fastest predicted, settled by decoding once the engine runs). Raises
    ValueError when "cpu" / "hybrid" cannot run here (no numba, experts not NVFP4, no H2D rate
    for hybrid)."""
    cache = experts.cache
    resident = cache.num_slots >= cache.num_layers * cache.num_experts
    mode = None if mode == "auto" else mode
    plan, runner = HybridPlan("gpu", auto=mode is None), None
    # auto off CUDA: no copies to split the misses against, so nothing to probe
    if mode != "gpu" and not resident and (mode is not None or cache.device.type == "cuda"):
        try:
            if not nvfp4_cpu.available():
                raise ValueError("the CPU expert kernel needs numba (pip install numba) and an "
                                 "x86-64 CPU with AVX2, FMA and F16C")
            runner = CpuExperts(cache.store, device=cache.device)
        except ValueError:
            if mode is not None:
                raise
        if runner is not None:
            plan = plan_split(probe(cache.store, top_k, cache=cache, runner=runner), mode,
                              top_k)
    experts.set_hybrid(plan, runner)
    logger.info("expert execution plan:\n%s", plan.format())
    return plan

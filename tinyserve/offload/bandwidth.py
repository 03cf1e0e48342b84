"""Start-up probe of the two ways a missing expert can be served: its copy over PCIe (the miss
copy kernel from the mapped host store, as decode runs it) and its computation on the CPU
(`kernels.moe.cpu`, one token, as decode runs it), beside the host's read bandwidth; then both
at once, as a hybrid decode layer runs them (`split_times`: the two share the host's memory, so
each is slower than alone).

`probe(store, ...)` takes about a second; `tinyserve bench --bandwidth` prints it, the hybrid
plan (`offload.hybrid.plan_split`) is computed from it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from tinyserve.kernels.moe import cpu as nvfp4_cpu
from tinyserve.offload.store import HostExpertStore


@dataclass(frozen=True)
class Bandwidths:
    """What one probe measured.

    host_read: bytes/s of every CPU thread reading `read_bytes` of the store.
    h2d: bytes/s of the miss-copy path (None off CUDA).
    cpu_expert_s / cpu_overhead_s: the CPU kernel's time per expert (one token) and the fixed
        part of one call (on CUDA with the round trip: copies, request, answer), on `threads`
        threads: of the counts tried (`call_us`: a top_k call's time on each), the one with the
        fastest split (below), or else the fastest call.
    split_us: a decode layer's top_k misses served both ways at once on `threads` threads, by
        how many of them the CPU computes (0..top_k), microseconds on the device (empty: not
        measured).
    """

    host_read: float
    read_bytes: int
    h2d: float | None
    cpu_expert_s: float
    cpu_overhead_s: float
    bytes_per_expert: int
    threads: int
    call_us: dict[int, float] = field(default_factory=dict)
    split_us: dict[int, float] = field(default_factory=dict)

    @property
    def cpu_kernel(self) -> float:
        """Expert bytes per second the CPU kernel reads."""
        return self.bytes_per_expert / self.cpu_expert_s

    @property
    def cpu_fraction(self) -> float:
        """The CPU kernel's read rate as a fraction of the host read bandwidth."""
        return self.cpu_kernel / self.host_read

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "cpu_kernel": self.cpu_kernel, "cpu_fraction": self.cpu_fraction}

    def format(self) -> str:
        h2d = "n/a" if self.h2d is None else f"{self.h2d / 1e9:.1f} GB/s"
        text = (f"host read {self.host_read / 1e9:.1f} GB/s, H2D miss copy {h2d}, CPU expert "
                f"kernel {self.cpu_kernel / 1e9:.1f} GB/s on {self.threads} threads "
                f"({self.cpu_fraction:.0%} of host read; {self.cpu_expert_s * 1e6:.0f} us per "
                f"expert + {self.cpu_overhead_s * 1e6:.0f} us per call)")
        if self.split_us:
            text += "; layer by CPU share " + " ".join(
                f"{c}:{us:.0f}" for c, us in self.split_us.items()) + " us"
        return text


def host_read_bandwidth(store: HostExpertStore, max_bytes: int = 4 << 30,
                        reps: int = 3) -> tuple[float, int]:
    """(bytes/s, bytes read) of every CPU thread reading the first `max_bytes` of the store's
    buffer; the best of `reps`. NOTE: a store smaller than the last-level cache reads from
    the cache: the rate is then the cache's, not the memory's."""
    buf = store.buffer[:min(store.nbytes, max_bytes)]
    nvfp4_cpu.read_host(buf[:4096])  # compile
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        nvfp4_cpu.read_host(buf)
        best = min(best, time.perf_counter() - t)
    return buf.numel() / best, buf.numel()


def cpu_expert_times(store: HostExpertStore, top_k: int, threads: int, runner: Any = None,
                     reps: int = 5) -> tuple[float, float]:
    """(seconds per expert, seconds per call) of the CPU kernel for one token on `threads`
    threads, rows drawn across the whole store: `reps` pairs of calls of 1 and of `top_k`
    experts, one after the other; the median of the 1-expert calls and of the pairs'
    differences (a slow spell of the host's over any three calls in a row leaves both as they
    were). `runner`: an `offload.hybrid.CpuExperts` to time through (the round trip a decode
    layer pays, `time_rows`; its thread count is set), else `moe_cpu` itself."""
    if runner is not None:
        runner.set_threads(threads)
    g = torch.Generator().manual_seed(0)
    rows_total = store.num_layers * store.num_experts
    h = store.slots.hidden_size
    x = torch.randn(1, h, generator=g)
    k = max(2, min(top_k, rows_total))

    def once(n: int) -> float:
        rows = torch.randperm(rows_total, generator=g)[:n].view(1, n)
        w = torch.full((1, n), 1.0 / n)
        if runner is not None:
            return runner.time_rows(x, rows, w)
        t = time.perf_counter()
        nvfp4_cpu.moe_cpu(x, rows, w, store.slots, threads=threads)
        return time.perf_counter() - t

    once(1)  # compile, warm the threads
    pairs = [(once(1), once(k)) for _ in range(reps)]
    t1 = statistics.median(one for one, _ in pairs)
    per = max(statistics.median(many - one for one, many in pairs) / (k - 1), 1e-9)
    return per, max(t1 - per, 0.0)


def h2d_bandwidth(cache: Any, n: int, reps: int = 5) -> float | None:
    """Bytes/s of the cache's miss-copy path (`DeviceExpertCache._copy`, its throttle
    included) copying `n` experts into scratch slots; None off CUDA."""
    if cache.device.type != "cuda":
        return None
    rows_total = cache.num_layers * cache.num_experts
    dst = torch.arange(n, dtype=torch.int32, device=cache.device)
    times = []
    with scratch_slots(cache, n):
        for i in range(reps + 1):
            rows = (torch.randperm(rows_total)[:n]).to(torch.int32).to(cache.device)
            t = device_seconds(lambda rows=rows: cache._copy(rows, dst))
            if i:
                times.append(t)
    return n * cache.store.bytes_per_expert / statistics.median(times)


@contextlib.contextmanager
def scratch_slots(cache: Any, n: int) -> Iterator[None]:
    """Within: the cache's miss copies land in `n` fresh slots (its own slots untouched)."""
    from tinyserve.kernels.moe.fused import allocate_expert_slots

    src = cache.store.slots
    scratch = allocate_expert_slots(n, src.hidden_size, src.intermediate_size, fp4=src.is_fp4,
                                    device=cache.device)
    slots, cache.slots = cache.slots, scratch
    try:
        yield
    finally:
        cache.slots = slots


def device_seconds(fn: Callable[[], None]) -> float:
    """Seconds the current CUDA stream spends on the work `fn` queues (between two events)."""
    begin, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
    begin.record()
    fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def probe(store: HostExpertStore, top_k: int, *, cache: Any = None, runner: Any = None
          ) -> Bandwidths:
    """Measure everything `Bandwidths` holds (`cache`: the GPU expert cache whose miss copies
    to time; `runner`: the CpuExperts whose round trip to time). The thread count is the one
    whose best measured split (`split_times`, where both can run) or else whose top_k call is
    fastest."""
    host, nbytes = host_read_bandwidth(store)
    counts = thread_counts(nvfp4_cpu.max_threads())
    times = {t: cpu_expert_times(store, top_k, t, runner) for t in counts}
    call_us = {t: (overhead + top_k * per) * 1e6 for t, (per, overhead) in times.items()}
    h2d = h2d_bandwidth(cache, top_k) if cache is not None else None
    splits: dict[int, dict[int, float]] = {}
    if h2d is not None and runner is not None:
        for t in counts:  # the copies slow the CPU down, more so on more threads
            runner.set_threads(t)
            splits[t] = split_times(cache, runner, top_k)
        threads = min(splits, key=lambda t: min(splits[t].values()))
    else:
        threads = min(call_us, key=call_us.__getitem__)
    if runner is not None:
        runner.set_threads(threads)
    per, overhead = times[threads]
    return Bandwidths(host_read=host, read_bytes=nbytes, h2d=h2d, cpu_expert_s=per,
                      cpu_overhead_s=overhead, bytes_per_expert=store.bytes_per_expert,
                      threads=threads, call_us=call_us, split_us=splits.get(threads, {}))


def split_times(cache: Any, runner: Any, top_k: int, reps: int = 7) -> dict[int, float]:
    """Microseconds of one token's `top_k` misses in a decode layer's order, for c = 0..top_k
    of them computed on the CPU (`runner`, an `offload.hybrid.CpuExperts` on CUDA): the CPU
    call requested, the other top_k - c copied by the cache's miss-copy path (its throttle
    included) into scratch slots, the answer waited for and added; captured in a CUDA graph
    per c and timed on the device, fresh rows each replay, median of `reps`. c = 0 copies
    alone."""
    dev, h = cache.device, cache.store.slots.hidden_size
    rows_total = cache.num_layers * cache.num_experts
    g = torch.Generator().manual_seed(0)
    first = torch.arange(top_k).view(1, top_k)
    x = torch.randn(1, h, generator=g).to(dev)
    weights = torch.full((1, top_k), 1.0 / top_k, device=dev)
    base = torch.zeros(1, h, dtype=torch.bfloat16, device=dev)  # the GPU part's output
    rows = torch.zeros(1, top_k, dtype=torch.int32, device=dev)
    dst = torch.arange(top_k, dtype=torch.int32, device=dev)
    out: dict[int, float] = {}
    with scratch_slots(cache, top_k):
        for c in range(top_k + 1):
            slot = torch.where(first < c, -1, 0).to(torch.int32).to(dev)

            def layer(c: int = c, slot: torch.Tensor = slot) -> None:
                if c:
                    runner.start(0, x, rows, slot, weights)
                if c < top_k:
                    cache._copy(rows[0, c:], dst[:top_k - c])
                if c:
                    runner.join(base)

            layer()  # the runner's buffers made outside the capture
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                layer()
            times = []
            for _ in range(reps):
                rows.copy_(torch.randperm(rows_total, generator=g)[:top_k].view(1, top_k))
                times.append(device_seconds(graph.replay) * 1e6)
            out[c] = statistics.median(times)
    return out


def thread_counts(n: int) -> list[int]:
    """The CPU kernel's thread counts the probe tries with `n` CPUs: all but two (the engine's
    own threads, Python and the CUDA driver's, keep theirs while the kernel's threads spin
    between its parallel regions), half and a quarter (host memory saturates before the cores
    do: 8 of 16 ran a decode layer's call fastest, `hybrid_experts_4dad20e.json`)."""
    return sorted({max(1, n - 2), max(1, n // 2), max(1, n // 4)}, reverse=True)


def synthetic_store(config: Any, max_bytes: int = 4 << 30) -> HostExpertStore:
    """A store of `config`'s expert geometry, filled with random bytes, of at most
    `max_bytes` (whole layers, at least one): what `tinyserve bench --bandwidth` probes
    without reading a checkpoint."""
    one_layer = HostExpertStore(1, config.num_experts, config.hidden_size,
                                config.moe_intermediate_size, pin=False).nbytes
    layers = max(1, min(config.num_layers, max_bytes // one_layer))
    store = HostExpertStore(layers, config.num_experts, config.hidden_size,
                            config.moe_intermediate_size, pin=torch.cuda.is_available())
    g = torch.Generator().manual_seed(0)
    chunk = 1 << 28
    for i in range(0, store.nbytes, chunk):
        part = store.buffer[i:i + chunk]
        part.copy_(torch.randint(0, 256, (part.numel(),), dtype=torch.uint8, generator=g))
    # finite block scales (E4M3 codes 0x30-0x3F: 0.5 .. 1.875) and unit global scales
    for f in (store.slots.w13_scale, store.slots.w2_scale):
        f.bitwise_and_(0x0F).bitwise_or_(0x30)
    store.slots.w13_global.fill_(1.0)
    store.slots.w2_global.fill_(1.0)
    return store

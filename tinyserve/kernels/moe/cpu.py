"""NVFP4 routed experts on the CPU (numba), read in place from the host expert store.

`moe_cpu` computes out[t] = sum_j weights[t, j] * down_r(silu(gate_r(x_t)) * up_r(x_t)) for
every pair with row r = rows[t, j] >= 0 (row -1: the pair runs on the GPU). Each matrix's input
is quantized to int8 per block of 16 (scale max|x| / 127, as llama.cpp's CPU dots) and dotted
with the E2M1 codes in integers (AVX2 pshufb / pmaddubsw, x86-64 only); `moe_cpu_ref` rounds
the same way (outputs within ~1 % of unquantized fp32 math). Every call runs on `HostWorker`, a
pool of native threads (numba cfuncs: no Python, no GIL) that spin between calls: a leader
takes requests through flags in memory (pinned: the GPU raises and waits on them with stream
memory operations, `offload.hybrid`), prepares the call and shares its work items with the
helpers in two phases (per expert and block of hidden units: gate and up rows, silu-mul, int8
rounding; then per block of down rows, each summing its pairs in a fixed order: the same bits
for any thread count). Threads that spin start a decode layer's call at once; a thread team
that sleeps between calls (numba's parallel regions, before) must first be woken.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from tinyserve.kernels.moe.fused import ExpertSlots, moe_pairs_ref

ROW_BLOCK = 32  # hidden units (gate and up rows) or down rows per work item
# NOTE: the layout of a call's descriptor (int64 words, `host_descriptor`)
DESC_WORDS = 17
(D_STAGE, D_OUT, D_N, D_K, D_ROW_BASE, D_W13, D_S13, D_G13, D_W2, D_S2, D_G2, D_ROWS, D_H, D_F,
 D_COUNT, D_CALLS, D_THREADS) = range(DESC_WORDS)


def available() -> bool:
    """Whether the CPU expert kernel can run here (numba, an x86-64 CPU with AVX2)."""
    try:
        from llvmlite import binding
    except ImportError:
        return False
    return binding.get_host_cpu_features().get("avx2", False)


def check_slots(slots: ExpertSlots) -> None:
    if not slots.is_fp4 or slots.device.type != "cpu":
        raise ValueError("the CPU expert kernel reads NVFP4 ExpertSlots in host memory")
    h, f = slots.hidden_size, slots.intermediate_size
    if h % 64 or f % 64:
        raise ValueError(f"the CPU expert kernel needs H and F multiples of 64, got H={h} F={f}")


def moe_cpu(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, slots: ExpertSlots, *,
            out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """The CPU-side routed experts of a batch (module docstring): x [N, H] float, rows [N, k]
    store rows (-1: not here), weights [N, k], NVFP4 slots in host memory, all on the CPU.
    Returns out [N, H] float32 (every element written) on `threads` (default: all). Raises
    ValueError on inputs the kernel does not take, RuntimeError without numba."""
    check_slots(slots)
    n, h = x.shape
    if h != slots.hidden_size or rows.shape != weights.shape or rows.shape[0] != n:
        raise ValueError(f"x {list(x.shape)}, rows {list(rows.shape)}, weights "
                         f"{list(weights.shape)} do not match H={slots.hidden_size}")
    if any(t.device.type != "cpu" for t in (x, rows, weights)):
        raise ValueError("moe_cpu takes CPU tensors")
    if rows.numel() and not -1 <= int(rows.min()) <= int(rows.max()) < slots.num_slots:
        raise ValueError(f"rows must be -1 or store rows 0..{slots.num_slots - 1}")
    if out is None:
        out = torch.empty(n, h, dtype=torch.float32)
    elif out.shape != (n, h) or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 [{n}, {h}] tensor")
    threads = check_threads(max_threads() if threads is None else threads)
    stage = torch.cat([x.detach().float(), rows.detach().to(torch.int32).view(torch.float32),
                       weights.detach().float()], dim=1)
    worker().run(host_descriptor(slots, stage, out, rows.shape[1], 0, threads))
    return out


def quantize_blocks_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded as the kernel's int8 inputs (per block of 16), dequantized, fp32."""
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def moe_cpu_ref(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, slots: ExpertSlots,
                *, quantize_inputs: bool = True) -> torch.Tensor:
    """Torch reference of `moe_cpu` in fp32, inputs rounded as the kernel's (unless not
    `quantize_inputs`)."""
    rnd = quantize_blocks_ref if quantize_inputs else torch.Tensor.float
    return moe_pairs_ref(rnd(x.float()), rows, weights.float(), slots, rnd)


def read_host(buffer: torch.Tensor) -> int:
    """A checksum of every 8-byte word of a contiguous CPU tensor, read with `max_threads()`
    threads (the host read-bandwidth probe of `offload.bandwidth`)."""
    words = buffer.view(torch.uint8).reshape(-1)
    words = words[:words.numel() // 8 * 8].view(torch.int64).numpy().view("uint64")
    parts = np.array_split(words, max_threads())
    return sum(int(s) for s in _readers().map(_kernels().read_sum, parts)) % 2**64


def max_threads() -> int:
    """The pool's threads: numba's thread count (the CPUs this process may run on;
    NUMBA_NUM_THREADS sets it)."""
    import numba

    _kernels()  # numba imported after its cache directory is set
    return numba.config.NUMBA_NUM_THREADS


def check_threads(threads: int) -> int:
    if not 1 <= threads <= max_threads():
        raise ValueError(f"threads must be in 1..{max_threads()}, got {threads}")
    return threads


def host_descriptor(slots: ExpertSlots, stage: torch.Tensor, out: torch.Tensor,
                    top_k: int, row_base: int, threads: int) -> torch.Tensor:
    """The int64 [DESC_WORDS] descriptor of a `HostWorker` call: on `threads` threads
    (word D_THREADS, changeable) over `stage` (float32 [N, H + 2k]: x | rows as int32 bits
    relative to `row_base` | weights) into `out` (float32 [N, H]); both outlive every call."""
    check_slots(slots)
    n, h = out.shape
    if stage.shape != (n, h + 2 * top_k) or stage.dtype != torch.float32 \
            or out.dtype != torch.float32 or not (stage.is_contiguous() and out.is_contiguous()):
        raise ValueError("host_descriptor: stage must be float32 [N, H + 2k], out float32 [N, H]")
    # NOTE: built as a list (one tensor write per word costs ~2 us: moe_cpu builds one per call)
    d = [stage.data_ptr(), out.data_ptr(), n, top_k, row_base,
         *(t.data_ptr() for t in slots.buffers), slots.num_slots, h, slots.intermediate_size,
         0, 0, check_threads(threads)]
    assert len(d) == DESC_WORDS and d[D_THREADS] == threads and d[D_ROWS] == slots.num_slots
    return torch.tensor(d, dtype=torch.int64)


class HostWorker:
    """A pool of `threads` native threads running CPU expert calls on request (module
    docstring), with no Python and no GIL.

    A requester (the GPU through stream memory operations, or `call`) writes flags[GO] = i
    for descriptor i (`add`'s number); the leader thread clears GO, runs the call with the
    helpers and answers flags[DONE] = i. `run` leads a call from the calling thread instead.
    One call at a time. Each thread spins (`pause`) while calls come, polls every 50 us after
    `spin` idle polls and every 1 ms after ~0.1 s more. `close()` (or garbage collection)
    stops the pool.
    `pin`: the flags in pinned memory (for a GPU requester).
    """

    GO, DONE, STOP = 0, 1, 2

    def __init__(self, *, pin: bool = False, threads: int | None = None, capacity: int = 4096,
                 spin: int = 100_000) -> None:
        import ctypes
        import threading
        import weakref

        k = _kernels()
        self.threads = threads = check_threads(max_threads() if threads is None else threads)
        with torch.inference_mode(False):  # written from anywhere, the finalizer included
            self.flags = torch.zeros(4, dtype=torch.int32, pin_memory=pin)
            self.table = torch.zeros(capacity, dtype=torch.int64)
            self.pool = torch.zeros(k.pool_words(threads), dtype=torch.int64)
        self._descriptors: list[torch.Tensor] = []
        self._lock = threading.Lock()
        usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
        pool = self.pool.data_ptr()
        controls = [torch.tensor([self.flags.data_ptr(), self.table.data_ptr(), capacity,
                                  usleep, spin, pool, threads], dtype=torch.int64)]
        controls += [torch.tensor([pool, i, usleep, spin], dtype=torch.int64)
                     for i in range(1, threads)]
        loops = [ctypes.CFUNCTYPE(None, ctypes.c_void_p)(a)
                 for a in (k.lead_address, k.assist_address)]
        pool_threads = [threading.Thread(target=loops[i > 0], args=(c.data_ptr(),),
                                         daemon=True, name=f"tinyserve-cpu-experts-{i}")
                        for i, c in enumerate(controls)]
        for t in pool_threads:
            t.start()
        # the buffers outlive the loops: the finalizer holds them until the threads are joined
        self._stop = weakref.finalize(self, _stop_pool, self.flags, self.pool, k.P_STOP,
                                      pool_threads, controls, self.table, self._descriptors)

    def add(self, descriptor: torch.Tensor) -> int:
        """Register `descriptor` (`host_descriptor`; kept alive here): its request number."""
        if len(self._descriptors) == self.table.numel():
            raise ValueError(f"the CPU expert worker holds at most {self.table.numel()} calls")
        self._descriptors.append(descriptor)
        self.table[len(self._descriptors) - 1] = descriptor.data_ptr()
        return len(self._descriptors)

    def call(self, number: int) -> None:
        """Request call `number` through the flags, as the GPU does, and wait for its answer
        (tests)."""
        import time

        with self._lock:
            flags = self.flags.numpy()
            flags[self.GO] = number
            while flags[self.DONE] != number:
                time.sleep(0)
            flags[self.DONE] = 0

    def run(self, descriptor: torch.Tensor) -> None:
        """Run the call of `descriptor` with the calling thread as the pool's thread 0 (no
        request, no waiting thread; the GIL released). Never while a GPU request runs."""
        with self._lock:
            _kernels().lead_call(self.pool.data_ptr(), self.threads, descriptor.data_ptr())

    def close(self) -> None:
        self._stop()


def _stop_pool(flags: torch.Tensor, pool: torch.Tensor, stop: int, threads: list[Any],
               *buffers: Any) -> None:
    flags[HostWorker.STOP] = 1
    pool[stop] = 1
    for t in threads:
        t.join()


@functools.cache
def worker() -> HostWorker:
    """The process's pool (flags pinned where CUDA runs): every call of the kernel runs on it,
    so its threads never compete with another pool's."""
    return HostWorker(pin=torch.cuda.is_available())


@functools.cache
def _readers() -> Any:
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_threads(), thread_name_prefix="tinyserve-read")


@functools.cache
def _kernels() -> Any:
    import os
    import sys

    if "numba" not in sys.modules:  # compiled code cached beside the other kernels
        from tinyserve import envs

        os.environ.setdefault("NUMBA_CACHE_DIR", str(envs.CACHE_DIR.get() / "numba"))
    try:
        import numba  # noqa: F401
    except ImportError:
        raise RuntimeError("the CPU expert kernel needs numba (pip install numba)") from None
    from tinyserve.kernels.moe import cpu_numba as _nvfp4_cpu_numba

    return _nvfp4_cpu_numba.build(ROW_BLOCK, DESC_WORDS)

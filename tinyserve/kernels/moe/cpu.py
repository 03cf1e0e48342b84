"""NVFP4 routed experts on the CPU (numba), read in place from the host expert store.

`moe_cpu` computes out[t] = sum_j weights[t, j] * down_r(silu(gate_r(x_t)) * up_r(x_t)) for
every pair with row r = rows[t, j] >= 0 (row -1: the pair runs on the GPU). Each matrix's input
is quantized to int8 per block of 16 (scale max|x| / 127, as llama.cpp's CPU dots) and dotted
with the E2M1 codes in integers (AVX2 pshufb / pmaddubsw, x86-64 only); `moe_cpu_ref` rounds
the same way (outputs within ~1 % of unquantized fp32 math). Two parallel regions (per expert
and block of hidden units: gate and up rows, silu-mul, its int8 rounding; down per row block
summing its pairs in a fixed order: the same bits for any thread count) on native helper
threads (`HelperPool`). numba: wheels everywhere, the GIL released, and a native loop
(`HostWorker`) that serves calls requested through flags in pinned memory with no Python,
which the GPU raises and waits on with stream memory operations (`offload.hybrid`)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from tinyserve.kernels.moe.fused import ExpertSlots, moe_pairs_ref

ROW_BLOCK = 32  # hidden units (gate and up rows) or down rows per work item
# NOTE: the layout of a host-entry descriptor (int64 words, `host_descriptor`)
DESC_WORDS = 17
(D_STAGE, D_OUT, D_N, D_K, D_ROW_BASE, D_W13, D_S13, D_G13, D_W2, D_S2, D_G2, D_ROWS, D_H, D_F,
 D_COUNT, D_CALLS, D_THREADS) = range(DESC_WORDS)
# NOTE: the layout of a `HelperPool`'s control block (int64 words; cpu_numba.helper)
POOL_WORDS = 9
P_REGION, P_JOB, P_DONE, P_STOP, P_SPIN, P_DOZE, P_USLEEP, P_HELPERS, P_SHARES = range(POOL_WORDS)


def available() -> bool:
    """Whether the CPU expert kernel can run here (numba, an x86-64 CPU with AVX2, FMA and F16C:
    every one since Haswell and Zen)."""
    try:
        from llvmlite import binding
    except ImportError:
        return False
    features = binding.get_host_cpu_features()
    return all(features.get(f, False) for f in ("avx2", "fma", "f16c"))


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
    k = _kernels()
    threads = check_threads(max_threads() if threads is None else threads)
    xf = x.detach().to(torch.float32).contiguous().numpy()
    r = rows.detach().to(torch.int64).contiguous().numpy()
    w = weights.detach().to(torch.float32).contiguous().numpy()
    store = (t.numpy() for t in slots.buffers)  # views, no copy
    pool = _python_pool()
    with pool.lock:  # (the GIL released meanwhile)
        k.moe_pooled(xf, r, w, *store, out.numpy(), threads, pool.address)
    return out


def quantize_blocks_ref(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded as the kernel's int8 inputs (per block of 16), dequantized, fp32:
    the same bits. (Its code is round(x * (127 / amax)) with a true division: torch divides a
    Python scalar by a tensor through the tensor's reciprocal, one rounding more, and a bf16
    input at an exact tie then takes the other code.)"""
    blocks = x.float().reshape(*x.shape[:-1], -1, 16)
    amax = blocks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax * torch.full_like(amax, 1 / 127))).reshape(x.shape)


def moe_cpu_ref(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, slots: ExpertSlots,
                *, quantize_inputs: bool = True) -> torch.Tensor:
    """Torch reference of `moe_cpu` in fp32, inputs rounded as the kernel's (unless not
    `quantize_inputs`)."""
    rnd = quantize_blocks_ref if quantize_inputs else torch.Tensor.float
    return moe_pairs_ref(rnd(x.float()), rows, weights.float(), slots, rnd)


def read_host(buffer: torch.Tensor) -> int:
    """A checksum of every 8-byte word of a contiguous CPU tensor, read with all the kernel's
    threads (the host read-bandwidth probe of `offload.bandwidth`)."""
    words = buffer.view(torch.uint8).reshape(-1)
    words = words[:words.numel() // 8 * 8].view(torch.int64).numpy().view("uint64")
    return int(_kernels().read_sum(words))


def max_threads() -> int:
    """The most threads the CPU kernel can run on (the CPUs numba sees; NUMBA_NUM_THREADS sets
    it)."""
    import numba

    _kernels()
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
    d = torch.zeros(DESC_WORDS, dtype=torch.int64)
    d[D_STAGE], d[D_OUT], d[D_N], d[D_K], d[D_ROW_BASE] = (stage.data_ptr(), out.data_ptr(), n,
                                                           top_k, row_base)
    for i, t in zip((D_W13, D_S13, D_G13, D_W2, D_S2, D_G2), slots.buffers, strict=True):
        d[i] = t.data_ptr()
    d[D_ROWS], d[D_H], d[D_F] = slots.num_slots, h, slots.intermediate_size
    d[D_THREADS] = check_threads(threads)
    return d


class HelperPool:
    """Native helper threads for the kernel's calls, with no Python and no GIL: `threads - 1`
    of them (`max_threads()`, at most 255: the region word holds the count in a byte) run the
    work items of every call made on the pool (`cpu_numba.moe_pooled`, on the calling thread
    and the helpers). numba's own parallel regions would take the GIL to start, and wait for
    any Python thread that holds it. A call waits for its work items, not for its helpers: one
    the OS has not run yet leaves its share to the threads that run (`cpu_numba`, shares).
    Each helper spins (`pause`) until `spin` seconds passed without work (longer than a decode
    step, so decode never waits for it to wake), then polls every 50 us, and every 1 ms after
    `doze` seconds more. One call at a time (`lock` for Python callers); `close()` (or garbage
    collection) stops the helpers.
    """

    def __init__(self, *, spin: float = 0.05, doze: float = 0.1) -> None:
        import ctypes
        import threading
        import weakref

        k = _kernels()
        hz = _tsc_hz()
        self.threads = min(max_threads(), 255)
        with torch.inference_mode(False):  # written from anywhere, the finalizer included
            self.pool = torch.zeros(POOL_WORDS, dtype=torch.int64)
            self._job = torch.zeros(k.job_words, dtype=torch.int64)  # every call's, in turn
            self._shares = torch.zeros(self.threads, 8, dtype=torch.int64)
        self.pool[P_SPIN], self.pool[P_DOZE] = int(spin * hz), int(doze * hz)
        self.pool[P_USLEEP] = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value
        self.pool[P_HELPERS] = self.threads - 1
        self.pool[P_JOB], self.pool[P_SHARES] = self._job.data_ptr(), self._shares.data_ptr()
        self.address = self.pool.data_ptr()
        self.lock = threading.Lock()
        self._controls = torch.tensor([[self.address, tid] for tid in range(1, self.threads)],
                                      dtype=torch.int64).view(-1, 2)
        helper = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(k.helper_address)
        helpers = [threading.Thread(target=helper, args=(c.data_ptr(),), daemon=True,
                                    name=f"tinyserve-cpu-experts-{i + 1}")
                   for i, c in enumerate(self._controls)]
        for t in helpers:
            t.start()
        # the buffers outlive the loops: the finalizer holds them until the threads are joined
        self._stop = weakref.finalize(self, _stop_helpers, self.pool, helpers, self._controls,
                                      self._job, self._shares)

    def close(self) -> None:
        self._stop()


def _stop_helpers(pool: torch.Tensor, helpers: list[Any], *buffers: Any) -> None:
    pool[P_STOP] = 1
    for t in helpers:
        t.join()


@functools.cache
def _python_pool() -> HelperPool:
    """The helper pool of `moe_cpu`'s calls (made on first use)."""
    return HelperPool()


class HostWorker:
    """A native thread running CPU expert calls on request, with no Python and no GIL.

    A requester (the GPU through stream memory operations, or `call` from any thread) writes
    flags[GO] = i for descriptor i (`add`'s number); the worker clears GO, runs the call on
    itself and a `HelperPool` of its own (`spin`, `doze`: its helpers' and its own idling) and
    answers flags[DONE] = i. One request at a time. `close()` (or garbage collection) stops
    them. `pin`: the flags in pinned memory (for a GPU requester).
    """

    GO, DONE, STOP = 0, 1, 2

    def __init__(self, *, pin: bool = False, capacity: int = 4096, spin: float = 0.05,
                 doze: float = 0.1) -> None:
        import ctypes
        import threading
        import weakref

        k = _kernels()
        with torch.inference_mode(False):  # written from anywhere, the finalizer included
            self.flags = torch.zeros(4, dtype=torch.int32, pin_memory=pin)
            self.table = torch.zeros(capacity, dtype=torch.int64)
        self.helpers = HelperPool(spin=spin, doze=doze)
        self._descriptors: list[torch.Tensor] = []
        self._control = torch.tensor([self.flags.data_ptr(), self.table.data_ptr(), capacity,
                                      self.helpers.address], dtype=torch.int64)
        serve = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(k.serve_address)
        thread = threading.Thread(target=serve, args=(self._control.data_ptr(),), daemon=True,
                                  name="tinyserve-cpu-experts")
        thread.start()
        # the buffers outlive the loop, and the helpers the worker (its finalizer holds them)
        self._stop = weakref.finalize(self, _stop_worker, self.flags, thread, self.helpers,
                                      self._control, self.table, self._descriptors)

    def add(self, descriptor: torch.Tensor) -> int:
        """Register `descriptor` (`host_descriptor`; kept alive here): its request number."""
        if len(self._descriptors) == self.table.numel():
            raise ValueError(f"the CPU expert worker holds at most {self.table.numel()} calls")
        self._descriptors.append(descriptor)
        self.table[len(self._descriptors) - 1] = descriptor.data_ptr()
        return len(self._descriptors)

    def call(self, number: int) -> None:
        """Request call `number` and wait for its answer (CPU use and tests)."""
        import time

        self.flags[self.GO] = number
        while int(self.flags[self.DONE]) != number:
            time.sleep(0)
        self.flags[self.DONE] = 0

    def close(self) -> None:
        self._stop()


def _stop_worker(flags: torch.Tensor, thread: Any, helpers: HelperPool, *buffers: Any) -> None:
    flags[HostWorker.STOP] = 1
    thread.join()
    helpers.close()


@functools.cache
def _tsc_hz() -> float:
    """Ticks per second of the time-stamp counter (over 10 ms)."""
    import time

    tsc = _kernels().tsc
    tsc()
    a, t = tsc(), time.perf_counter()
    time.sleep(0.01)
    return (tsc() - a) / (time.perf_counter() - t)


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

    return _nvfp4_cpu_numba.build(ROW_BLOCK, DESC_WORDS, POOL_WORDS)

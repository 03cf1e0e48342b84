"""A debug throttle for benchmarks: `stamp(device)` records the GPU timer; `hold(rows,
seconds_per_row)`, queued after a copy of the listed rows, spins until that much time has
passed since the stamp, so a faster copy ends at the target rate (the expert cache plays a
slower PCIe link: `bench/hybrid_experts.py --h2d-gbps`). Single-program Triton kernels, CUDA
only (PTX %globaltimer); imported by the expert cache when it throttles."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _now():
    dummy = tl.full([1], 0, tl.int32)
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy],
                                  dtype=tl.int64, is_pure=False, pack=1)
    return tl.max(t, axis=0)


@triton.jit
def stamp_kernel(clock_ptr):
    tl.store(clock_ptr + tl.arange(0, 1), tl.full([1], 0, tl.int64) + _now())


@triton.jit
def hold_kernel(clock_ptr, rows_ptr, K, ns_per_row, BLOCK_K: tl.constexpr):
    offs = tl.arange(0, BLOCK_K)
    rows = tl.load(rows_ptr + offs, mask=offs < K, other=-1)
    n = tl.sum((rows >= 0).to(tl.int32), axis=0)
    start = tl.max(tl.load(clock_ptr + tl.arange(0, 1)), axis=0)
    target = start + (n.to(tl.float32) * ns_per_row).to(tl.int64)
    now = _now()
    while now < target:
        now = _now()


def _clock(device: torch.device | str) -> torch.Tensor:
    """The device word of `device`'s stamp: one per GPU, however the device is named ("cuda"
    and "cuda:0" are the same word)."""
    device = torch.device(device)
    index = torch.cuda.current_device() if device.index is None else device.index
    return _clock_at(index)


@functools.cache
def _clock_at(index: int) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int64, device=torch.device("cuda", index))


def stamp(device: torch.device | str) -> None:
    """Record the GPU's timer (stream-ordered) as the start of the next held copy."""
    stamp_kernel[(1,)](_clock(device), num_warps=1)


def hold(rows: torch.Tensor, seconds_per_row: float) -> None:
    """Hold the stream until `seconds_per_row` x (entries of `rows` >= 0) has passed since the
    last `stamp` on its device. rows: [K] int32 on a CUDA device."""
    if rows.dim() != 1 or rows.dtype != torch.int32 or rows.device.type != "cuda":
        raise ValueError(f"rows must be [K] int32 on a CUDA device, got {rows.dtype} "
                         f"{tuple(rows.shape)} on {rows.device}")
    k = rows.numel()
    hold_kernel[(1,)](_clock(rows.device), rows, k, seconds_per_row * 1e9,
                      BLOCK_K=triton.next_power_of_2(max(k, 1)), num_warps=1)

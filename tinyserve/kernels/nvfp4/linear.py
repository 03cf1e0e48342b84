"""NVFP4 W4A16 linear: `nvfp4_linear(x, w) = x @ dequantize(w).T`, one path per regime
(`choose_path`):
- "gemv" (decode, M <= GEMV_MAX_M): the CUDA GEMV of `cuda.py` for one 16-bit row with K in
  1024/2048/4096 (every Qwen3.5 decode GEMV), else the Triton gemv of `triton.py`;
- "dot" (M < DEQUANT_MIN_M): tensor-core dot with the weight tile dequantized in the K loop
  (`dot_triton.py`), split-K when there are too few output tiles;
- "dequant" (prefill): dequantize to a scratch and torch.matmul (cuBLAS)."""

from __future__ import annotations

import functools

import torch

from tinyserve.core import NVFP4Weight
from tinyserve.kernels.launch import (
    cdiv,
    dequant_matmul,
    dot_tiles,
    num_sms,
    split_k_output,
    split_k_result,
)
from tinyserve.kernels.nvfp4 import cuda as nvfp4_cuda

PATHS = ("gemv", "dot", "dequant")
GEMV_MAX_M = 4
GEMV_MULTI_ROW_MAX_WEIGHTS = 1 << 23  # M > 1 takes gemv only up to this N * K (o_proj size)
DEQUANT_MIN_M = 128


@functools.cache
def _kernels():
    from tinyserve.kernels.nvfp4 import triton as nvfp4_triton

    return nvfp4_triton


@functools.cache
def _dot_kernels():
    from tinyserve.kernels.nvfp4 import dot_triton as nvfp4_dot_triton

    return nvfp4_dot_triton


def choose_path(m: int, n: int = 0, k: int = 0) -> str:
    """The path for M rows of x against an [N, K] weight: gemv for M = 1, and up to
    GEMV_MAX_M rows on weights of at most GEMV_MULTI_ROW_MAX_WEIGHTS (on larger ones its
    per-row work loses to dot); dot below DEQUANT_MIN_M; else dequant."""
    if m == 1 or (m <= GEMV_MAX_M and n * k <= GEMV_MULTI_ROW_MAX_WEIGHTS):
        return "gemv"
    return "dot" if m < DEQUANT_MIN_M else "dequant"


def describe() -> str:
    return (f"CUDA one-row GEMV (M = 1, 16-bit x, K in {nvfp4_cuda.KS}); Triton gemv (other "
            f"M <= {GEMV_MAX_M}); Triton tl.dot (M < {DEQUANT_MIN_M}); dequantize + cuBLAS")


def _check_weight(w: NVFP4Weight) -> tuple[int, int]:
    if w.packed.dtype != torch.uint8 or w.block_scale.dtype != torch.uint8:
        raise TypeError("NVFP4 packed codes and block scales must be uint8")
    if w.packed.dim() != 2:
        raise ValueError(f"NVFP4 packed codes must be [N, K/2], got {list(w.packed.shape)}")
    n, half_k = w.packed.shape
    k = half_k * 2
    if k % 16:
        raise ValueError(f"NVFP4 weight K={k} is not a multiple of 16")
    if tuple(w.block_scale.shape) != (n, k // 16):
        raise ValueError(f"block_scale {list(w.block_scale.shape)} != [{n}, {k // 16}]")
    if not (w.packed.is_contiguous() and w.block_scale.is_contiguous()):
        raise ValueError("NVFP4 weight tensors must be contiguous")
    if w.packed.device != w.block_scale.device:
        raise ValueError("NVFP4 codes and block scales must be on one device")
    return n, k


def _check(x: torch.Tensor, w: NVFP4Weight) -> tuple[int, int, int]:
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    n, k = _check_weight(w)
    if x.shape[1] != k:
        raise ValueError(f"x {list(x.shape)} does not match NVFP4 weight [{n}, {k}]")
    if w.packed.device != x.device:
        raise ValueError("x and the weight must be on the same device")
    return x.shape[0], n, k


def row_range(rows: tuple[int, int] | None, n: int) -> tuple[int, int]:
    """`rows` (None = all) checked against N rows: 0 <= r0 <= r1 <= N, else ValueError."""
    r0, r1 = rows if rows is not None else (0, n)
    if not 0 <= r0 <= r1 <= n:
        raise ValueError(f"rows {rows} are not a range within [0, {n}]")
    return r0, r1


def _gemv(x: torch.Tensor, w: NVFP4Weight, m: int, n: int, k: int) -> torch.Tensor:
    if nvfp4_cuda.takes(x, w):
        return nvfp4_cuda.gemv_one_row(x, w)
    kern = _kernels()
    kb = k // 16
    # 8 rows x 128 blocks when K > 512, else 1024 / (K/16) rows x all of K
    block_b = 128 if kb > 32 else 1 << (kb - 1).bit_length()
    block_n = 1024 // block_b
    num_warps = max(1, min(4, block_n * block_b // 64))
    block_m = 1 if m == 1 else (2 if m == 2 else 4)
    num_m = cdiv(m, block_m)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    factor = kern.FP4_UNIT * float(w.global_scale)
    grid = (num_m * cdiv(n, block_n),)
    kern.nvfp4_gemv_kernel[grid](x, w.packed.view(torch.int64), w.block_scale, out, factor, m,
                                 n, kb, x.stride(0), BLOCK_M=block_m, BLOCK_N=block_n,
                                 BLOCK_B=block_b, num_warps=num_warps)
    return out


def _dot(x: torch.Tensor, w: NVFP4Weight, m: int, n: int, k: int) -> torch.Tensor:
    kern = _dot_kernels()
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_k = 128
    num_m = cdiv(m, block_m)
    block_n, split, k_split = dot_tiles(num_m, n, k, 64, block_k, 2 * num_sms(x.device))
    out = split_k_output(split, m, n, x)
    grid = (num_m * split * cdiv(n, block_n),)
    kern.nvfp4_dot_kernel[grid](x, w.packed, w.block_scale, out, float(w.global_scale), m, n,
                                k, x.stride(0), k // 2, k // 16, k_split, k_split // 2,
                                k_split // 16, SPLIT_K=split, BLOCK_M=block_m,
                                BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return split_k_result(out, split, x.dtype)


def nvfp4_dequantize(w: NVFP4Weight, dtype: torch.dtype = torch.bfloat16, *,
                     rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Dense [N, K] (or rows [r0, r1)) of an NVFP4 weight in `dtype`, on its device."""
    kern = _dot_kernels()
    n, k = _check_weight(w)
    r0, r1 = row_range(rows, n)
    out = torch.empty(r1 - r0, k, device=w.packed.device, dtype=dtype)
    if r0 == r1:
        return out
    block_n, block_k = 32, 128
    grid = (cdiv(r1 - r0, block_n), cdiv(k, block_k))
    kern.nvfp4_dequant_kernel[grid](w.packed[r0:r1], w.block_scale[r0:r1], out,
                                    float(w.global_scale), r1 - r0, k, k // 2, k // 16,
                                    BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def nvfp4_linear(x: torch.Tensor, w: NVFP4Weight, *, path: str | None = None
                 ) -> torch.Tensor:
    """y = x @ dequantize(w).T on a GPU (or the Triton interpreter).

    Args:
        x: [..., K] bf16 / fp16 / fp32 on the weight's device.
        w: packed uint8 [N, K/2], block_scale uint8 [N, K/16], contiguous.
        path: "gemv", "dot" or "dequant"; None = `choose_path` (tests force one).
    Returns [..., N] in x.dtype: fp32 accumulation, except the CUDA gemv's fp16 sums of each
    block of 16 products (`csrc/nvfp4_decode.cuh`).
    Raises ValueError / TypeError on shape, dtype, layout or device mismatch.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k = _check(x2, w)
    path = path or choose_path(m, n, k)
    if path not in PATHS:
        raise ValueError(f"unknown nvfp4 path {path!r}; choose from {PATHS}")
    if m == 0:
        return x.new_empty(*lead, n)
    if path == "gemv":
        y = _gemv(x2, w, m, n, k)
    elif path == "dot":
        y = _dot(x2, w, m, n, k)
    else:
        y = dequant_matmul(x2, functools.partial(nvfp4_dequantize, w), n, k)
    return y.reshape(*lead, n)

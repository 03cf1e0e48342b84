"""NVFP4 W4A16 linear in Triton: `nvfp4_linear(x, w) = x @ dequantize(w).T`.

Three paths (specs/nvfp4.md §5.3), picked by the number of rows M of x:

- `gemv` (M <= GEMV_MAX_M, decode): for one row of bf16/fp16 x on a GPU with K in 1024 /
  2048 / 4096, the CUDA kernel of `nvfp4_cuda` (every weight byte requested at entry); else
  Triton: int64 loads of 16 packed codes, arithmetic E2M1 decode
  ("f32" or "h2", `nvfp4_tiles.py`), E4M3 decoded from its uint8 bits, split-K when there are
  too few programs to fill the GPU (fp32 partials, summed by one torch op). Tiles per shape
  come from `nvfp4_tiles.GEMV_TILES` (rule-based default for other shapes); an entry with
  `persistent` > 0 runs the persistent gemv (`nvfp4_persist_triton.py`: a fixed grid looping
  over row tiles, next tile's loads in flight during this one's decode) for M <= 4 and
  bf16/fp16 x.
- `dot` (up to DEQUANT_MIN_M): tensor-core `tl.dot` with the weight tile dequantized in the
  K loop (even and odd inputs as two dots, no lookup table, no scratch).
- `dequant` (prefill): dequantize to a bf16/fp16 scratch (in row chunks of at most
  SCRATCH_ELEMS) and call torch.matmul (cuBLAS).

The thresholds come from TINYSERVE_NVFP4_GEMV_MAX_M / TINYSERVE_NVFP4_DEQUANT_MIN_M; the
bench (`bench/nvfp4.py`) measures all three. The reference is `kernels/nvfp4_ref.py`.
Triton is imported on the first call, never at import time.
"""

from __future__ import annotations

import functools

import torch

from tinyserve import envs
from tinyserve.core import NVFP4Weight
from tinyserve.kernels import nvfp4_cuda
from tinyserve.kernels.launch import (
    cdiv,
    dot_tiles,
    num_sms,
    resident_programs,
    split_k_output,
    split_k_result,
)
from tinyserve.kernels.nvfp4_tiles import GemvConfig, default_gemv_config

PATHS = ("gemv", "dot", "dequant")
SCRATCH_ELEMS = 1 << 24  # dequant scratch cap (32 MiB in bf16)


__all__ = ["PATHS", "GemvConfig", "choose_path", "default_gemv_config", "nvfp4_dequantize",
           "nvfp4_linear"]


@functools.cache
def _kernels():
    from tinyserve.kernels import nvfp4_triton

    return nvfp4_triton


@functools.cache
def _persist_kernels():
    from tinyserve.kernels import nvfp4_persist_triton

    return nvfp4_persist_triton


@functools.cache
def _dot_kernels():
    from tinyserve.kernels import nvfp4_dot_triton

    return nvfp4_dot_triton


@functools.cache
def _thresholds() -> tuple[int, int]:
    return envs.NVFP4_GEMV_MAX_M.get(), envs.NVFP4_DEQUANT_MIN_M.get()


PERSISTENT_MAX_M = 4  # rows of x the persistent gemv takes in one program
# NOTE: at most this many (weight rows x rows of x) per persistent tile: 16 weight rows at
# M = 2, 8 at M = 3..4 (sm_90 builds spill beyond it; `test_nvfp4_persist.py`)
PERSISTENT_MAX_ROWS = 32
GEMV_MULTI_ROW_MAX_WEIGHTS = 1 << 23  # M > 1 takes gemv only up to this N * K (o_proj size)


def choose_path(m: int, n: int = 0, k: int = 0) -> str:
    """The default path for M rows of activations against an [N, K] weight (0: unknown).

    M = 1 is gemv; up to TINYSERVE_NVFP4_GEMV_MAX_M rows stay on gemv only for weights of at
    most GEMV_MULTI_ROW_MAX_WEIGHTS (the gemv decodes a tile once for every row of x, but on
    larger weights its per-row work makes a 4-row call slower than `dot`); then `dot` below
    TINYSERVE_NVFP4_DEQUANT_MIN_M, else `dequant`.
    """
    gemv_max, dequant_min = _thresholds()
    if m == 1 or (m <= gemv_max and n * k <= GEMV_MULTI_ROW_MAX_WEIGHTS):
        return "gemv"
    return "dot" if m < dequant_min else "dequant"


def _check_weight(w: NVFP4Weight) -> tuple[int, int]:
    """(N, K) of a weight the kernels can read: uint8, contiguous, scales [N, K/16]."""
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


def _gemv(x: torch.Tensor, w: NVFP4Weight, m: int, n: int, k: int,
          cfg: GemvConfig | None) -> torch.Tensor:
    if cfg is None and nvfp4_cuda.takes(x, w):
        return nvfp4_cuda.gemv_one_row(x, w)
    kern = _kernels()
    sms = num_sms(x.device)
    cfg = cfg or default_gemv_config(n, k, sms)
    if cfg.persistent and m <= PERSISTENT_MAX_M and x.dtype != torch.float32:
        return _gemv_persistent(x, w, m, n, k, cfg, sms)
    kb = k // 16
    words = w.packed.view(torch.int64)  # [N, K/16]: one block of 16 codes per word
    # NOTE: h2 serves one row of 16-bit x; M > 1 and fp32 x (h2 would round it to fp16)
    # take f32
    is_h2 = cfg.decode == "h2" and m == 1 and x.dtype != torch.float32
    block_m = 1 if m == 1 else (2 if m == 2 else 4)
    num_m = cdiv(m, block_m)
    n_blocks = cdiv(n, cfg.block_n)
    split = 1
    while (num_m * n_blocks * split < cfg.programs_per_sm * sms
           and kb // (split * 2) >= cfg.block_b):
        split *= 2
    b_split = cdiv(cdiv(kb, split), cfg.block_b) * cfg.block_b
    split = cdiv(kb, b_split)
    out = split_k_output(split, m, n, x)
    factor = kern.FP4_UNIT * float(w.global_scale)
    grid = (num_m * split * n_blocks,)
    kern.nvfp4_gemv_kernel[grid](x, words, w.block_scale, out, factor, m, n, kb, x.stride(0),
                                 b_split, SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
                                 BLOCK_B=cfg.block_b, PREFETCH=cfg.prefetch, VEC=cfg.vec,
                                 IS_H2=is_h2, USE_ASM=x.device.type == "cuda",
                                 ONE_STEP=is_h2 and b_split <= cfg.block_b,
                                 num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return split_k_result(out, split, x.dtype)


_RESIDENT: dict[tuple, int] = {}  # persistent gemv variant -> programs that fit on one SM


def _gemv_persistent(x: torch.Tensor, w: NVFP4Weight, m: int, n: int, k: int,
                     cfg: GemvConfig, sms: int) -> torch.Tensor:
    # NOTE: one K step per tile (block_b raised to cover K), all M <= 4 rows of x per program
    kern = _persist_kernels()
    kb = k // 16
    block_b = max(cfg.block_b, 1 << (kb - 1).bit_length())
    block_m = 1 if m == 1 else (2 if m == 2 else 4)
    block_n = min(cfg.block_n, PERSISTENT_MAX_ROWS // block_m)  # x words: ~32 regs per row
    num_tiles = cdiv(n, block_n)
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    factor = _kernels().FP4_UNIT * float(w.global_scale)
    args = (x, w.packed.view(torch.int64), w.block_scale, out, factor, m, n, kb, x.stride(0),
            num_tiles)
    meta = dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_B=block_b, VEC=cfg.vec,
                PREFETCH=cfg.prefetch, HOIST_X=cfg.hoist_x, NUM_STAGES=cfg.num_stages,
                USE_ASM=x.device.type == "cuda", num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    per_sm = cfg.persistent
    if x.device.type == "cuda":
        # NOTE: more programs than fit on the SMs would run the persistent loop in waves
        key = (x.device, x.dtype, cfg, block_m, block_b, n % 16, kb % 16, x.stride(0) % 16)
        fit = _RESIDENT.get(key)
        if fit is None:
            compiled = kern.nvfp4_gemv_persistent_kernel.warmup(*args, grid=(1,), **meta)
            fit = _RESIDENT[key] = resident_programs(compiled, x.device)
        per_sm = min(per_sm, fit) if fit else per_sm
    grid = (kern.persistent_grid(num_tiles, sms, per_sm),)
    kern.nvfp4_gemv_persistent_kernel[grid](*args, **meta)
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
    """Dense [N, K] (or rows [r0, r1)) of an NVFP4 weight in `dtype`, on the weight's device.

    Raises ValueError / TypeError on a malformed weight or a row range outside [0, N].
    """
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


def _dequant_matmul(x: torch.Tensor, w: NVFP4Weight, m: int, n: int, k: int) -> torch.Tensor:
    dtype = x.dtype
    chunk = max(64, SCRATCH_ELEMS // k // 64 * 64)
    if chunk >= n:
        return x @ nvfp4_dequantize(w, dtype).T
    out = torch.empty(m, n, device=x.device, dtype=dtype)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        out[:, r0:r1] = x @ nvfp4_dequantize(w, dtype, rows=(r0, r1)).T
    return out


def nvfp4_linear(x: torch.Tensor, w: NVFP4Weight, *, path: str | None = None,
                 gemv_config: GemvConfig | None = None) -> torch.Tensor:
    """y = x @ dequantize(w).T, W4A16 on a GPU (or the Triton interpreter).

    Args:
        x: [M, K] (or [..., K]) bf16 / fp16 / fp32 on the weight's device.
        w: NVFP4Weight with packed uint8 [N, K/2], block_scale uint8 [N, K/16], contiguous.
        path: "gemv", "dot" or "dequant"; None picks by M (`choose_path`).
        gemv_config: Triton tiles of the gemv path (the bench sweeps them); None = the CUDA
            kernel where `nvfp4_cuda.takes` the call, else the shape's `default_gemv_config`.
    Returns:
        [M, N] (or [..., N]) in x.dtype. Accumulates in fp32, except the CUDA gemv and the
        "h2" gemv decode (M = 1, or M <= 4 with a persistent config; bf16/fp16 x): x scaled
        by a power of two (per block of 16 inputs in CUDA, per row in "h2") and rounded to
        fp16, the 16 products of each block summed in fp16, then in fp32 (`nvfp4_tiles`).
    Raises:
        ValueError / TypeError on shape, dtype, layout or device mismatch.
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
        y = _gemv(x2, w, m, n, k, gemv_config)
    else:
        y = (_dot if path == "dot" else _dequant_matmul)(x2, w, m, n, k)
    return y.reshape(*lead, n)

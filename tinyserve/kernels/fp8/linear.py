"""FP8 E4M3 W8A16 linear: `fp8_linear(x, w) = x @ (e4m3(w.weight) * w.scale).T`, reading the
weight bytes directly. `choose_path` by the rows M of x:
- `gemv` (M <= GEMV_MAX_M): CUDA cores, int32 weight words decoded once for every row of x,
  one K range per program (split-K when K is long or row blocks are few);
- `dot` (M < DEQUANT_MIN_M): tensor-core `tl.dot`, the weight tile converted in the K loop;
- `dequant` (prefill): a scratch in x's dtype, then cuBLAS.
Decoding needs no fp8 type (sm_80/86): gemv builds bf16 patterns of two codes per 32-bit half
(fp32 values e4m3 * 2^-120, x prescaled by 2^64 so products stay normal); dot / dequant build
fp16 bits e4m3 * 2^-8. `native=True` uses float8e4nv (sm_89+; the default for NATIVE_PATHS).
E4M3 0x7F / 0xFF (NaN) never occur in checkpoints; the bit decode reads them as +-480.
Reference: `nvfp4/ref.py` (`dequantize_fp8`, `fp8_linear_ref`)."""

from __future__ import annotations

import functools

import torch

from tinyserve.core import FP8Weight
from tinyserve.kernels.launch import (
    cdiv,
    dequant_matmul,
    dot_tiles,
    next_pow2,
    num_sms,
    split_k_output,
    split_k_result,
    target_arch,
)
from tinyserve.kernels.nvfp4.linear import row_range

PATHS = ("gemv", "dot", "dequant")
# Thresholds from bench/fp8_linear.py (docs/RESULTS.md, "FP8 W8A16").
GEMV_MAX_M = 4
DEQUANT_MIN_M = 256
NATIVE_PATHS = ("dot",)  # paths that decode with float8e4nv by default on sm_89+

# gemv tiles: block_n rows x block_w int32 words (the whole K range up to GEMV_MAX_BLOCK_W),
# about GEMV_WORDS_PER_THREAD words a thread, halved while there are fewer than
# GEMV_PROGRAMS_PER_SM programs per SM.
GEMV_WORDS_PER_THREAD = 16
GEMV_WARPS = 4
GEMV_PROGRAMS_PER_SM = 2
GEMV_MAX_BLOCK_W = 1024


@functools.cache
def _kernels():
    from tinyserve.kernels.fp8 import triton as fp8_triton

    return fp8_triton


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def gemv_tiles(n: int, k: int, num_sms: int) -> tuple[int, int, int]:
    """(block_n, block_w, split_k) of the gemv path for an [N, K] weight (K % 4 == 0)."""
    kw = k // 4
    block_w = min(next_pow2(kw), GEMV_MAX_BLOCK_W)
    block_n = _pow2_floor(GEMV_WORDS_PER_THREAD * 32 * GEMV_WARPS // block_w)
    target = GEMV_PROGRAMS_PER_SM * num_sms
    while block_n > 1 and cdiv(n, block_n) * cdiv(kw, block_w) < target:
        block_n //= 2
    while cdiv(n, block_n) * cdiv(kw, block_w) < target and block_w > 128:
        block_w //= 2
    return block_n, block_w, cdiv(kw, block_w)


def default_native(path: str, device: torch.device) -> bool:
    """Whether `path` decodes with float8e4nv by default: NATIVE_PATHS where the target
    architecture (TINYSERVE_CUDA_ARCH or the GPU's) is sm_89+."""
    device = torch.device(device)
    return path in NATIVE_PATHS and device.type == "cuda" and target_arch(device) >= 89


def choose_path(m: int, n: int = 0, k: int = 4) -> str:
    """gemv up to GEMV_MAX_M rows (K % 4 == 0), dot below DEQUANT_MIN_M, else dequant."""
    if m <= GEMV_MAX_M and k % 4 == 0:
        return "gemv"
    return "dot" if m < DEQUANT_MIN_M else "dequant"


def describe() -> str:
    return (f"Triton gemv (M <= {GEMV_MAX_M}); Triton tl.dot (M < {DEQUANT_MIN_M}, float8e4nv "
            f"decode on sm_89+); dequantize + cuBLAS")


def _check_weight(w: FP8Weight) -> tuple[int, int, torch.Tensor, bool]:
    """(N, K, fp32 scale on the device, per-row?) of a weight the kernels can read."""
    if w.weight.dtype != torch.uint8 or w.weight.dim() != 2:
        raise TypeError(f"FP8 weight must be uint8 [N, K], got {w.weight.dtype} "
                        f"{list(w.weight.shape)}")
    n, k = w.weight.shape
    if not w.weight.is_contiguous():
        raise ValueError("FP8 weight must be contiguous")
    if w.scale.device != w.weight.device:
        raise ValueError("the FP8 weight and its scale must be on one device")
    if w.scale.numel() not in (1, n):
        raise ValueError(f"FP8 scale must be a scalar or [{n}, 1], got {list(w.scale.shape)}")
    scale = w.scale.reshape(-1)
    if scale.dtype != torch.float32:
        scale = scale.float()
    return n, k, scale.contiguous(), scale.numel() > 1


def _check(x: torch.Tensor, w: FP8Weight) -> tuple[int, int, int, torch.Tensor, bool]:
    """(M, N, K, fp32 scale on the device, per-row?) after checking shapes and devices."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    n, k, scale, per_row = _check_weight(w)
    if x.shape[1] != k:
        raise ValueError(f"x {list(x.shape)} does not match FP8 weight [{n}, {k}]")
    if w.weight.device != x.device:
        raise ValueError("x, the weight and its scale must be on the same device")
    return x.shape[0], n, k, scale, per_row


def _gemv(x: torch.Tensor, w: FP8Weight, scale: torch.Tensor, per_row: bool, m: int, n: int,
          k: int, native: bool) -> torch.Tensor:
    if k % 4:
        raise ValueError(f"the gemv path needs K % 4 == 0, got K={k}")
    block_n, block_w, split = gemv_tiles(n, k, num_sms(x.device))
    is_bf16 = (x.dtype == torch.bfloat16 and x.stride(0) % 4 == 0
               and x.storage_offset() % 4 == 0)
    xv = x.view(torch.int64) if is_bf16 else x  # [M, K/4]: one word = 4 inputs
    out = split_k_output(split, m, n, x)
    grid = (cdiv(n, block_n) * split,)
    kern = _kernels().fp8_gemv_kernel
    kern[grid](xv, w.weight.view(torch.int32), scale, out, m, n, k // 4, xv.stride(0),
               SPLIT_K=split, BLOCK_M=min(4, next_pow2(m)), BLOCK_N=block_n, BLOCK_W=block_w,
               IS_PER_ROW=per_row, IS_X_BF16=is_bf16, USE_NATIVE=native,
               num_warps=GEMV_WARPS)
    return split_k_result(out, split, x.dtype)


def _dot(x: torch.Tensor, w: FP8Weight, scale: torch.Tensor, per_row: bool, m: int, n: int,
         k: int, native: bool) -> torch.Tensor:
    block_m = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    block_k = 128 if block_m <= 64 else 64
    block_n = 128 if block_m == 128 else 64
    if x.dtype == torch.float32:  # exact fp32 dot: small tiles (no tensor cores anyway)
        block_m, block_n, block_k = min(block_m, 32), 32, 32
    num_m = cdiv(m, block_m)
    block_n, split, k_split = dot_tiles(num_m, n, k, block_n, block_k, 2 * num_sms(x.device))
    out = split_k_output(split, m, n, x)
    grid = (num_m * split * cdiv(n, block_n),)
    kern = _kernels().fp8_dot_kernel
    kern[grid](x, w.weight, scale, out, m, n, k, x.stride(0), k, k_split, SPLIT_K=split,
               BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IS_PER_ROW=per_row,
               USE_NATIVE=native, IS_FP32=x.dtype == torch.float32,
               num_warps=8 if block_m == 128 else 4)
    return split_k_result(out, split, x.dtype)


def fp8_dequantize(w: FP8Weight, dtype: torch.dtype = torch.bfloat16, *,
                   rows: tuple[int, int] | None = None, native: bool = False) -> torch.Tensor:
    """Dense [N, K] (or rows [r0, r1)) e4m3(weight) * scale in `dtype` (one rounding from
    fp32), on the weight's device; `native`: float8e4nv (sm_89+). Raises ValueError /
    TypeError on a malformed weight or rows outside [0, N]."""
    n, k, scale, per_row = _check_weight(w)
    r0, r1 = row_range(rows, n)
    if per_row:
        scale = scale[r0:r1]
    out = torch.empty(r1 - r0, k, device=w.weight.device, dtype=dtype)
    if r0 == r1:
        return out
    block_n, block_k = 32, 128
    grid = (cdiv(r1 - r0, block_n), cdiv(k, block_k))
    kern = _kernels().fp8_dequant_kernel
    kern[grid](w.weight[r0:r1], scale, out, r1 - r0, k, k, IS_PER_ROW=per_row,
               USE_NATIVE=native, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def fp8_linear(x: torch.Tensor, w: FP8Weight, *, path: str | None = None,
               native: bool | None = None
               ) -> torch.Tensor:
    """y = x @ (e4m3(w.weight) * w.scale).T on a GPU (or the Triton interpreter).

    Args:
        x: [..., K] bf16 / fp16 / fp32 on the weight's device.
        w: weight uint8 [N, K] (E4M3 bits, contiguous), scale fp32 scalar or [N, 1].
        path: "gemv" (K % 4 == 0), "dot" or "dequant"; None = `choose_path`.
        native: float8e4nv decode (sm_89+); None = `default_native`.
    Returns [..., N] in x.dtype (fp32 accumulation), with no host synchronisation.
    Raises ValueError / TypeError on shape, dtype, layout or device mismatch.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m, n, k, scale, per_row = _check(x2, w)
    path = path or choose_path(m, n, k)
    if path not in PATHS:
        raise ValueError(f"unknown fp8 path {path!r}; choose from {PATHS}")
    if m == 0:
        return x.new_empty(*lead, n)
    if native is None:
        native = default_native(path, x.device)
    if path == "gemv":
        y = _gemv(x2, w, scale, per_row, m, n, k, native)
    elif path == "dot":
        y = _dot(x2, w, scale, per_row, m, n, k, native)
    else:
        y = dequant_matmul(x2, functools.partial(fp8_dequantize, w, native=native), n, k)
    return y.reshape(*lead, n)

"""NVFP4 decode kernels in CUDA (`csrc/nvfp4_decode.cu`): launchers that check their inputs.

- `nvfp4_gemv_cuda`: y = x @ dequantize(w).T for one row of bf16/fp16 x, K in GEMV_KS.
- `moe_decode_cuda`: the fused MoE decode over expert slots (every routed pair plus an
  optional shared expert in two launches: gate_up + silu * up into an fp32 scratch, then down
  per output row summing the pairs in a fixed order; no atomics, the same bits every run),
  for the (H, F) in MOE_SHAPES and at most MAX_PAIRS pairs per token.

Both decode a byte of two E2M1 codes with one byte permute and one shared-memory table read
and sum each block of 16 products in fp16 against x scaled by a power of two per block (the
kernel file's header has the numbers). `gemv_supported` / `moe_supported` say whether a call
can take these kernels; the callers (`nvfp4._gemv`, `fused_moe_decode`) fall back to Triton
otherwise. Built by `cuda_lib` at first use; nothing runs at import.
"""

from __future__ import annotations

import ctypes
import functools
from typing import TYPE_CHECKING

import torch

from tinyserve.core import NVFP4Weight
from tinyserve.kernels import cuda_lib

if TYPE_CHECKING:
    from tinyserve.kernels.fused_moe import ExpertSlots

GEMV_KS = (512, 1024, 2048, 4096)
MOE_SHAPES = ((512, 512), (1024, 512), (2048, 512), (4096, 512), (2048, 1024), (4096, 1024))
MAX_PAIRS = 9  # routed experts per token plus the shared one
VARIANTS = (0, 1, 2)  # tile choices (csrc: rows per warp / blocks per SM / one pass)

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_HALF = (torch.bfloat16, torch.float16)
_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = {
    "tinyserve_nvfp4_gemv": [_P, _P, _P, _P, _F, _I, _I, _I, _I, _P],
    "tinyserve_nvfp4_moe_decode": [_P, _I64, _P, _I, _P, _I, _P, _I, _I64, _I, _I,
                                   *[_P] * 12, _P, _P, _I, _I, _I, _I, _I, _P],
}
_ERRORS = {2: "unsupported shape", 3: "unsupported dtype"}


@functools.cache
def _library(major: int, minor: int) -> ctypes.CDLL:
    return cuda_lib.build("nvfp4", ("nvfp4_decode.cu",), (), major, minor, _SIGNATURES)


def _call(device: torch.device, name: str, *args) -> None:
    lib = _library(*torch.cuda.get_device_capability(device))
    rc = getattr(lib, name)(*args, torch.cuda.current_stream(device).cuda_stream)
    if rc != 0:
        raise RuntimeError(f"{name} failed: {_ERRORS.get(rc, f'CUDA error {rc - 1000}')}")


def _aligned(*tensors: torch.Tensor) -> bool:
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def gemv_supported(x: torch.Tensor, w: NVFP4Weight) -> bool:
    """One contiguous row of bf16/fp16 x on a CUDA device, K in GEMV_KS, weight rows dense and
    16-byte aligned."""
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    return (x.is_cuda and x.dtype in _HALF and x.numel() == k and x.is_contiguous()
            and k in GEMV_KS and w.packed.is_contiguous() and w.block_scale.is_contiguous()
            and tuple(w.block_scale.shape) == (n, k // 16) and _aligned(x, w.packed)
            and w.block_scale.data_ptr() % 8 == 0)


def nvfp4_gemv_cuda(x: torch.Tensor, w: NVFP4Weight, variant: int = 0) -> torch.Tensor:
    """x [1, K] (or [K]) @ dequantize(w).T -> [1, N] in x.dtype; ValueError when
    `gemv_supported` is false."""
    if not gemv_supported(x, w) or variant not in VARIANTS:
        raise ValueError(f"the CUDA NVFP4 gemv does not take x {x.dtype} {tuple(x.shape)} "
                         f"with weight {tuple(w.shape)} (variant {variant})")
    n, k = w.shape
    out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    _call(x.device, "tinyserve_nvfp4_gemv", x.data_ptr(), w.packed.data_ptr(),
          w.block_scale.data_ptr(), out.data_ptr(), float(w.global_scale), n, k,
          _DTYPE_CODE[x.dtype], variant)
    return out


def moe_supported(x: torch.Tensor, topk: int, slots: ExpertSlots,
                  shared: ExpertSlots | None) -> bool:
    """NVFP4 slots (and shared expert) of a shape in MOE_SHAPES, bf16/fp16 x with 16-byte
    aligned rows, at most MAX_PAIRS pairs per token."""
    h, f = slots.hidden_size, slots.intermediate_size
    bufs = [slots] + ([shared] if shared is not None else [])
    return (x.is_cuda and x.dtype in _HALF and (h, f) in MOE_SHAPES and x.stride(-1) == 1
            and x.stride(0) % 8 == 0 and _aligned(x)
            and 1 <= topk and topk + (shared is not None) <= MAX_PAIRS
            and all(b.is_fp4 and b.hidden_size == h and b.intermediate_size == f
                    and all(t.is_contiguous() for t in (b.w13, b.w2, b.w13_scale, b.w2_scale))
                    and _aligned(b.w13, b.w2) for b in bufs))


def moe_decode_cuda(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
                    slots: ExpertSlots, shared: ExpertSlots | None,
                    logit: torch.Tensor | None, variant: int = 0) -> torch.Tensor:
    """sum_j wts[t, j] * expert_{ids[t, j]}(x_t) (+ sigmoid(logit[t]) * shared(x_t)).

    x [N, H], ids (int32/int64) and wts flat [N * topk] contiguous, `shared` one slot,
    logit [N, 1] (any row stride) with `shared`. Returns [N, H] in x.dtype; ValueError when
    `moe_supported` is false."""
    n = x.shape[0]
    if not moe_supported(x, topk, slots, shared) or variant not in VARIANTS:
        raise ValueError(f"the CUDA MoE decode does not take x {x.dtype} {tuple(x.shape)}, "
                         f"top-{topk}, H={slots.hidden_size} F={slots.intermediate_size}")
    if ids.numel() != n * topk or wts.numel() != n * topk or ids.dtype not in (torch.int32,
                                                                             torch.int64):
        raise ValueError(f"ids / wts must hold {n} x {topk} entries (ids int32/int64)")
    if (shared is None) != (logit is None):
        raise ValueError("the shared expert and its logit come together")
    h, f = slots.hidden_size, slots.intermediate_size
    sh = shared if shared is not None else slots
    kp = topk + (shared is not None)
    inter = torch.empty(n * kp, f, dtype=torch.float32, device=x.device)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    logit_ptr, logit_dtype, logit_stride = 0, 0, 0
    if logit is not None:
        logit_ptr, logit_dtype, logit_stride = (logit.data_ptr(), _DTYPE_CODE[logit.dtype],
                                                logit.stride(0))
    bufs = [slots.w13, slots.w13_scale, slots.w13_global, slots.w2, slots.w2_scale,
            slots.w2_global, sh.w13, sh.w13_scale, sh.w13_global, sh.w2, sh.w2_scale,
            sh.w2_global]
    _call(x.device, "tinyserve_nvfp4_moe_decode", x.data_ptr(), x.stride(0), ids.data_ptr(),
          int(ids.dtype == torch.int64), wts.data_ptr(), _DTYPE_CODE[wts.dtype], logit_ptr,
          logit_dtype, logit_stride, topk, int(shared is not None),
          *[b.data_ptr() for b in bufs], inter.data_ptr(), out.data_ptr(), n, h, f,
          _DTYPE_CODE[x.dtype], variant)
    return out

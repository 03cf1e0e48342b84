"""The NVFP4 decode kernels in CUDA: the GEMV of one 16-bit row (`csrc/nvfp4_gemv.cu`) and the
fused MoE decode (`csrc/nvfp4_moe.cu`). Every CTA requests all its weight bytes at entry and
the grid is one wave where the weight allows, so the decode overlaps the DRAM stream; the
"h2" numerics (`csrc/nvfp4_decode.cuh`): fp16 products and 16-term sums, then fp32.
`takes` / `moe_takes` say which calls they serve (the Triton kernels run the rest)."""

from __future__ import annotations

import ctypes

import torch

from tinyserve.core import NVFP4Weight
from tinyserve.kernels import cuda_launch
from tinyserve.kernels.cuda_launch import I64, F, I, ptr
from tinyserve.kernels.launch import cdiv, dependent_launch

GEMV, MOE = "nvfp4_gemv.cu", "nvfp4_moe.cu"
_FORMAT = {torch.bfloat16: "nvfp4::Bf16", torch.float16: "nvfp4::Fp16"}  # csrc/nvfp4_decode.cuh
KS = (1024, 2048, 4096)  # K the kernel is built for
WARPS = 8  # warps per CTA
CTAS_PER_SM = 2  # resident CTAs of the kernel (__launch_bounds__: <= 128 registers)
ROWS_PER_WARP = (1, 2, 4)
MAX_ROW_INPUTS = 8192  # rows_per_warp * K: a lane holds at most 8 pieces of 16 bytes


def allowed_rows_per_warp(k: int) -> tuple[int, ...]:
    return tuple(r for r in ROWS_PER_WARP if r * k <= MAX_ROW_INPUTS)


def default_rows_per_warp(n: int, k: int, sms: int) -> int:
    """The fewest rows per warp whose grid fits one wave, else the most (a weight too large
    for one wave, such as the lm_head, runs fastest so; docs/RESULTS.md)."""
    allowed = allowed_rows_per_warp(k)
    for r in allowed:
        if cdiv(n, WARPS * r) <= CTAS_PER_SM * sms:
            return r
    return allowed[-1]


def _aligned(t: torch.Tensor, to: int) -> bool:
    return t.data_ptr() % to == 0


def _layout_ok(x: torch.Tensor, w: NVFP4Weight) -> bool:
    """Contiguous, 16-byte aligned x and codes, 2-byte aligned scales."""
    return (x.stride(-1) == 1 and _aligned(x, 16) and _aligned(w.packed, 16)
            and _aligned(w.block_scale, 2) and w.packed.is_contiguous()
            and w.block_scale.is_contiguous())


def takes(x: torch.Tensor, w: NVFP4Weight) -> bool:
    """Whether the CUDA GEMV serves x [1, K] against w (CUDA, 16-bit x, K in KS, layout)."""
    k = w.packed.shape[1] * 2
    return (x.is_cuda and x.dtype in _FORMAT and x.dim() == 2 and x.shape[0] == 1
            and k in KS and x.shape[1] == k and _layout_ok(x, w))


def gemv_one_row(x: torch.Tensor, w: NVFP4Weight, *, rows_per_warp: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """y [1, N] = x [1, K] @ dequantize(w).T in x.dtype (bf16 / fp16) on a CUDA device (into
    `out` when given); `rows_per_warp` None = `default_rows_per_warp`. Raises ValueError for
    inputs the kernel does not take."""
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    if x.dtype not in _FORMAT or tuple(x.shape) != (1, k):
        raise ValueError(f"x must be bf16/fp16 [1, {k}], got {x.dtype} {list(x.shape)}")
    if k not in KS:
        raise ValueError(f"the CUDA NVFP4 gemv takes K in {KS}, got {k}")
    if tuple(w.block_scale.shape) != (n, k // 16) or w.packed.dtype != torch.uint8:
        raise ValueError(f"malformed NVFP4 weight: codes {list(w.packed.shape)}, scales "
                         f"{list(w.block_scale.shape)}")
    if not _layout_ok(x, w):
        raise ValueError("the CUDA NVFP4 gemv needs contiguous, 16-byte aligned x and codes "
                         "and 2-byte aligned scales")
    r = rows_per_warp or default_rows_per_warp(n, k, cuda_launch.num_sms(x.device))
    if r not in allowed_rows_per_warp(k):
        raise ValueError(f"rows_per_warp {r} not in {allowed_rows_per_warp(k)} for K={k}")
    if out is None:
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    elif out.dtype != x.dtype or tuple(out.shape) != (1, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} [1, {n}]")
    if n == 0:
        return out
    be = cuda_launch.backend(x.device)
    kern = be.kernel(GEMV, f"nvfp4::nvfp4_gemv_one_row<{_FORMAT[x.dtype]}, {k // 1024}, {r}>")
    kern.launch((cdiv(n, WARPS * r),), WARPS * 32,
                (ptr(w.packed), ptr(w.block_scale), ptr(x), ptr(out), F(w.global_scale), I(n)),
                stream=be.stream())
    return out


# --- the MoE decode (csrc/nvfp4_moe.cu) ---------------------------------------------------

MOE_HS = (1024, 2048)  # H the MoE kernels are built for
MOE_FS = (256, 512)  # F
MOE_MAX_PAIRS = 10  # routed + shared experts per token
MOE_DOWN_ROWS = 2  # output rows per warp of the down kernel
_FLOAT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def moe_takes(x: torch.Tensor, wts: torch.Tensor, topk: int, slots, shared,
              logit: torch.Tensor | None) -> bool:
    """Whether `moe_decode` serves this call: CUDA, 16-bit x, float weights and logit, NVFP4
    slots with H in MOE_HS and F in MOE_FS, <= MOE_MAX_PAIRS pairs, aligned buffers."""
    h, f = slots.hidden_size, slots.intermediate_size
    tensors = [slots.w13, slots.w13_scale, slots.w2, slots.w2_scale]
    if shared is not None:
        tensors += [shared.w13, shared.w13_scale, shared.w2, shared.w2_scale]
    return (x.is_cuda and x.dtype in _FORMAT and wts.dtype in _FLOAT_CODE
            and (logit is None or logit.dtype in _FLOAT_CODE) and slots.is_fp4 and h in MOE_HS
            and f in MOE_FS and topk + (shared is not None) <= MOE_MAX_PAIRS
            and (shared is None or (shared.is_fp4 and shared.intermediate_size == f))
            and x.stride(0) % 8 == 0 and _aligned(x, 16)
            and all(t.is_contiguous() and _aligned(t, 16) for t in tensors))


class _Experts(ctypes.Structure):
    """csrc/nvfp4_moe.cu `Experts`: one layer's NVFP4 slots and its shared expert (slot 0)."""

    _fields_ = [(f, ctypes.c_void_p) for f in ("codes", "scales", "global_", "shared_codes",
                                                "shared_scales", "shared_global")]


def _experts(slots, shared, which: str) -> _Experts:
    """The `which` ("w13" or "w2") codes, scales and global scales of slots and shared."""
    def parts(e) -> list:
        if e is None:
            return [None] * 3
        return [getattr(e, f"{which}{part}").data_ptr() for part in ("", "_scale", "_global")]

    return _Experts(*parts(slots), *parts(shared))


def moe_decode(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int, slots,
               shared, logit: torch.Tensor | None, out_dtype: torch.dtype | None = None
               ) -> torch.Tensor:
    """sum_j wts[t, j] * expert_{ids[t, j]}(x_t) (+ sigmoid(logit[t]) * shared(x_t)) in
    `out_dtype` (x.dtype or float32; None: x.dtype) for calls `moe_takes`: x [N, H], ids / wts
    flat [N * topk], slots checked by `fused_moe`. Two launches (the second a dependent launch
    on sm_90+), no host sync, the same bits every run. Raises ValueError for arguments outside
    these."""
    n, h, f = x.shape[0], slots.hidden_size, slots.intermediate_size
    kp = topk + (shared is not None)
    if n <= 0 or topk <= 0 or kp > MOE_MAX_PAIRS:
        raise ValueError(f"the CUDA MoE decode takes 1+ tokens, 1 <= topk, <= {MOE_MAX_PAIRS} "
                         f"pairs per token, got {n}, {topk}, {kp}")
    if shared is not None and logit is None:
        raise ValueError("the shared expert needs its gate logit")
    if x.dtype not in _FORMAT or h not in MOE_HS or f not in MOE_FS:
        raise ValueError(f"the CUDA MoE decode takes bf16/fp16 x, H in {MOE_HS}, F in "
                         f"{MOE_FS}; got {x.dtype}, {h}, {f}")
    out_dtype = out_dtype or x.dtype
    if out_dtype not in (x.dtype, torch.float32):
        raise ValueError(f"the CUDA MoE decode writes x's dtype or float32, not {out_dtype}")
    inter = torch.empty(n * kp, f, dtype=torch.float32, device=x.device)
    out = torch.empty(n, h, dtype=out_dtype, device=x.device)
    be = cuda_launch.backend(x.device)
    stream, fmt, ids64 = be.stream(), _FORMAT[x.dtype], ctypes.c_bool(ids.dtype == torch.int64)
    gate_up = be.kernel(MOE, f"nvfp4::moe_gate_up<{fmt}, {h // 1024}>")
    gate_up.launch((f // 16, n * kp), WARPS * 32,
                   (ptr(x), I64(x.stride(0)), ptr(ids), ids64, I(topk), I(kp),
                    _experts(slots, shared, "w13"), ptr(inter), I(f)), stream=stream)
    down = be.kernel(MOE, f"nvfp4::moe_down<{fmt}, {f}, {MOE_DOWN_ROWS}>")
    down.launch((cdiv(h, WARPS * MOE_DOWN_ROWS), n), WARPS * 32,
                (ptr(inter), ptr(ids), ids64, ptr(wts), I(_FLOAT_CODE[wts.dtype]), ptr(logit),
                 I(_FLOAT_CODE[logit.dtype] if logit is not None else 0),
                 I64(logit.stride(0) if logit is not None else 0), I(topk), I(kp),
                 _experts(slots, shared, "w2"), ptr(out),
                 ctypes.c_bool(out_dtype == torch.float32), I(h)),
                stream=stream, pdl=dependent_launch(x.device))
    return out

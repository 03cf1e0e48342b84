"""The NVFP4 decode kernels in CUDA: the GEMV of one row of 16-bit activations
(`csrc/nvfp4_gemv.cu`) and the fused MoE decode (`csrc/nvfp4_moe.cu`).

Every CTA requests all of its weight bytes at entry (a warp owns whole rows, held in
registers), then stages its inputs once in fp16 and decodes; where the weight allows, the grid
is one wave, so the DRAM stream starts at once everywhere and the decode overlaps it.
Numerics: the "h2" decode with the inputs scaled per block of 16 (`csrc/nvfp4_decode.cuh`):
fp16 products and 16-term sums, then fp32. `nvfp4.nvfp4_linear` takes the GEMV for M = 1
where `takes` says so, `fused_moe` the MoE decode where `moe_takes` does (both unless
TINYSERVE_NVFP4_CUDA=0); elsewhere the Triton kernels run. The library builds at first use
(`cuda_build`).
"""

from __future__ import annotations

import ctypes

import torch

from tinyserve import envs
from tinyserve.core import NVFP4Weight
from tinyserve.kernels import cuda_build
from tinyserve.kernels.launch import cdiv, dependent_launch, num_sms

_SOURCES = ("nvfp4_gemv.cu", "nvfp4_moe.cu")
_I, _F, _P = ctypes.c_int, ctypes.c_float, ctypes.c_void_p
_I64 = ctypes.c_int64
_SIGNATURES = (
    ("tinyserve_nvfp4_gemv", (_P, _P, _P, _P, _F, _I, _I, _I, _I, _I, _P)),
    ("tinyserve_nvfp4_moe_decode", (_P, _I64, _P, _I, _P, _I, _P, _I, _I64, _I, _I, _I, _I,
                                    _I, _I, *([_P] * 12), _P, _P, _I, _I, _P)),
)
_HEADERS = ("dependent_launch.cuh", "nvfp4_decode.cuh")
_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2}
KS = (1024, 2048, 4096)  # K the kernel is built for
WARPS = 8  # warps per CTA
CTAS_PER_SM = 2  # resident CTAs of the kernel (__launch_bounds__: <= 128 registers)
ROWS_PER_WARP = (1, 2, 4)
MAX_ROW_INPUTS = 8192  # rows_per_warp * K: a lane holds at most 8 pieces of 16 bytes


def _library(device: torch.device) -> ctypes.CDLL:
    major, minor = torch.cuda.get_device_capability(device)
    return cuda_build.library("tinyserve_nvfp4", _SOURCES, _HEADERS, _SIGNATURES, major,
                              minor)


def allowed_rows_per_warp(k: int) -> tuple[int, ...]:
    return tuple(r for r in ROWS_PER_WARP if r * k <= MAX_ROW_INPUTS)


def default_rows_per_warp(n: int, k: int, sms: int) -> int:
    """The fewest rows per warp whose grid fits the GPU in one wave (CTAS_PER_SM per SM), else
    the most (fewer, longer CTAs). On the H200 the lm_head took 79.7 / 81.9 / 96.7 us at 4 /
    2 / 1 rows per warp in one run (`results/nvfp4_cuda_gemv_run1.json`), 86.9 / 84.9 / 98.2
    in another (`nvfp4_cuda_gemv.json`); Triton's persistent tiles 90.5 / 90.1."""
    allowed = allowed_rows_per_warp(k)
    for r in allowed:
        if cdiv(n, WARPS * r) <= CTAS_PER_SM * sms:
            return r
    return allowed[-1]


def _aligned(t: torch.Tensor, to: int) -> bool:
    return t.data_ptr() % to == 0


def takes(x: torch.Tensor, w: NVFP4Weight) -> bool:
    """Whether the CUDA kernel serves x [1, K] against w (default path): a CUDA device, bf16 /
    fp16 x, K in KS, the aligned layouts the kernel loads, and TINYSERVE_NVFP4_CUDA on."""
    k = w.packed.shape[1] * 2
    return (x.is_cuda and x.dtype in _DTYPE_CODE and x.dim() == 2 and x.shape[0] == 1
            and k in KS and x.shape[1] == k and x.stride(-1) == 1 and _aligned(x, 16)
            and _aligned(w.packed, 16) and _aligned(w.block_scale, 2)
            and w.packed.is_contiguous() and w.block_scale.is_contiguous()
            and envs.NVFP4_CUDA.get())


def gemv_one_row(x: torch.Tensor, w: NVFP4Weight, *, rows_per_warp: int | None = None,
                 out: torch.Tensor | None = None, dependent: bool = False) -> torch.Tensor:
    """y [1, N] = x [1, K] @ dequantize(w).T in x.dtype (bf16 / fp16) on a CUDA device.

    `rows_per_warp` (1, 2, 4; None = `default_rows_per_warp`) sets the tiles; `out` [1, N]
    of x.dtype is written when given. `dependent`: a programmatic dependent launch (sm_90 and
    newer, else ignored: its weight loads start while the kernel before drains; x is read
    after that kernel ends).
    Raises ValueError for inputs the kernel does not take.
    """
    n, k = w.packed.shape[0], w.packed.shape[1] * 2
    if x.dtype not in _DTYPE_CODE or not x.is_cuda or tuple(x.shape) != (1, k):
        raise ValueError(f"x must be bf16/fp16 [1, {k}] on a CUDA device, got {x.dtype} "
                         f"{list(x.shape)} on {x.device}")
    if k not in KS:
        raise ValueError(f"the CUDA NVFP4 gemv takes K in {KS}, got {k}")
    if tuple(w.block_scale.shape) != (n, k // 16) or w.packed.dtype != torch.uint8:
        raise ValueError(f"malformed NVFP4 weight: codes {list(w.packed.shape)}, scales "
                         f"{list(w.block_scale.shape)}")
    if not (x.stride(-1) == 1 and _aligned(x, 16) and _aligned(w.packed, 16)
            and _aligned(w.block_scale, 2) and w.packed.is_contiguous()
            and w.block_scale.is_contiguous()):
        raise ValueError("the CUDA NVFP4 gemv needs contiguous, 16-byte aligned x and codes "
                         "and 2-byte aligned scales")
    r = rows_per_warp or default_rows_per_warp(n, k, num_sms(x.device))
    if r not in allowed_rows_per_warp(k):
        raise ValueError(f"rows_per_warp {r} not in {allowed_rows_per_warp(k)} for K={k}")
    if out is None:
        out = torch.empty(1, n, device=x.device, dtype=x.dtype)
    elif out.dtype != x.dtype or tuple(out.shape) != (1, n) or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} [1, {n}]")
    if n == 0:
        return out
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _check("tinyserve_nvfp4_gemv", _library(x.device).tinyserve_nvfp4_gemv(
        w.packed.data_ptr(), w.block_scale.data_ptr(), x.data_ptr(), out.data_ptr(),
        float(w.global_scale), n, k, _DTYPE_CODE[x.dtype], r,
        int(dependent and dependent_launch(x.device)), stream))
    return out


def _check(entry: str, rc: int) -> None:
    """RuntimeError unless the library's `entry` returned 0 (2: bad arguments)."""
    if rc != 0:
        raise RuntimeError(f"{entry} failed: {'bad arguments' if rc == 2 else f'CUDA error {rc}'}")


# --- the MoE decode (csrc/nvfp4_moe.cu) ---------------------------------------------------

MOE_HS = (1024, 2048)  # H the MoE kernels are built for
MOE_FS = (256, 512)  # F
MOE_MAX_PAIRS = 10  # routed + shared experts per token
# Launch settings of the down kernel, from the H200 (results/nvfp4_moe_cuda_launch.json, 1
# token, 8 routed experts, graph replays): 2 output rows per warp, a dependent launch of
# gate_up: 9.87 us; 1 row 11.67; ordinary launches 11.00 / 11.45; Triton's table tiles 12.58
MOE_DOWN_ROWS = 2
MOE_DEPENDENT = True
_FLOAT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def moe_takes(x: torch.Tensor, wts: torch.Tensor, topk: int, slots, shared,
              logit: torch.Tensor | None) -> bool:
    """Whether `moe_decode` serves this call of the fused MoE decode: a CUDA device, bf16 /
    fp16 x, fp32 / bf16 / fp16 routing weights and gate logit, NVFP4 slots (and shared
    expert) with H in MOE_HS and F in MOE_FS, at most MOE_MAX_PAIRS pairs per token, aligned
    slot buffers, TINYSERVE_NVFP4_CUDA on."""
    h, f = slots.hidden_size, slots.intermediate_size
    tensors = [slots.w13, slots.w13_scale, slots.w2, slots.w2_scale]
    if shared is not None:
        tensors += [shared.w13, shared.w13_scale, shared.w2, shared.w2_scale]
    return (x.is_cuda and x.dtype in _DTYPE_CODE and wts.dtype in _FLOAT_CODE
            and (logit is None or logit.dtype in _FLOAT_CODE) and slots.is_fp4 and h in MOE_HS
            and f in MOE_FS and topk + (shared is not None) <= MOE_MAX_PAIRS
            and (shared is None or (shared.is_fp4 and shared.intermediate_size == f))
            and x.stride(0) % 8 == 0 and _aligned(x, 16)
            and all(t.is_contiguous() and _aligned(t, 16) for t in tensors)
            and envs.NVFP4_CUDA.get())


def moe_decode(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int, slots,
               shared, logit: torch.Tensor | None, *, dependent: bool = MOE_DEPENDENT,
               down_rows: int = MOE_DOWN_ROWS) -> torch.Tensor:
    """The fused MoE decode (`fused_moe_decode.moe_fused_decode`'s contract) in CUDA: x [N, H]
    (rows 16-byte aligned), ids / wts flat [N * topk], NVFP4 `slots` and `shared` (slot 0)
    as checked by `fused_moe` and `moe_takes`, logit [N, 1] with `shared`. Returns [N, H] in
    x.dtype; two launches (`dependent`: the second a dependent launch of the first, sm_90+;
    `down_rows`: its output rows per warp, 1 or 2), no host synchronisation, the same bits
    every run."""
    n, h, f = x.shape[0], slots.hidden_size, slots.intermediate_size
    kp = topk + (shared is not None)
    inter = torch.empty(n * kp, f, dtype=torch.float32, device=x.device)
    out = torch.empty(n, h, dtype=x.dtype, device=x.device)
    stream = torch.cuda.current_stream(x.device).cuda_stream
    _check("tinyserve_nvfp4_moe_decode", _library(x.device).tinyserve_nvfp4_moe_decode(
        *moe_arguments(x, ids, wts, topk, slots, shared, logit, inter, out), down_rows,
        int(dependent and dependent_launch(x.device)), stream))
    return out


def moe_arguments(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int, slots,
                  shared, logit: torch.Tensor | None, inter: torch.Tensor,
                  out: torch.Tensor) -> tuple:
    """The arguments of tinyserve_nvfp4_moe_decode up to `out` (the launch settings and the
    stream follow) for `moe_decode`'s inputs, the fp32 scratch `inter` [N * KP, F] and `out`
    [N, H]."""
    def weights(e, which: str) -> list:  # codes, scales, global scales of w13 / w2
        if e is None:
            return [None] * 3
        return [getattr(e, f"{which}{part}").data_ptr() for part in ("", "_scale", "_global")]

    has_logit = logit is not None
    return (x.data_ptr(), x.stride(0), ids.data_ptr(), int(ids.dtype == torch.int64),
            wts.data_ptr(), _FLOAT_CODE[wts.dtype], logit.data_ptr() if has_logit else None,
            _FLOAT_CODE[logit.dtype] if has_logit else 0,
            logit.stride(0) if has_logit else 0, x.shape[0], topk,
            topk + (shared is not None), slots.hidden_size, slots.intermediate_size,
            _DTYPE_CODE[x.dtype], *weights(slots, "w13"), *weights(shared, "w13"),
            *weights(slots, "w2"), *weights(shared, "w2"), inter.data_ptr(), out.data_ptr())

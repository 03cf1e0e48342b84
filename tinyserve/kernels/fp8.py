"""FP8 E4M3 W8A16 linear in Triton: `fp8_linear(x, w) = x @ (e4m3(w.weight) * w.scale).T`.

The weight bytes are read directly (no per-call conversion of the weight). Three paths, picked
by the number of rows M of x (`choose_path`):

- `gemv` (M <= GEMV_MAX_M, decode): CUDA cores; the weight read as int32 words (4 codes,
  16-byte loads), one K range per program held in registers (split-K only when K exceeds
  `max_block_w` words or there are too few row blocks), decoded once and used for every row
  of x. bf16 x is read as int64 words (4 inputs) that line up with the weight words.
- `dot` (up to DEQUANT_MIN_M): tensor-core `tl.dot` with the weight tile converted to x's
  dtype in the K loop (exact: e4m3 fits in bf16 and fp16); 16-row tiles for small M.
- `dequant` (prefill): e4m3 * scale to a scratch in x's dtype (row chunks of at most
  SCRATCH_ELEMS), then torch.matmul (cuBLAS).

Why gemv stops at 4 rows (static sm_90 SASS, Triton 3.9): the gemv costs ~7.4 instructions per
weight at M = 1 and ~19 at M = 4 (one FMA per row plus per-row x decode and reduction), the
16-row `dot` ~6 whatever M; bench/fp8_linear.py measures both at M = 1, 4, 16.

Decoding without an fp8 type (runs on sm_80/86), from the byte b = s eeee mmm:
- gemv: two codes per 32-bit half at once; `((w << 8) & 0x80008000) | ((w << 4) & 0x07F007F0)`
  holds the bf16 patterns of bytes 0 and 2 (`(w & 0x80008000) | ((w >> 4) & 0x07F007F0)`: 1
  and 3); `bits << 16` and `bits & 0xFFFF0000` are the fp32 values e4m3 * 2^-120 (E4M3
  subnormals are fp32 subnormals, exact: no .ftz on fma/mul). x is prescaled by 2^64 so the
  products stay normal; the 2^56 goes back with the scale.
- dot / dequant: fp16 bits `((b & 0x80) << 8) | ((b & 0x7F) << 7)` = e4m3 * 2^-8 (subnormals
  land on fp16 subnormals), as in `nvfp4_triton._e4m3`.
`native=True` uses Triton's float8e4nv conversion instead (sm_89+; the bench measures both).

NaN: 0x7F / 0xFF never occur in checkpoints (quantizers saturate at +-448). The bit decode
reads them as +-480 (the exponent-15 pattern), the native decode as NaN, the reference as NaN;
no path checks for them.

This module imports triton at the top: `model.linear` imports it lazily, on CUDA only. The
reference is `kernels/nvfp4_ref.py` (`dequantize_fp8`, `fp8_linear_ref`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tinyserve.core import FP8Weight

PATHS = ("gemv", "dot", "dequant")
GEMV_MAX_M = 4  # largest M on the gemv path by default (5..16: dot with 16-row tiles)
DEQUANT_MIN_M = 256  # smallest M on the dequant path by default
SCRATCH_ELEMS = 1 << 24  # dequant scratch cap (32 MiB in bf16)

X_PRESCALE_C = tl.constexpr(float(2**64))  # gemv: x * 2^64 keeps x * e4m3 * 2^-120 normal
GEMV_UNIT_C = tl.constexpr(float(2**56))  # 2^(120 - 64)
HALF_UNIT_C = tl.constexpr(float(2**8))  # dot / dequant: fp16 bits are e4m3 * 2^-8


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the gemv path. A program owns `block_n` rows x `block_w` int32 words (4 inputs
    each) of the weight: block_w = the whole K range (a power of two, at most `max_block_w`;
    larger K splits), block_n so that each of the `num_warps` * 32 threads holds about
    `words_per_thread` words, halved (then K split) while there are fewer than
    `programs_per_sm` programs per SM."""

    words_per_thread: int = 16
    num_warps: int = 4
    programs_per_sm: int = 2
    max_block_w: int = 1024


DEFAULT_GEMV = GemvConfig()


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def _next_pow2(v: int) -> int:
    return 1 << (max(1, v) - 1).bit_length()


def gemv_tiles(n: int, k: int, num_sms: int, cfg: GemvConfig = DEFAULT_GEMV
               ) -> tuple[int, int, int]:
    """(block_n, block_w, split_k) of the gemv path for an [N, K] weight (K % 4 == 0)."""
    kw = k // 4
    block_w = min(_next_pow2(kw), cfg.max_block_w)
    block_n = _pow2_floor(cfg.words_per_thread * 32 * cfg.num_warps // block_w)
    target = cfg.programs_per_sm * num_sms
    while block_n > 1 and triton.cdiv(n, block_n) * triton.cdiv(kw, block_w) < target:
        block_n //= 2
    while triton.cdiv(n, block_n) * triton.cdiv(kw, block_w) < target and block_w > 128:
        block_w //= 2
    return block_n, block_w, triton.cdiv(kw, block_w)


def choose_path(m: int, n: int = 0, k: int = 4) -> str:
    """The default path for M rows of x against an [N, K] weight: gemv up to GEMV_MAX_M rows
    (K % 4 == 0 only), dot below DEQUANT_MIN_M, dequant from there."""
    if m <= GEMV_MAX_M and k % 4 == 0:
        return "gemv"
    return "dot" if m < DEQUANT_MIN_M else "dequant"


# --------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _decode_words(wt, USE_NATIVE: tl.constexpr):
    # wt: uint32 [BN, BW], byte i of word j = input 4j + i -> four fp32 [BN, BW]:
    # e4m3 * 2^-120 (bit decode) or e4m3 (native)
    if USE_NATIVE:
        w0 = (wt & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w1 = ((wt >> 8) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w2 = ((wt >> 16) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w3 = (wt >> 24).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        p02 = ((wt << 8) & 0x80008000) | ((wt << 4) & 0x07F007F0)
        p13 = (wt & 0x80008000) | ((wt >> 4) & 0x07F007F0)
        w0 = (p02 << 16).to(tl.float32, bitcast=True)
        w2 = (p02 & 0xFFFF0000).to(tl.float32, bitcast=True)
        w1 = (p13 << 16).to(tl.float32, bitcast=True)
        w3 = (p13 & 0xFFFF0000).to(tl.float32, bitcast=True)
    return w0, w1, w2, w3


@triton.jit
def _x_quad(x_row, words, ok, IS_X_BF16: tl.constexpr, USE_NATIVE: tl.constexpr):
    # inputs 4j + 0..3 of one row of x for the words j: four fp32 [BW] (times 2^64 for the
    # bit decode).
    # IS_X_BF16: x_row is an int64 view (one word = 4 bf16 inputs, 16-byte loads)
    if IS_X_BF16:
        q = tl.load(x_row + words, mask=ok, other=0)
        lo = q.to(tl.uint32)
        hi = (q >> 32).to(tl.uint32)
        x0 = (lo << 16).to(tl.float32, bitcast=True)
        x1 = (lo & 0xFFFF0000).to(tl.float32, bitcast=True)
        x2 = (hi << 16).to(tl.float32, bitcast=True)
        x3 = (hi & 0xFFFF0000).to(tl.float32, bitcast=True)
    else:
        xk = x_row + words * 4
        x0 = tl.load(xk, mask=ok, other=0.0).to(tl.float32)
        x1 = tl.load(xk + 1, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(xk + 2, mask=ok, other=0.0).to(tl.float32)
        x3 = tl.load(xk + 3, mask=ok, other=0.0).to(tl.float32)
    if not USE_NATIVE:
        x0 = x0 * X_PRESCALE_C
        x1 = x1 * X_PRESCALE_C
        x2 = x2 * X_PRESCALE_C
        x3 = x3 * X_PRESCALE_C
    return x0, x1, x2, x3


@triton.jit
def _row_dot(x_row, words, ok, w0, w1, w2, w3, IS_X_BF16: tl.constexpr,
             USE_NATIVE: tl.constexpr):
    # sum_j x[4j + i] * w_i[:, j] over the tile: fp32 [BN]
    x0, x1, x2, x3 = _x_quad(x_row, words, ok, IS_X_BF16, USE_NATIVE)
    p = w0 * x0[None, :]
    p += w1 * x1[None, :]
    p += w2 * x2[None, :]
    p += w3 * x3[None, :]
    return tl.sum(p, axis=1)


@triton.jit
def _scale(s_ptr, rows, row_mask, IS_PER_ROW: tl.constexpr):
    # fp32 [BN]: the per-row scales, or the per-tensor scalar broadcast (no host sync)
    if IS_PER_ROW:
        return tl.load(s_ptr + rows, mask=row_mask, other=0.0).to(tl.float32)
    return tl.load(s_ptr + rows * 0).to(tl.float32)


@triton.jit
def fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, KW, stride_xm,
                    SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_W: tl.constexpr, IS_PER_ROW: tl.constexpr, IS_X_BF16: tl.constexpr,
                    USE_NATIVE: tl.constexpr):
    # out[pid_k, m, n] = scale[n] * sum_{words of split pid_k} x[m, 4j..4j+3] . W[n, 4j..4j+3]
    # w_ptr: int32 view of the codes [N, KW]; x_ptr: int64 view [M, KW] when IS_X_BF16
    # (stride_xm in its elements). The tile is decoded once, then BLOCK_M rows of x at a time.
    pid = tl.program_id(0)
    pid_k = pid % SPLIT_K
    pid_n = pid // SPLIT_K
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    words = pid_k * BLOCK_W + tl.arange(0, BLOCK_W)
    word_ok = words < KW
    wt = tl.load(w_ptr + rows.to(tl.int64)[:, None] * KW + words[None, :],
                 mask=row_mask[:, None] & word_ok[None, :], other=0)  # [BN, BW] int32
    w0, w1, w2, w3 = _decode_words(wt.to(tl.uint32, bitcast=True), USE_NATIVE)
    scale = _scale(s_ptr, rows, row_mask, IS_PER_ROW)
    if not USE_NATIVE:
        scale = scale * GEMV_UNIT_C
    out = out_ptr + pid_k.to(tl.int64) * M * N + rows
    ty = out_ptr.dtype.element_ty
    if BLOCK_M == 1:  # M == 1: straight-line, the x loads can issue beside the weight loads
        y = _row_dot(x_ptr, words, word_ok, w0, w1, w2, w3, IS_X_BF16, USE_NATIVE)
        tl.store(out, (y * scale).to(ty), mask=row_mask)
    else:
        for m0 in range(0, M, BLOCK_M):
            for r in tl.static_range(BLOCK_M):
                m = m0 + r
                # NOTE: vector masks only (the interpreter rejects scalar ones)
                ok = word_ok & (words * 0 + m < M)
                y = _row_dot(x_ptr + m.to(tl.int64) * stride_xm, words, ok, w0, w1, w2, w3,
                             IS_X_BF16, USE_NATIVE)
                tl.store(out + m * N, (y * scale).to(ty), mask=row_mask & (rows * 0 + m < M))


@triton.jit
def _e4m3_tile(raw, USE_NATIVE: tl.constexpr):
    # uint8 codes -> fp16: e4m3 * 2^-8 (bit decode, exact) or e4m3 (native)
    if USE_NATIVE:
        return raw.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    b = raw.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True)


@triton.jit
def fp8_dot_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K, stride_xm, stride_w, K_SPLIT,
                   SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, IS_PER_ROW: tl.constexpr, USE_NATIVE: tl.constexpr,
                   IS_FP32: tl.constexpr):
    # out[pid_k, m, n] = scale[n] * sum_{k in split} x[m, k] * e4m3(W[n, k]), tensor cores
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # NOTE: M tiles vary fastest so one weight tile is reused from L2
    rest = pid // num_m
    pid_k = rest % SPLIT_K
    pid_n = rest // SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    row_mask = rows < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    w_rows = w_ptr + rows.to(tl.int64) * stride_w
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < k_hi
        xv = tl.load(x_rows[:, None] + kk[None, :], mask=m_mask[:, None] & k_ok[None, :],
                     other=0.0)  # [BM, BK]
        raw = tl.load(w_rows[:, None] + kk[None, :], mask=row_mask[:, None] & k_ok[None, :],
                      other=0)  # [BN, BK] uint8
        wv = _e4m3_tile(raw, USE_NATIVE).to(xv.dtype)
        if IS_FP32:  # fp32 x (tests, CPU-sized checks): exact products, not tf32
            acc += tl.dot(xv, tl.trans(wv), input_precision="ieee")
        else:
            acc += tl.dot(xv, tl.trans(wv))
    scale = _scale(s_ptr, rows, row_mask, IS_PER_ROW)
    if not USE_NATIVE:
        scale = scale * HALF_UNIT_C
    out = out_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, (acc * scale[None, :]).to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & row_mask[None, :])


@triton.jit
def fp8_dequant_kernel(w_ptr, s_ptr, out_ptr, N, K, stride_w, IS_PER_ROW: tl.constexpr,
                       USE_NATIVE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[n, k] = e4m3(W[n, k]) * scale[n] in out's dtype, out [N, K] row-major
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    row_mask = rows < N
    mask = row_mask[:, None] & (kk < K)[None, :]
    raw = tl.load(w_ptr + rows.to(tl.int64)[:, None] * stride_w + kk[None, :], mask=mask,
                  other=0)
    scale = _scale(s_ptr, rows, row_mask, IS_PER_ROW)
    if not USE_NATIVE:
        scale = scale * HALF_UNIT_C
    w = _e4m3_tile(raw, USE_NATIVE).to(tl.float32) * scale[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers


def _check(x: torch.Tensor, w: FP8Weight) -> tuple[int, int, int, torch.Tensor, bool]:
    """(M, N, K, fp32 scale on the device, per-row?) after checking shapes and devices."""
    if x.dim() != 2:
        raise ValueError(f"x must be [M, K], got {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if w.weight.dtype != torch.uint8 or w.weight.dim() != 2:
        raise TypeError(f"FP8 weight must be uint8 [N, K], got {w.weight.dtype} "
                        f"{list(w.weight.shape)}")
    n, k = w.weight.shape
    if x.shape[1] != k:
        raise ValueError(f"x {list(x.shape)} does not match FP8 weight [{n}, {k}]")
    if not w.weight.is_contiguous():
        raise ValueError("FP8 weight must be contiguous")
    if w.weight.device != x.device or w.scale.device != x.device:
        raise ValueError("x, the weight and its scale must be on the same device")
    if w.scale.numel() not in (1, n):
        raise ValueError(f"FP8 scale must be a scalar or [{n}, 1], got {list(w.scale.shape)}")
    scale = w.scale.reshape(-1)
    if scale.dtype != torch.float32:
        scale = scale.float()
    return x.shape[0], n, k, scale.contiguous(), scale.numel() > 1


def _gemv(x: torch.Tensor, w: FP8Weight, scale: torch.Tensor, per_row: bool, m: int, n: int,
          k: int, cfg: GemvConfig, native: bool) -> torch.Tensor:
    if k % 4:
        raise ValueError(f"the gemv path needs K % 4 == 0, got K={k}")
    block_n, block_w, split = gemv_tiles(n, k, _num_sms(x.device), cfg)
    is_bf16 = (x.dtype == torch.bfloat16 and x.stride(0) % 4 == 0
               and x.storage_offset() % 4 == 0)
    xv = x.view(torch.int64) if is_bf16 else x  # [M, K/4]: one word = 4 inputs
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, block_n) * split,)
    fp8_gemv_kernel[grid](xv, w.weight.view(torch.int32), scale, out, m, n, k // 4,
                          xv.stride(0), SPLIT_K=split, BLOCK_M=min(4, _next_pow2(m)),
                          BLOCK_N=block_n, BLOCK_W=block_w, IS_PER_ROW=per_row,
                          IS_X_BF16=is_bf16, USE_NATIVE=native, num_warps=cfg.num_warps)
    return out if split == 1 else out.sum(0).to(x.dtype)


def _dot(x: torch.Tensor, w: FP8Weight, scale: torch.Tensor, per_row: bool, m: int, n: int,
         k: int, native: bool) -> torch.Tensor:
    block_m = 16 if m <= 16 else (32 if m <= 32 else (64 if m <= 64 else 128))
    block_k = 128 if block_m <= 64 else 64
    block_n = 128 if block_m == 128 else 64
    if x.dtype == torch.float32:  # exact fp32 dot: small tiles (no tensor cores anyway)
        block_m, block_n, block_k = min(block_m, 32), 32, 32
    target = 2 * _num_sms(x.device)
    num_m = triton.cdiv(m, block_m)
    while block_n > 16 and num_m * triton.cdiv(n, block_n) < target:
        block_n //= 2
    split = 1  # split-K (fp32 workspace + sum) while there are too few tiles
    while num_m * triton.cdiv(n, block_n) * split < target and k // (split * 2) >= block_k:
        split *= 2
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    split = triton.cdiv(k, k_split)
    if split == 1:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    else:
        out = torch.empty(split, m, n, device=x.device, dtype=torch.float32)
    grid = (num_m * split * triton.cdiv(n, block_n),)
    fp8_dot_kernel[grid](x, w.weight, scale, out, m, n, k, x.stride(0), k, k_split,
                         SPLIT_K=split, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                         IS_PER_ROW=per_row, USE_NATIVE=native,
                         IS_FP32=x.dtype == torch.float32, num_warps=8 if block_m == 128 else 4)
    return out if split == 1 else out.sum(0).to(x.dtype)


def fp8_dequantize(w: FP8Weight, dtype: torch.dtype = torch.bfloat16, *,
                   rows: tuple[int, int] | None = None, native: bool = False) -> torch.Tensor:
    """Dense [N, K] (or rows [r0, r1)) e4m3(weight) * scale in `dtype`, on the weight's device.

    Args:
        w: FP8Weight, uint8 [N, K] contiguous, scale fp32 scalar or [N, 1] on the same device.
        dtype: output dtype (the product is rounded once, from fp32).
        rows: a row range; None = all rows.
        native: decode with Triton's float8e4nv type (sm_89+) instead of bit arithmetic.
    """
    n, k = w.weight.shape
    r0, r1 = rows if rows is not None else (0, n)
    scale = w.scale.reshape(-1).float().contiguous()
    per_row = scale.numel() > 1
    if per_row:
        scale = scale[r0:r1]
    out = torch.empty(r1 - r0, k, device=w.weight.device, dtype=dtype)
    block_n, block_k = 32, 128
    grid = (triton.cdiv(r1 - r0, block_n), triton.cdiv(k, block_k))
    fp8_dequant_kernel[grid](w.weight[r0:r1], scale, out, r1 - r0, k, k, IS_PER_ROW=per_row,
                             USE_NATIVE=native, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


def _dequant_matmul(x: torch.Tensor, w: FP8Weight, m: int, n: int, k: int,
                    native: bool) -> torch.Tensor:
    chunk = max(64, SCRATCH_ELEMS // max(k, 1) // 64 * 64)
    if chunk >= n:
        return x @ fp8_dequantize(w, x.dtype, native=native).T
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        out[:, r0:r1] = x @ fp8_dequantize(w, x.dtype, rows=(r0, r1), native=native).T
    return out


def fp8_linear(x: torch.Tensor, w: FP8Weight, *, path: str | None = None,
               gemv_config: GemvConfig | None = None, native: bool = False) -> torch.Tensor:
    """y = x @ (e4m3(w.weight) * w.scale).T, W8A16 on a GPU (or the Triton interpreter).

    Args:
        x: [M, K] (or [..., K]) bf16 / fp16 / fp32 on the weight's device.
        w: FP8Weight: weight uint8 [N, K] (E4M3 bits, contiguous), scale fp32 scalar or [N, 1].
        path: "gemv" (needs K % 4 == 0), "dot" or "dequant"; None picks by M (`choose_path`).
        gemv_config: tiles of the gemv path (the bench sweeps them); None = DEFAULT_GEMV.
        native: decode with Triton's float8e4nv type (sm_89+) instead of bit arithmetic.
    Returns:
        [M, N] (or [..., N]) in x.dtype; fp32 accumulation, one rounding to x.dtype (the
        dequant path also rounds e4m3 * scale to x.dtype). No host synchronisation: the scale
        is read on the device, so the call can be captured in a CUDA graph.
    Raises:
        ValueError / TypeError on shape, dtype, layout or device mismatch.
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
    if path == "gemv":
        y = _gemv(x2, w, scale, per_row, m, n, k, gemv_config or DEFAULT_GEMV, native)
    elif path == "dot":
        y = _dot(x2, w, scale, per_row, m, n, k, native)
    else:
        y = _dequant_matmul(x2, w, m, n, k, native)
    return y.reshape(*lead, n)

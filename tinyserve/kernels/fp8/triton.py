"""Triton kernels behind `linear.py` (FP8 E4M3 W8A16), which describes the decoding."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.nvfp4.splitk_triton import splitk_tile

# gemv (bit decode): x * 2^64 keeps x * e4m3 * 2^-120 normal. NOTE: exact products for
# 2^-61 <= |x| < 2^64; smaller |x| lose bits, |x| >= 2^64 overflow to inf (native: any x)
X_PRESCALE_C = tl.constexpr(float(2**64))
GEMV_UNIT_C = tl.constexpr(float(2**56))  # 2^(120 - 64)
HALF_UNIT_C = tl.constexpr(float(2**8))  # dot / dequant: fp16 bits are e4m3 * 2^-8


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
    pid_k, offs_m, rows, m_mask, row_mask = splitk_tile(M, N, SPLIT_K, BLOCK_M, BLOCK_N)
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

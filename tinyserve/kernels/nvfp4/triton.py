"""NVFP4 Triton GEMV (W4A16) behind `linear.py` for the calls the CUDA GEMV does not take
(M > 1, fp32 x, other K). Decoding without lookup tables:
- E2M1 code c -> fp16 bits ((c & 7) << 9) | ((c & 8) << 12) = E2M1[c] * 2^-14 exactly;
- E4M3 bits b -> fp16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) = e4m3(b) * 2^-8 exactly
  (no fp8 type, runs below sm_89).
So E2M1 * e4m3 = product * 2^22 (`FP4_UNIT`), folded into the global factor. The GEMV decodes
as bf16 patterns with fp32 FMAs (`_nibble_pair`)."""

from __future__ import annotations

import triton
import triton.language as tl

FP4_UNIT = float(2**22)
FP4_UNIT_C = tl.constexpr(FP4_UNIT)
# gemv: x * 2^64 keeps x * E2M1 * 2^-126 normal. NOTE: exact products for 2^-63 <= |x| < 2^64;
# smaller |x| lose bits (fp32 subnormals), |x| >= 2^64 overflow to inf (no max pass)
X_PRESCALE_C = tl.constexpr(float(2**64))
GEMV_RESCALE_C = tl.constexpr(float(2**48))  # 2^(126 + 8 - 64 - 22)


@triton.jit
def _e2m1(codes):
    # codes: int32 in 0..15 -> E2M1[code] * 2^-14, fp32
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(raw):
    # raw: uint8 E4M3 bits -> e4m3 * 2^-8, fp32
    b = raw.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_pair(w, I: tl.constexpr):
    """Nibbles I and I + 4 of uint32 words `w` -> two fp32 tensors E2M1 * 2^-126: both bf16
    patterns built at once (one per 16-bit half), each made fp32 by a shift or a mask. Code 1
    is an fp32 subnormal, exact (no .ftz); callers prescale x by X_PRESCALE."""
    SM: tl.constexpr = 6 - 4 * I
    SS: tl.constexpr = 12 - 4 * I
    if SM >= 0:
        mag = w << SM
    else:
        mag = w >> (-SM)
    if SS >= 0:
        sign = w << SS
    else:
        sign = w >> (-SS)
    bits = (mag & 0x01C001C0) | (sign & 0x80008000)
    a = (bits << 16).to(tl.float32, bitcast=True)
    b = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return a, b


@triton.jit
def _x_quad(xk, I: tl.constexpr, m):
    # X_PRESCALE * x at inputs 16b + I, +4, +8, +12 of the blocks at `xk` (mask m), fp32 [BB]
    x0 = tl.load(xk + I, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x1 = tl.load(xk + I + 4, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x2 = tl.load(xk + I + 8, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x3 = tl.load(xk + I + 12, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    return x0, x1, x2, x3


@triton.jit
def _fma4(p, w0, w4, w8, w12, x0, x4, x8, x12):
    p += w0 * x0[None, :]
    p += w4 * x4[None, :]
    p += w8 * x8[None, :]
    p += w12 * x12[None, :]
    return p


@triton.jit
def _fp4_rows_dot(x_ptr, stride_xm, m_rows, w_ptr, s_ptr, rows, row_mask, KB,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """sum_k x[m, k] * (E2M1 * e4m3)[rows, k] for the first BLOCK_M (1, 2, 4) rows of x (rows
    >= m_rows read as 0): four fp32 [BLOCK_N] lacking FP4_UNIT * global_scale. `w_ptr`: int64
    view of the codes [rows, KB] (one word = 16 codes), `s_ptr`: uint8 scales [rows, KB]. The
    weight tile is decoded once for every row of x, each block's sum scaled once."""
    offs_b = tl.arange(0, BLOCK_B)
    rows64 = rows.to(tl.int64)
    w_rows = w_ptr + rows64[:, None] * KB
    s_rows = s_ptr + rows64[:, None] * KB
    acc0 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    for b0 in range(0, KB, BLOCK_B):
        # NOTE: contiguity capped at 2 words so a thread loads 16 bytes per row and holds
        # several rows (they share its x values) instead of one long row segment
        blk = tl.max_contiguous(b0 + offs_b, 2)  # [BB]
        ok = blk < KB
        zero = tl.zeros_like(blk)  # NOTE: vector masks only (the interpreter rejects scalars)
        mask = row_mask[:, None] & ok[None, :]
        v = tl.load(w_rows + blk[None, :], mask=mask, other=0)  # [BN, BB] int64
        scale = _e4m3(tl.load(s_rows + blk[None, :], mask=mask, other=0))  # [BN, BB]
        lo = v.to(tl.uint32)  # inputs 16b + 0..7
        hi = (v >> 32).to(tl.uint32)  # inputs 16b + 8..15
        xk = x_ptr + blk * 16
        p0 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p2 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        for i in tl.static_range(4):
            w0, w4 = _nibble_pair(lo, i)
            w8, w12 = _nibble_pair(hi, i)
            x0, x4, x8, x12 = _x_quad(xk, i, ok & (zero < m_rows))
            p0 = _fma4(p0, w0, w4, w8, w12, x0, x4, x8, x12)
            if BLOCK_M > 1:
                x0, x4, x8, x12 = _x_quad(xk + stride_xm, i, ok & (zero + 1 < m_rows))
                p1 = _fma4(p1, w0, w4, w8, w12, x0, x4, x8, x12)
            if BLOCK_M > 2:
                x0, x4, x8, x12 = _x_quad(xk + 2 * stride_xm, i, ok & (zero + 2 < m_rows))
                p2 = _fma4(p2, w0, w4, w8, w12, x0, x4, x8, x12)
                x0, x4, x8, x12 = _x_quad(xk + 3 * stride_xm, i, ok & (zero + 3 < m_rows))
                p3 = _fma4(p3, w0, w4, w8, w12, x0, x4, x8, x12)
        acc0 += p0 * scale
        if BLOCK_M > 1:
            acc1 += p1 * scale
        if BLOCK_M > 2:
            acc2 += p2 * scale
            acc3 += p3 * scale
    # NOTE: sums are x * E2M1 * e4m3 * 2^(64 - 126 - 8); rescale to the common 2^-22 unit
    u = GEMV_RESCALE_C
    return (tl.sum(acc0, axis=1) * u, tl.sum(acc1, axis=1) * u, tl.sum(acc2, axis=1) * u,
            tl.sum(acc3, axis=1) * u)


@triton.jit
def nvfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, factor, M, N, KB, stride_xm,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    # out[m, n] = factor * sum_k x[m, k] * W[n, k], BLOCK_M rows of x at once; grid
    # cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # NOTE: x row groups vary fastest so one weight tile is reused from L2
    pid_n = pid // num_m
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    m0 = pid_m * BLOCK_M
    x_row = x_ptr + m0.to(tl.int64) * stride_xm
    a0, a1, a2, a3 = _fp4_rows_dot(x_row, stride_xm, M - m0, w_ptr, s_ptr, rows, row_mask, KB,
                                   BLOCK_M, BLOCK_N, BLOCK_B)
    out = out_ptr + m0.to(tl.int64) * N + rows
    ty = out_ptr.dtype.element_ty
    tl.store(out, (a0 * factor).to(ty), mask=row_mask)
    if BLOCK_M > 1:
        tl.store(out + N, (a1 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 1 < M))
    if BLOCK_M > 2:
        tl.store(out + 2 * N, (a2 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 2 < M))
        tl.store(out + 3 * N, (a3 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 3 < M))

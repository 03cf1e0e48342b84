"""Triton kernels behind `kernels/nvfp4.py` and `kernels/fused_moe.py` (W4A16, no FP4 cores).

This module imports triton at the top, so only the launchers import it, lazily. Decoding:

- E2M1 code c -> fp16 bits `((c & 7) << 9) | ((c & 8) << 12)` = E2M1[c] * 2^-14 exactly
  (subnormal 0.5 and -0 included; no lookup table).
- E4M3 bits b -> fp16 bits `((b & 0x80) << 8) | ((b & 0x7F) << 7)` = e4m3(b) * 2^-8 exactly
  (e4m3 subnormals land on fp16 subnormals; works below sm_89, no fp8 type needed).

So E2M1 * e4m3 = decoded product * 2^22 (`FP4_UNIT`), folded into the per-tensor factor.
"""

from __future__ import annotations

import triton
import triton.language as tl

FP4_UNIT = float(2**22)
FP4_UNIT_C = tl.constexpr(FP4_UNIT)
X_PRESCALE_C = tl.constexpr(float(2**64))  # gemv: x * 2^64 keeps x * E2M1 * 2^-126 normal
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
    """Nibbles I and I + 4 of uint32 words `w` -> two fp32 tensors E2M1 * 2^-126.

    Both bf16 bit patterns are built at once, one per 16-bit half (magnitude bits 4I..4I+2
    -> 6..8, sign bit 4I+3 -> 15), then each half becomes an fp32 by a shift or a mask: six
    integer ops per pair, no conversion instruction. Code 1 (0.5) is an fp32 subnormal, exact
    (no flush to zero: Triton emits no .ftz for fma/mul); callers prescale x by X_PRESCALE so
    products stay normal.
    """
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
def _x_quad(xk, I: tl.constexpr, m, XS):
    # X_PRESCALE * x at inputs 16b + I, +4, +8, +12 of the blocks at `xk` (mask m), fp32 [BB];
    # input 16b + i sits at xk + i * XS (XS = 1: plain rows; XS = KB: block-transposed rows)
    x0 = tl.load(xk + I * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x1 = tl.load(xk + (I + 4) * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x2 = tl.load(xk + (I + 8) * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x3 = tl.load(xk + (I + 12) * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    return x0, x1, x2, x3


@triton.jit
def _fma4(p, w0, w4, w8, w12, x0, x4, x8, x12):
    p += w0 * x0[None, :]
    p += w4 * x4[None, :]
    p += w8 * x8[None, :]
    p += w12 * x12[None, :]
    return p


@triton.jit
def _fp4_rows_dot(x_ptr, stride_xm, m_rows, w_ptr, s_ptr, rows, row_mask, KB, b_lo, b_hi,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                  PREFETCH: tl.constexpr = False, X_T: tl.constexpr = False):
    """sum_k x[m, k] * (E2M1 * e4m3)[rows, k] over the 16-input blocks [b_lo, b_hi), for the
    first BLOCK_M (1, 2 or 4; rows >= m_rows read as 0) rows of x: four fp32 [BLOCK_N]
    (unused ones are zeros), each lacking the factor FP4_UNIT * global_scale.

    `w_ptr`: int64 view of the codes, [rows, KB] (one word = one block of 16 codes, element
    16b + j in bits 4j..4j+3); `s_ptr`: uint8 block scales [rows, KB]. The weight tile
    [BLOCK_N, BLOCK_B] is decoded once and used for every row of x; products are summed per
    block, scaled once per block, and reduced across the tile only at the end. PREFETCH: the
    next K step's words and scales are loaded before this step is decoded (two steps in
    flight per program; for grids of about one wave). X_T: each row of x is stored
    block-transposed (input 16b + i at i * KB + b), so the loads of one input position over
    the blocks of a warp are contiguous (the MoE intermediate is written that way).
    """
    offs_b = tl.arange(0, BLOCK_B)
    rows64 = rows.to(tl.int64)
    w_rows = w_ptr + rows64[:, None] * KB
    s_rows = s_ptr + rows64[:, None] * KB
    acc0 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    fblk = tl.max_contiguous(b_lo + offs_b, 2)
    fmask = row_mask[:, None] & (fblk < b_hi)[None, :]
    v_next = tl.load(w_rows + fblk[None, :], mask=fmask, other=0)  # used when PREFETCH
    raw_next = tl.load(s_rows + fblk[None, :], mask=fmask, other=0)
    for b0 in range(b_lo, b_hi, BLOCK_B):
        # NOTE: contiguity capped at 2 words so a thread loads 16 bytes per row and holds
        # several rows (they share its x values) instead of one long row segment
        blk = tl.max_contiguous(b0 + offs_b, 2)  # [BB]
        ok = blk < b_hi
        zero = tl.zeros_like(blk)  # NOTE: vector masks only (the interpreter rejects scalars)
        if PREFETCH:
            cur_v = v_next
            cur_raw = raw_next
            nblk = tl.max_contiguous(b0 + BLOCK_B + offs_b, 2)
            nmask = row_mask[:, None] & (nblk < b_hi)[None, :]
            v_next = tl.load(w_rows + nblk[None, :], mask=nmask, other=0)
            raw_next = tl.load(s_rows + nblk[None, :], mask=nmask, other=0)
        else:
            mask = row_mask[:, None] & ok[None, :]
            cur_v = tl.load(w_rows + blk[None, :], mask=mask, other=0)  # [BN, BB] int64
            cur_raw = tl.load(s_rows + blk[None, :], mask=mask, other=0)  # [BN, BB] uint8
        scale = _e4m3(cur_raw)
        lo = cur_v.to(tl.uint32)  # inputs 16b + 0..7
        hi = (cur_v >> 32).to(tl.uint32)  # inputs 16b + 8..15
        if X_T:
            xk = x_ptr + blk
            XS = KB
        else:
            xk = x_ptr + blk * 16
            XS = 1
        p0 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p2 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        for i in tl.static_range(4):
            w0, w4 = _nibble_pair(lo, i)
            w8, w12 = _nibble_pair(hi, i)
            x0, x4, x8, x12 = _x_quad(xk, i, ok & (zero < m_rows), XS)
            p0 = _fma4(p0, w0, w4, w8, w12, x0, x4, x8, x12)
            if BLOCK_M > 1:
                x0, x4, x8, x12 = _x_quad(xk + stride_xm, i, ok & (zero + 1 < m_rows), XS)
                p1 = _fma4(p1, w0, w4, w8, w12, x0, x4, x8, x12)
            if BLOCK_M > 2:
                x0, x4, x8, x12 = _x_quad(xk + 2 * stride_xm, i, ok & (zero + 2 < m_rows),
                                          XS)
                p2 = _fma4(p2, w0, w4, w8, w12, x0, x4, x8, x12)
                x0, x4, x8, x12 = _x_quad(xk + 3 * stride_xm, i, ok & (zero + 3 < m_rows),
                                          XS)
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
def _dense_rows_dot(x_row, w_ptr, rows, row_mask, K, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    """sum_k x[k] * W[rows, k], W a dense [rows, K] weight, fp32 [BLOCK_N]."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    rows64 = rows.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        xv = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + rows64[:, None] * K + kk[None, :],
                     mask=row_mask[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += wv * xv[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def nvfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, factor, M, N, KB, stride_xm, B_SPLIT,
                      SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_B: tl.constexpr, PREFETCH: tl.constexpr):
    # out[pid_k, m, n] = factor * sum_{k in split} x[m, k] * W[n, k], BLOCK_M rows of x at once
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # NOTE: x row groups vary fastest so one weight tile is reused from L2
    rest = pid // num_m
    pid_k = rest % SPLIT_K
    pid_n = rest // SPLIT_K
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    b_lo = pid_k * B_SPLIT
    b_hi = tl.minimum(b_lo + B_SPLIT, KB)
    m0 = pid_m * BLOCK_M
    a0, a1, a2, a3 = _fp4_rows_dot(x_ptr + m0.to(tl.int64) * stride_xm, stride_xm, M - m0,
                                   w_ptr, s_ptr, rows, row_mask, KB, b_lo, b_hi, BLOCK_M,
                                   BLOCK_N, BLOCK_B, PREFETCH)
    out = out_ptr + (pid_k.to(tl.int64) * M + m0) * N + rows
    ty = out_ptr.dtype.element_ty
    tl.store(out, (a0 * factor).to(ty), mask=row_mask)
    if BLOCK_M > 1:
        tl.store(out + N, (a1 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 1 < M))
    if BLOCK_M > 2:
        tl.store(out + 2 * N, (a2 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 2 < M))
        tl.store(out + 3 * N, (a3 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 3 < M))


@triton.jit
def _dequant_tile(w_ptr, s_ptr, rows, row_mask, k0, K, SW, SS,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BN, BK] fp32 E2M1 * e4m3 (exact in bf16/fp16) of `rows` at inputs k0..k0+BK, from codes
    [rows, SW bytes] and scales [rows, SS bytes] (row strides; divisible by 16 -> wide loads)."""
    rows64 = rows.to(tl.int64)
    byte = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    blk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    packed = tl.load(w_ptr + rows64[:, None] * SW + byte[None, :],
                     mask=row_mask[:, None] & (byte < K // 2)[None, :], other=0)
    packed = packed.to(tl.int32)  # [BN, BK/2]
    raw = tl.load(s_ptr + rows64[:, None] * SS + blk[None, :],
                  mask=row_mask[:, None] & (blk < K // 16)[None, :], other=0)  # [BN, BK/16]
    scale = _e4m3(raw) * FP4_UNIT_C
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], [BLOCK_N, BLOCK_K // 16, 8]),
                       [BLOCK_N, BLOCK_K // 2])
    lo = _e2m1(packed & 15) * scale
    hi = _e2m1(packed >> 4) * scale
    return tl.interleave(lo, hi)  # element 2j = low nibble of byte j


@triton.jit
def _tile_dot(acc, x_rows, x_mask, w_ptr, s_ptr, rows, row_mask, K, SW, SS,
              IS_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc [BM, BN] += x[BM, :K] @ W[rows, :K].T with tensor cores, W in x's dtype.

    `x_rows` [BM] pointers to rows of x. IS_FP4: W from codes/scales (without the global
    scale; row strides SW, SS bytes), else a dense weight with row stride SW elements.
    """
    offs_k = tl.arange(0, BLOCK_K)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        xv = tl.load(x_rows[:, None] + kk[None, :], mask=x_mask[:, None] & k_mask[None, :],
                     other=0.0)  # [BM, BK]
        if IS_FP4:
            w = _dequant_tile(w_ptr, s_ptr, rows, row_mask, k0, K, SW, SS, BLOCK_N, BLOCK_K)
        else:
            w = tl.load(w_ptr + rows.to(tl.int64)[:, None] * SW + kk[None, :],
                        mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(xv, tl.trans(w.to(xv.dtype)))
    return acc


@triton.jit
def nvfp4_dot_kernel(x_ptr, w_ptr, s_ptr, out_ptr, gs, M, N, K, stride_xm, stride_w, stride_s,
                     K_SPLIT, K_SPLIT_W, K_SPLIT_S, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[pid_k, m, n] = gs * sum_{k in split} x[m, k] * (E2M1 * e4m3)[n, k]
    # NOTE: K_SPLIT_W / K_SPLIT_S (= K_SPLIT / 2, / 16) are arguments so Triton knows the
    # split offsets keep 16-byte alignment
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
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm + pid_k * K_SPLIT
    k_len = tl.minimum(K_SPLIT, K - pid_k * K_SPLIT)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _tile_dot(acc, x_rows, m_mask, w_ptr + pid_k * K_SPLIT_W, s_ptr + pid_k * K_SPLIT_S,
                    rows, row_mask, k_len, stride_w, stride_s, True, BLOCK_N, BLOCK_K)
    out = out_ptr + (pid_k * M + offs_m).to(tl.int64)[:, None] * N + rows[None, :]
    tl.store(out, (acc * gs).to(out_ptr.dtype.element_ty),
             mask=m_mask[:, None] & row_mask[None, :])


@triton.jit
def nvfp4_dequant_kernel(w_ptr, s_ptr, out_ptr, gs, N, K, stride_w, stride_s,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[n, k] = gs * E2M1 * e4m3, out [N, K] row-major in out's dtype
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    row_mask = rows < N
    w = _dequant_tile(w_ptr, s_ptr, rows, row_mask, k0, K, stride_w, stride_s, BLOCK_N,
                      BLOCK_K)
    kk = k0 + tl.arange(0, BLOCK_K)
    out = out_ptr + rows.to(tl.int64)[:, None] * K + kk[None, :]
    tl.store(out, (w * gs).to(out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & (kk < K)[None, :])


# --------------------------------------------------------------------------------------------
# Fused MoE over expert slots, one program per (token, expert) pair and block of rows.


@triton.jit
def _slot_rows_dot(x_row, w_slot, s_slot, rows, row_mask, K: tl.constexpr,
                   IS_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                   PREFETCH: tl.constexpr):
    # one row of x against `rows` of one slot's weight: fp32 [BLOCK_N] (fp4 lacks FP4_UNIT * gs;
    # fp4 reads x block-transposed, as moe_gate_up_kernel writes it)
    if IS_FP4:
        acc, _a1, _a2, _a3 = _fp4_rows_dot(x_row, 0, 1, w_slot, s_slot, rows, row_mask,
                                           K // 16, 0, K // 16, 1, BLOCK_N, BLOCK_B, PREFETCH,
                                           True)
    else:
        acc = _dense_rows_dot(x_row, w_slot, rows, row_mask, K, BLOCK_N, BLOCK_B * 8)
    return acc


@triton.jit
def moe_gate_up_kernel(x_ptr, ids_ptr, order_ptr, w_ptr, s_ptr, gs_ptr, inter_ptr, stride_xm,
                       H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                       IS_FP4: tl.constexpr, HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_B: tl.constexpr, PREFETCH: tl.constexpr):
    # inter[p, f] = silu(x[t] . W13[slot, f]) * (x[t] . W13[slot, F + f]), p = t * TOPK + j
    # NOTE: one launch for every pair: grid (pairs, F / BLOCK_N); fp4 w_ptr is the int64 view
    if HAS_ORDER:
        p = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)  # pairs sorted by slot
    else:
        p = tl.program_id(0).to(tl.int64)
    slot = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // TOPK) * stride_xm
    f0 = tl.program_id(1) * BLOCK_N
    if IS_FP4:
        # NOTE: gate row f and up row F + f interleaved in one tile, so both stream at once
        j = tl.arange(0, 2 * BLOCK_N)
        f = f0 + j // 2
        half = j % 2  # 0 = gate, 1 = up
        acc, _a1, _a2, _a3 = _fp4_rows_dot(x_row, 0, 1, w_ptr + slot * (2 * F) * (H // 16),
                                           s_ptr + slot * (2 * F) * (H // 16), f + half * F,
                                           f < F, H // 16, 0, H // 16, 1, 2 * BLOCK_N, BLOCK_B,
                                           PREFETCH)
        acc = acc * (tl.load(gs_ptr + 2 * slot + half) * FP4_UNIT_C)
        g, u = tl.split(tl.reshape(acc, [BLOCK_N, 2]))
    else:
        rows = f0 + tl.arange(0, BLOCK_N)
        w_slot = w_ptr + slot * (2 * F) * H
        g = _dense_rows_dot(x_row, w_slot, rows, rows < F, H, BLOCK_N, BLOCK_B * 8)
        u = _dense_rows_dot(x_row, w_slot, rows + F, rows < F, H, BLOCK_N, BLOCK_B * 8)
    h = g * tl.sigmoid(g) * u
    rows = f0 + tl.arange(0, BLOCK_N)
    if IS_FP4:
        # NOTE: block-transposed (feature 16b + i at i * F/16 + b): the down kernel's loads of
        # one input position over a warp's blocks are then contiguous
        dst = (rows % 16) * (F // 16) + rows // 16
    else:
        dst = rows
    tl.store(inter_ptr + p * F + dst, h, mask=rows < F)


@triton.jit
def moe_down_kernel(inter_ptr, ids_ptr, wt_ptr, w_ptr, s_ptr, gs_ptr, out_ptr,
                    H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                    IS_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr,
                    PREFETCH: tl.constexpr):
    # out[t, h] = sum_j topk_weight[t, j] * inter[t * TOPK + j] . W2[slot_j, h], in out's dtype
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # NOTE: unrolled (TOPK, H, F constexpr) so the k experts' loads are all in flight at once
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        slot = tl.load(ids_ptr + p).to(tl.int64)
        if IS_FP4:
            w_slot = w_ptr + slot * H * (F // 16)
            s_slot = s_ptr + slot * H * (F // 16)
        else:
            w_slot = w_ptr + slot * H * F
            s_slot = s_ptr
        part = _slot_rows_dot(inter_ptr + p * F, w_slot, s_slot, rows, row_mask, F, IS_FP4,
                              BLOCK_N, BLOCK_B, PREFETCH)
        factor = tl.load(wt_ptr + p).to(tl.float32)
        if IS_FP4:
            factor = factor * tl.load(gs_ptr + slot) * FP4_UNIT_C
        acc += part * factor
    tl.store(out_ptr + t * H + rows, acc.to(out_ptr.dtype.element_ty), mask=row_mask)


# --------------------------------------------------------------------------------------------
# Fused MoE, prefill: pairs sorted by slot and padded to BLOCK_M per slot, tensor-core tiles.


@triton.jit
def moe_dot_gate_up_kernel(x_ptr, block_slot_ptr, sorted_pairs_ptr, w_ptr, s_ptr, gs_ptr,
                           inter_ptr, TOPK, P, stride_xm,
                           H: tl.constexpr, F: tl.constexpr, IS_FP4: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # inter[p, f] = silu(x[t] . W13[slot, f]) * (x[t] . W13[slot, F + f]) for the pairs p of
    # one block (all of one slot); inter is in x's dtype
    pid_b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid_b).to(tl.int64)
    if slot < 0:  # padding block past the last slot's pairs
        return
    pairs = tl.load(sorted_pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < P
    x_rows = x_ptr + (pairs // TOPK) * stride_xm
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < F
    if IS_FP4:
        w_slot = w_ptr + slot * (2 * F) * (H // 2)
        s_slot = s_ptr + slot * (2 * F) * (H // 16)
    else:
        w_slot = w_ptr + slot * (2 * F) * H
        s_slot = s_ptr
    SW: tl.constexpr = H // 2 if IS_FP4 else H
    g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    g = _tile_dot(g, x_rows, valid, w_slot, s_slot, rows, row_mask, H, SW, H // 16, IS_FP4,
                  BLOCK_N, BLOCK_K)
    u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    u = _tile_dot(u, x_rows, valid, w_slot, s_slot, rows + F, row_mask, H, SW, H // 16, IS_FP4,
                  BLOCK_N, BLOCK_K)
    if IS_FP4:
        g = g * tl.load(gs_ptr + 2 * slot)  # NOTE: dot tiles already carry FP4_UNIT
        u = u * tl.load(gs_ptr + 2 * slot + 1)
    h = g * tl.sigmoid(g) * u
    tl.store(inter_ptr + pairs[:, None] * F + rows[None, :],
             h.to(inter_ptr.dtype.element_ty), mask=valid[:, None] & row_mask[None, :])


@triton.jit
def moe_dot_down_kernel(inter_ptr, block_slot_ptr, sorted_pairs_ptr, wt_ptr, w_ptr, s_ptr,
                        gs_ptr, out_ptr, P,
                        H: tl.constexpr, F: tl.constexpr, IS_FP4: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[p, h] = topk_weight[p] * inter[p] . W2[slot, h]
    pid_b = tl.program_id(0)
    slot = tl.load(block_slot_ptr + pid_b).to(tl.int64)
    if slot < 0:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = pairs < P
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    if IS_FP4:
        w_slot = w_ptr + slot * H * (F // 2)
        s_slot = s_ptr + slot * H * (F // 16)
    else:
        w_slot = w_ptr + slot * H * F
        s_slot = s_ptr
    SW: tl.constexpr = F // 2 if IS_FP4 else F
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _tile_dot(acc, inter_ptr + pairs * F, valid, w_slot, s_slot, rows, row_mask, F, SW,
                    F // 16, IS_FP4, BLOCK_N, BLOCK_K)
    factor = tl.load(wt_ptr + pairs, mask=valid, other=0.0).to(tl.float32)
    if IS_FP4:
        factor = factor * tl.load(gs_ptr + slot)
    tl.store(out_ptr + pairs[:, None] * H + rows[None, :], acc * factor[:, None],
             mask=valid[:, None] & row_mask[None, :])

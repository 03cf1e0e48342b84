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
def _rows_dot(x_row, w_ptr, s_ptr, rows, row_mask, K, k_lo, k_hi,
              IS_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """sum_k x[k] * W[rows, k] over k in [k_lo, k_hi), fp32 [BLOCK_N].

    IS_FP4: `w_ptr` is int32 words [rows, K/8] (8 codes each, code j in bits 4j..4j+3) and
    `s_ptr` uint8 [rows, K/16]; the result lacks the factor FP4_UNIT * global_scale.
    Otherwise `w_ptr` is a dense [rows, K] weight and `s_ptr` is unused.
    """
    offs_w = tl.arange(0, BLOCK_W)
    offs_j = tl.arange(0, 8)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    rows64 = rows.to(tl.int64)
    for k0 in range(k_lo, k_hi, BLOCK_W * 8):
        word = k0 // 8 + offs_w  # [BW]
        kk = word[:, None] * 8 + offs_j[None, :]  # [BW, 8]
        k_ok = kk < k_hi
        xv = tl.load(x_row + kk, mask=k_ok, other=0.0).to(tl.float32)  # [BW, 8]
        if IS_FP4:
            w_ok = row_mask[:, None] & (word[None, :] < k_hi // 8)
            words = tl.load(w_ptr + rows64[:, None] * (K // 8) + word[None, :], mask=w_ok,
                            other=0)  # [BN, BW] int32
            codes = (words[:, :, None] >> (offs_j * 4)[None, None, :]) & 15  # [BN, BW, 8]
            part = tl.sum(_e2m1(codes) * xv[None, :, :], axis=2)  # [BN, BW]
            raw = tl.load(s_ptr + rows64[:, None] * (K // 16) + (word // 2)[None, :],
                          mask=w_ok, other=0)
            acc += tl.sum(part * _e4m3(raw), axis=1)
        else:
            w_ok = row_mask[:, None, None] & k_ok[None, :, :]
            wv = tl.load(w_ptr + rows64[:, None, None] * K + kk[None, :, :], mask=w_ok,
                         other=0.0).to(tl.float32)  # [BN, BW, 8]
            acc += tl.sum(tl.sum(wv * xv[None, :, :], axis=2), axis=1)
    return acc


@triton.jit
def nvfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, factor, M, N, K, stride_xm, K_SPLIT,
                      SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    # out[pid_k, m, n] = factor * sum_{k in split} x[m, k] * W[n, k]
    pid = tl.program_id(0)
    pid_m = pid % M  # NOTE: rows of x vary fastest so one weight tile is reused from L2
    rest = pid // M
    pid_k = rest % SPLIT_K
    pid_n = rest // SPLIT_K
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    k_lo = pid_k * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    acc = _rows_dot(x_ptr + pid_m.to(tl.int64) * stride_xm, w_ptr, s_ptr, rows, row_mask, K,
                    k_lo, k_hi, True, BLOCK_N, BLOCK_W)
    out = out_ptr + (pid_k.to(tl.int64) * M + pid_m) * N + rows
    tl.store(out, (acc * factor).to(out_ptr.dtype.element_ty), mask=row_mask)


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
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[m, n] = gs * sum_k x[m, k] * (E2M1 * e4m3)[n, k]
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # NOTE: M tiles vary fastest so one weight tile is reused from L2
    pid_n = pid // num_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    row_mask = rows < N
    x_rows = x_ptr + offs_m.to(tl.int64) * stride_xm
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc = _tile_dot(acc, x_rows, m_mask, w_ptr, s_ptr, rows, row_mask, K, stride_w, stride_s,
                    True, BLOCK_N, BLOCK_K)
    out = out_ptr + offs_m.to(tl.int64)[:, None] * N + rows[None, :]
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
def moe_gate_up_kernel(x_ptr, ids_ptr, order_ptr, w_ptr, s_ptr, gs_ptr, inter_ptr, stride_xm,
                       H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                       IS_FP4: tl.constexpr, HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_W: tl.constexpr):
    # inter[p, f] = silu(x[t] . W13[slot, f]) * (x[t] . W13[slot, F + f]), p = t * TOPK + j
    if HAS_ORDER:
        p = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)  # pairs sorted by slot
    else:
        p = tl.program_id(0).to(tl.int64)
    slot = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // TOPK) * stride_xm
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < F
    if IS_FP4:
        w_slot = w_ptr + slot * (2 * F) * (H // 8)
        s_slot = s_ptr + slot * (2 * F) * (H // 16)
    else:
        w_slot = w_ptr + slot * (2 * F) * H
        s_slot = s_ptr
    g = _rows_dot(x_row, w_slot, s_slot, rows, row_mask, H, 0, H, IS_FP4, BLOCK_N, BLOCK_W)
    u = _rows_dot(x_row, w_slot, s_slot, rows + F, row_mask, H, 0, H, IS_FP4, BLOCK_N,
                  BLOCK_W)
    if IS_FP4:
        g = g * (tl.load(gs_ptr + 2 * slot) * FP4_UNIT_C)
        u = u * (tl.load(gs_ptr + 2 * slot + 1) * FP4_UNIT_C)
    h = g * tl.sigmoid(g) * u
    tl.store(inter_ptr + p * F + rows, h, mask=row_mask)


@triton.jit
def moe_down_kernel(inter_ptr, ids_ptr, wt_ptr, w_ptr, s_ptr, gs_ptr, out_ptr,
                    H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                    IS_FP4: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
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
            w_slot = w_ptr + slot * H * (F // 8)
            s_slot = s_ptr + slot * H * (F // 16)
        else:
            w_slot = w_ptr + slot * H * F
            s_slot = s_ptr
        part = _rows_dot(inter_ptr + p * F, w_slot, s_slot, rows, row_mask, F, 0, F, IS_FP4,
                         BLOCK_N, BLOCK_W)
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

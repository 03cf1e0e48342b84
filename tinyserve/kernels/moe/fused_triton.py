"""Fused-MoE Triton kernels behind `fused.py`: the dense decode (gemv: gate_up per pair and row
block with silu * up fused, down per token summing its k experts) and the prefill (dot: pairs
grouped per slot into BLOCK_M tiles, weights dequantized in the K loop)."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.nvfp4.dot_triton import _tile_dot


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
def moe_gate_up_kernel(x_ptr, ids_ptr, order_ptr, w_ptr, inter_ptr, stride_xm,
                       H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                       HAS_ORDER: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # inter[p, f] = silu(x[t] . W13[slot, f]) * (x[t] . W13[slot, F + f]), p = t * TOPK + j
    # NOTE: one launch for every pair: grid (pairs, F / BLOCK_N)
    if HAS_ORDER:
        p = tl.load(order_ptr + tl.program_id(0)).to(tl.int64)  # pairs sorted by slot
    else:
        p = tl.program_id(0).to(tl.int64)
    slot = tl.load(ids_ptr + p).to(tl.int64)
    x_row = x_ptr + (p // TOPK) * stride_xm
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_slot = w_ptr + slot * (2 * F) * H
    g = _dense_rows_dot(x_row, w_slot, rows, rows < F, H, BLOCK_N, BLOCK_K)
    u = _dense_rows_dot(x_row, w_slot, rows + F, rows < F, H, BLOCK_N, BLOCK_K)
    tl.store(inter_ptr + p * F + rows, g * tl.sigmoid(g) * u, mask=rows < F)


@triton.jit
def moe_down_kernel(inter_ptr, ids_ptr, wt_ptr, w_ptr, out_ptr, H: tl.constexpr,
                    F: tl.constexpr, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    # out[t, h] = sum_j topk_weight[t, j] * inter[t * TOPK + j] . W2[slot_j, h] in out's
    # dtype; grid (tokens, H / BLOCK_N)
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < H
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # NOTE: unrolled (TOPK, H, F constexpr) so the loads of all k experts are in flight at once
    for j in tl.static_range(TOPK):
        p = t * TOPK + j
        slot = tl.load(ids_ptr + p).to(tl.int64)
        part = _dense_rows_dot(inter_ptr + p * F, w_ptr + slot * H * F, rows, row_mask, F,
                               BLOCK_N, BLOCK_K)
        acc += part * tl.load(wt_ptr + p).to(tl.float32)
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

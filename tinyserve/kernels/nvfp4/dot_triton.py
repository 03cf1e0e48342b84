"""Tensor-core NVFP4 kernels behind `linear.py`: the `dot` path (the weight tile dequantized in
the K loop) and the `dequant` kernel (scratch for cuBLAS). `_tile_dot` is shared with the
fused-MoE prefill (`moe/fused_triton.py`)."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.nvfp4.splitk_triton import splitk_tile
from tinyserve.kernels.nvfp4.triton import FP4_UNIT_C, _e2m1, _e4m3


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
        if xv.dtype == tl.float32:  # fp32 x (tests, CPU-sized checks): exact products, not tf32
            acc += tl.dot(xv, tl.trans(w.to(xv.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(xv, tl.trans(w.to(xv.dtype)))
    return acc


@triton.jit
def nvfp4_dot_kernel(x_ptr, w_ptr, s_ptr, out_ptr, gs, M, N, K, stride_xm, stride_w, stride_s,
                     K_SPLIT, K_SPLIT_W, K_SPLIT_S, SPLIT_K: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[pid_k, m, n] = gs * sum_{k in split} x[m, k] * (E2M1 * e4m3)[n, k]
    # NOTE: K_SPLIT_W / K_SPLIT_S (= K_SPLIT / 2, / 16) are arguments so Triton knows the
    # split offsets keep 16-byte alignment
    pid_k, offs_m, rows, m_mask, row_mask = splitk_tile(M, N, SPLIT_K, BLOCK_M, BLOCK_N)
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



"""Deterministic two-launch NVFP4 MoE decode in Triton (the "fused" path of `fused.py`).

Pair q = t * KP + j is expert j of token t (j == TOPK with HAS_SHARED: the shared expert).
No atomics: every output element is written by one program summing in a fixed order.
1. `moe_fused_gate_up_kernel`, grid (N * KP, F / BLOCK_F): the "h2" decode of
   `nvfp4.triton._fp4_rows_dot_h2`; silu(gate) * up in fp32 into h [N * KP, F],
   block-transposed (feature 16b + i at i * F/16 + b) for the down kernel's loads.
2. `moe_fused_down_kernel`, grid (N, H / BLOCK_H): the down rows of all pairs loaded at once,
   summed over the pairs in registers; with PDL (sm_90+) its weight loads precede
   `griddepcontrol.wait`."""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.nvfp4.triton import (
    FP4_UNIT_C,
    GEMV_RESCALE_C,
    X_PRESCALE_C,
    _e4m3,
    _fp4_rows_dot_h2,
    _nibble_pair,
)


@triton.jit
def moe_fused_gate_up_kernel(x_ptr, ids_ptr, w13_ptr, s13_ptr, g13_ptr,
                              sw13_ptr, ss13_ptr, sg13_ptr, h_ptr, stride_xm,
                              H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                              HAS_SHARED: tl.constexpr, BLOCK_F: tl.constexpr,
                              BLOCK_B: tl.constexpr, USE_ASM: tl.constexpr,
                              TRIGGER: tl.constexpr):
    # h[q, i * F/16 + b] = silu(x[t] . W13[f]) * (x[t] . W13[F + f]), f = 16b + i, of pair q;
    # w13 pointers are int64 views of the codes (one word = 16 codes). TRIGGER: the down
    # kernel, a dependent launch, may launch once every program got here (it waits for h)
    if TRIGGER:
        tl.extra.cuda.gdc_launch_dependents()
    KP: tl.constexpr = TOPK + HAS_SHARED
    KB: tl.constexpr = H // 16
    FB: tl.constexpr = F // 16
    q = tl.program_id(0)
    t = (q // KP).to(tl.int64)
    j = q % KP
    f0 = tl.program_id(1) * BLOCK_F
    # NOTE: the shared pair reads a routed id it does not use (keeps one code path)
    slot = tl.load(ids_ptr + t * TOPK + tl.minimum(j, TOPK - 1)).to(tl.int64)
    w13 = w13_ptr + slot * (2 * F * KB)
    s13 = s13_ptr + slot * (2 * F * KB)
    g13 = g13_ptr + 2 * slot
    if HAS_SHARED:
        if j == TOPK:
            w13 = sw13_ptr
            s13 = ss13_ptr
            g13 = sg13_ptr
    jj = tl.arange(0, 2 * BLOCK_F)
    f = f0 + jj // 2
    half = jj % 2  # 0 = gate row f, 1 = up row F + f
    acc = _fp4_rows_dot_h2(x_ptr + t * stride_xm, w13, s13, f + half * F, f < F, KB, 0, KB,
                           2 * BLOCK_F, BLOCK_B, USE_ASM, KB <= BLOCK_B)
    acc = acc * (tl.load(g13 + half) * FP4_UNIT_C)
    g, u = tl.split(tl.reshape(acc, [BLOCK_F, 2]))
    ff = f0 + tl.arange(0, BLOCK_F)
    dst = (ff % 16) * FB + ff // 16  # block-transposed
    tl.store(h_ptr + q.to(tl.int64) * F + dst, g * tl.sigmoid(g) * u, mask=ff < F)


@triton.jit
def _down_rows(v, raw, hk, hmask, FB: tl.constexpr):
    """Down rows against h of the same pair: v [.., BH, FBP] int64 code words (16 features
    each), raw their scales, hk pointers of v's shape to h's block-transposed feature 16b + 0
    of each word (feature 16b + i at hk + i * FB; the same for every row: loaded in v's
    layout, no exchange between threads), hmask of v's shape; fp32 [.., BH, FBP] products in
    the unit x * E2M1 * e4m3 * 2^(64 - 126 - 8) (sum over the last axis, then
    * GEMV_RESCALE)."""
    lo = v.to(tl.uint32)  # features 16b + 0..7
    hi = (v >> 32).to(tl.uint32)  # features 16b + 8..15
    p = tl.zeros(v.shape, dtype=tl.float32)
    for i in tl.static_range(4):
        w0, w4 = _nibble_pair(lo, i)
        w8, w12 = _nibble_pair(hi, i)
        x0 = tl.load(hk + i * FB, mask=hmask, other=0.0) * X_PRESCALE_C
        x4 = tl.load(hk + (i + 4) * FB, mask=hmask, other=0.0) * X_PRESCALE_C
        x8 = tl.load(hk + (i + 8) * FB, mask=hmask, other=0.0) * X_PRESCALE_C
        x12 = tl.load(hk + (i + 12) * FB, mask=hmask, other=0.0) * X_PRESCALE_C
        p = _fma4_full(p, w0, w4, w8, w12, x0, x4, x8, x12)
    return p * _e4m3(raw)


@triton.jit
def _fma4_full(p, w0, w4, w8, w12, x0, x4, x8, x12):
    # p += w * x elementwise (x of p's shape)
    p += w0 * x0
    p += w4 * x4
    p += w8 * x8
    p += w12 * x12
    return p


@triton.jit
def moe_fused_down_kernel(h_ptr, ids_ptr, wt_ptr, logit_ptr, w2_ptr, s2_ptr, g2_ptr,
                           sw2_ptr, ss2_ptr, sg2_ptr, out_ptr, stride_logit,
                           H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                           KPAD: tl.constexpr, FBP: tl.constexpr, HAS_SHARED: tl.constexpr,
                           BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # out[t, r] = sum_j w[t, j] * h[t * KP + j] . W2_j[r] (+ sigmoid(logit[t]) * shared);
    # w2 pointers are int64 views of the codes. PDL (a dependent launch of the gate_up
    # kernel): everything but h is loaded first (ids, weights and gate come from kernels that
    # finished before gate_up started), then the wait for gate_up's writes, then h
    KP: tl.constexpr = TOPK + HAS_SHARED
    FB: tl.constexpr = F // 16
    t = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_mask = rows < H
    offs_b = tl.arange(0, FBP)
    b_ok = offs_b < FB
    jj = tl.arange(0, KPAD)
    j_ok = jj < TOPK
    slot = tl.load(ids_ptr + t * TOPK + jj, mask=j_ok, other=0).to(tl.int64)  # [KPAD]
    # every pair's full rows in one load: [KPAD, BH, FBP]
    off = (slot[:, None, None] * (H * FB) + rows[None, :, None].to(tl.int64) * FB
           + offs_b[None, None, :])
    m = j_ok[:, None, None] & row_mask[None, :, None] & b_ok[None, None, :]
    v = tl.load(w2_ptr + off, mask=m, other=0)
    raw = tl.load(s2_ptr + off, mask=m, other=0)
    if HAS_SHARED:
        off_s = rows[:, None] * FB + offs_b[None, :]
        m_s = row_mask[:, None] & b_ok[None, :]
        v_s = tl.load(sw2_ptr + off_s, mask=m_s, other=0)  # [BH, FBP]
        raw_s = tl.load(ss2_ptr + off_s, mask=m_s, other=0)
    factor = (tl.load(wt_ptr + t * TOPK + jj, mask=j_ok, other=0.0).to(tl.float32)
              * tl.load(g2_ptr + slot, mask=j_ok, other=0.0))  # [KPAD]
    if HAS_SHARED:
        logit = tl.load(logit_ptr + t * stride_logit).to(tl.float32)
        # NOTE: rounded to the model dtype like `gated_add`'s sigmoid
        sw = tl.sigmoid(logit).to(out_ptr.dtype.element_ty).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    q = t * KP + jj
    # [KPAD, BH, FBP]: every row's copy of its pair's h (one L1 line per warp)
    hk = h_ptr + q[:, None, None] * F + (offs_b[None, None, :] + 0 * rows[None, :, None])
    p = _down_rows(v, raw, hk, m, FB)
    part = tl.sum(p, axis=2) * GEMV_RESCALE_C  # [KPAD, BH]
    y = tl.sum(part * factor[:, None], axis=0)  # [BH], pairs summed in a fixed order
    if HAS_SHARED:
        hk_s = h_ptr + (t * KP + TOPK) * F + (offs_b[None, :] + 0 * rows[:, None])
        p_s = _down_rows(v_s, raw_s, hk_s, m_s, FB)
        y += tl.sum(p_s, axis=1) * GEMV_RESCALE_C * (sw * tl.load(sg2_ptr))
    tl.store(out_ptr + t * H + rows, (y * FP4_UNIT_C).to(out_ptr.dtype.element_ty),
             mask=row_mask)

"""Fused-MoE decode in one launch (NVFP4 expert slots), behind `kernels/fused_moe.py`.

Grid (pairs, F / BLOCK_F): pair q = t * KP + j is expert j of token t (j < TOPK: a routed
slot; j == TOPK with HAS_SHARED: the layer's shared expert, weight sigmoid(shared logit)).
One program:
1. gate_up: the BLOCK_F gate rows and BLOCK_F up rows of its feature chunk against x[t]
   (gate row f and up row F + f interleaved in one tile, the GEMV cores of
   `nvfp4_triton.py`, "f32" or "h2" decode), silu(gate) * up in registers (fp32);
2. down: the chunk's BLOCK_F columns of the expert's down weight (one int64 word of 16
   codes per output row and 16 features) times that intermediate, BLOCK_H output rows per
   step (the first step's words are loaded before step 1, so they stream with it);
3. the [H] partial, times the pair weight, added into the token's fp32 accumulator row with
   relaxed fp32 atomics;
4. a per-token arrival counter: the program that arrives last (after a CTA barrier and an
   acq_rel increment, so every other program's adds are visible) converts the row to the
   output dtype, writes it, and zeroes the row and the counter for the next launch.

So the accumulator and counters (`acc`, `cnt`) must be zero before a launch and are zero
after it (the launcher keeps one such workspace per device). With fp32 atomics the sum order
is not fixed: results differ in the last fp32 bits between runs, and so, now and then, in the
last bit of the bf16 output. `IS_FIXED` accumulates in int64 fixed point instead (each
partial rounded toward zero to a multiple of 2^-32, |sum| < 2^31): integer adds commute, so
the output is the same bits on every run, whatever order the programs arrive in.

This module imports triton at the top (the launcher imports it lazily).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.nvfp4_triton import (
    FP4_UNIT_C,
    GEMV_RESCALE_C,
    X_PRESCALE_C,
    _e4m3,
    _fma4,
    _fp4_rows_dot,
    _fp4_rows_dot_h2,
    _nibble_pair,
)

FIXED_ONE_C = tl.constexpr(4294967296.0)  # 2^32: one unit of the fixed-point accumulator


@triton.jit
def _col(hm, I: tl.constexpr):
    # column I of hm [NW, 16] -> [NW]
    sel = tl.arange(0, 16) == I
    return tl.sum(tl.where(sel[None, :], hm, 0.0), axis=1)


@triton.jit
def _down_tile(v, raw, hm):
    """sum over the chunk's features of W2[rows, feature] * h[feature] for words v [BH, NW]
    int64 (16 codes each), scales raw [BH, NW] uint8 and hm [NW, 16] = X_PRESCALE * h: fp32
    [BH], lacking FP4_UNIT * global_scale (the unit of `_fp4_rows_dot`)."""
    lo = v.to(tl.uint32)  # features 16b + 0..7
    hi = (v >> 32).to(tl.uint32)  # features 16b + 8..15
    p = tl.zeros(v.shape, dtype=tl.float32)
    for i in tl.static_range(4):
        w0, w4 = _nibble_pair(lo, i)
        w8, w12 = _nibble_pair(hi, i)
        p = _fma4(p, w0, w4, w8, w12, _col(hm, i), _col(hm, i + 4), _col(hm, i + 8),
                  _col(hm, i + 12))
    return tl.sum(p * _e4m3(raw), axis=1) * GEMV_RESCALE_C


@triton.jit
def moe_fused_decode_kernel(x_ptr, ids_ptr, wt_ptr, logit_ptr,
                            w13_ptr, s13_ptr, g13_ptr, w2_ptr, s2_ptr, g2_ptr,
                            sw13_ptr, ss13_ptr, sg13_ptr, sw2_ptr, ss2_ptr, sg2_ptr,
                            acc_ptr, cnt_ptr, out_ptr, stride_xm, stride_logit,
                            H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                            HAS_SHARED: tl.constexpr, BLOCK_F: tl.constexpr,
                            BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
                            IS_H2: tl.constexpr, USE_ASM: tl.constexpr,
                            FINISH_BLOCK: tl.constexpr, IS_FIXED: tl.constexpr):
    # out[t] = sum_j w[t, j] * down_j(silu(gate_j(x[t])) * up_j(x[t])) (+ sigmoid(logit[t]) *
    # shared(x[t])); w*_ptr are int64 views of the codes (one word = 16 codes)
    KP: tl.constexpr = TOPK + HAS_SHARED
    KB: tl.constexpr = H // 16
    FB: tl.constexpr = F // 16
    NW: tl.constexpr = BLOCK_F // 16
    q = tl.program_id(0)
    t = (q // KP).to(tl.int64)
    j = q % KP
    f0 = tl.program_id(1) * BLOCK_F
    # NOTE: the shared pair reads a routed id/weight it does not use (keeps one code path)
    p = t * TOPK + tl.minimum(j, TOPK - 1)
    slot = tl.load(ids_ptr + p).to(tl.int64)
    pw = tl.load(wt_ptr + p).to(tl.float32)
    w13 = w13_ptr + slot * (2 * F * KB)
    s13 = s13_ptr + slot * (2 * F * KB)
    g13 = g13_ptr + 2 * slot
    w2 = w2_ptr + slot * (H * FB)
    s2 = s2_ptr + slot * (H * FB)
    g2 = g2_ptr + slot
    if HAS_SHARED:
        if j == TOPK:
            logit = tl.load(logit_ptr + t * stride_logit).to(tl.float32)
            # NOTE: rounded to the model dtype like `gated_add`'s sigmoid
            pw = tl.sigmoid(logit).to(out_ptr.dtype.element_ty).to(tl.float32)
            w13 = sw13_ptr
            s13 = ss13_ptr
            g13 = sg13_ptr
            w2 = sw2_ptr
            s2 = ss2_ptr
            g2 = sg2_ptr
    # the first down step's words and scales, in flight during gate_up
    offs_h = tl.arange(0, BLOCK_H)
    cols = f0 // 16 + tl.arange(0, NW)  # [NW] words of the chunk in a down row
    v_next = tl.load(w2 + offs_h[:, None] * FB + cols[None, :], mask=offs_h[:, None] < H,
                     other=0)
    raw_next = tl.load(s2 + offs_h[:, None] * FB + cols[None, :], mask=offs_h[:, None] < H,
                       other=0)
    # 1. gate_up of the chunk: gate row f and up row F + f interleaved in one tile
    x_row = x_ptr + t * stride_xm
    jj = tl.arange(0, 2 * BLOCK_F)
    f = f0 + jj // 2
    half = jj % 2  # 0 = gate, 1 = up
    if IS_H2:
        acc = _fp4_rows_dot_h2(x_row, w13, s13, f + half * F, f < F, KB, 0, KB, 2 * BLOCK_F,
                               BLOCK_B, False, 2, USE_ASM)
    else:
        acc, _a1, _a2, _a3 = _fp4_rows_dot(x_row, 0, 1, w13, s13, f + half * F, f < F, KB, 0,
                                           KB, 1, 2 * BLOCK_F, BLOCK_B, False)
    acc = acc * (tl.load(g13 + half) * FP4_UNIT_C)
    g, u = tl.split(tl.reshape(acc, [BLOCK_F, 2]))
    hm = tl.reshape(g * tl.sigmoid(g) * u * X_PRESCALE_C, [NW, 16])  # [NW, 16] fp32
    # 2-3. down over the chunk's columns, BLOCK_H rows per step, added into acc[t]
    factor = pw * tl.load(g2) * FP4_UNIT_C
    acc_row = acc_ptr + t * H
    for h0 in range(0, H, BLOCK_H):
        v = v_next
        raw = raw_next
        nrows = h0 + BLOCK_H + offs_h
        nmask = nrows[:, None] < H
        v_next = tl.load(w2 + nrows[:, None] * FB + cols[None, :], mask=nmask, other=0)
        raw_next = tl.load(s2 + nrows[:, None] * FB + cols[None, :], mask=nmask, other=0)
        part = _down_tile(v, raw, hm)  # [BLOCK_H]
        rows = h0 + offs_h
        if IS_FIXED:  # int64 acc: order-independent sum
            tl.atomic_add(acc_row + rows, (part * factor * FIXED_ONE_C).to(tl.int64),
                          mask=rows < H, sem="relaxed")
        else:
            tl.atomic_add(acc_row + rows, part * factor, mask=rows < H, sem="relaxed")
    # 4. the last program of token t writes its row and clears the workspace
    # NOTE: the barrier orders this CTA's adds before the release of the counter increment
    tl.debug_barrier()
    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel")
    if arrived == KP * (F // BLOCK_F) - 1:
        offs = tl.arange(0, FINISH_BLOCK)
        for c0 in range(0, H, FINISH_BLOCK):
            r = c0 + offs
            m = r < H
            a = tl.load(acc_row + r, mask=m, other=0, cache_modifier=".cg")
            s = a.to(tl.float32)
            if IS_FIXED:
                s = s * (1.0 / FIXED_ONE_C)
            tl.store(out_ptr + t * H + r, s.to(out_ptr.dtype.element_ty), mask=m)
            tl.store(acc_row + r, tl.zeros_like(a), mask=m)
        tl.store(cnt_ptr + t, 0)

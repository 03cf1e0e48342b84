"""Persistent NVFP4 gemv (M = 1..4, "h2" decode): a fixed grid of programs loops over row tiles.

The one-tile-per-program gemv (`nvfp4_triton.nvfp4_gemv_kernel`) loads a whole tile, then
decodes it: a program's loads never overlap its own math, and with ~3 programs per SM the
memory and the math of the SM overlap only partly. Here the grid is `SMs x programs per SM`;
each program
- computes the power-of-two scale of each row of x once, and (HOIST_X) the fp16x2 x words of
  the whole K range once, held in registers for every tile (the old kernel rebuilds them per
  tile: ~1.6 of its ~5 instructions per weight);
- walks the row tiles t = pid, pid + G, ... (G programs); PREFETCH loads tile t + G's code
  words and scales into registers before tile t is decoded, so they arrive during its math;
  NUM_STAGES > 1 lets Triton's loop pipeliner stage them through shared memory instead;
- decodes each tile once for all BLOCK_M (1, 2 or 4) rows of x (rows past M repeat row M - 1;
  their outputs are not stored).

One K step per tile: BLOCK_B (blocks of 16 inputs) covers K. Same numerics as the "h2" gemv
(`nvfp4_triton._fp4_rows_dot_h2`); the interpreter runs its fp32 emulation (USE_ASM False).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.nvfp4_triton import (
    _bcast,
    _e4m3,
    _h2_dot8,
    _h2_pair,
    _h2_x_pair,
    _h2_x_scale,
)


@triton.jit
def _h2_x_words(x_row, blk, ok, xs):
    # the 8 fp16x2 words of x * xs over blocks `blk` in `_h2_dot8` order, [1, BB] each
    xk = x_row + blk * 16
    return (_h2_x_pair(xk, 0, 4, 1, ok, xs)[None, :], _h2_x_pair(xk, 1, 5, 1, ok, xs)[None, :],
            _h2_x_pair(xk, 2, 6, 1, ok, xs)[None, :], _h2_x_pair(xk, 3, 7, 1, ok, xs)[None, :],
            _h2_x_pair(xk, 8, 12, 1, ok, xs)[None, :], _h2_x_pair(xk, 9, 13, 1, ok, xs)[None, :],
            _h2_x_pair(xk, 10, 14, 1, ok, xs)[None, :],
            _h2_x_pair(xk, 11, 15, 1, ok, xs)[None, :])


@triton.jit
def _h2_row_out(q, xw, scale, inv_xs, factor, out_row, rows, store_mask, USE_ASM: tl.constexpr):
    # out_row[rows] = factor * sum_k x * W for one row of x: q = the tile's 8 decoded weight
    # words [BN, BB], xw = that row's 8 x words [1, BB], scale = the e4m3 block scales
    p = _h2_dot8(q[0], q[1], q[2], q[3], q[4], q[5], q[6], q[7],
                 _bcast(xw[0], q[0]), _bcast(xw[1], q[0]), _bcast(xw[2], q[0]),
                 _bcast(xw[3], q[0]), _bcast(xw[4], q[0]), _bcast(xw[5], q[0]),
                 _bcast(xw[6], q[0]), _bcast(xw[7], q[0]), USE_ASM)  # [BN, BB] fp32
    acc = tl.sum(p * scale, axis=1) * (inv_xs * factor)  # [BN]
    tl.store(out_row + rows, acc.to(out_row.dtype.element_ty), mask=store_mask)


@triton.jit
def _load_tile(w_ptr, s_ptr, rows, N, KB, blk, ok):
    # code words (int64, one per block of 16) and e4m3 scale bytes of `rows`, [BN, BB] each
    mask = (rows < N)[:, None] & ok[None, :]
    off = rows.to(tl.int64)[:, None] * KB + blk[None, :]
    return tl.load(w_ptr + off, mask=mask, other=0), tl.load(s_ptr + off, mask=mask, other=0)


@triton.jit
def nvfp4_gemv_persistent_kernel(x_ptr, w_ptr, s_ptr, out_ptr, factor, M, N, KB, stride_xm,
                                 num_tiles, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                                 BLOCK_B: tl.constexpr, VEC: tl.constexpr,
                                 PREFETCH: tl.constexpr, HOIST_X: tl.constexpr,
                                 NUM_STAGES: tl.constexpr, USE_ASM: tl.constexpr):
    # out[m, n] = factor * sum_k x[m, k] * W[n, k] for m < M <= BLOCK_M, tiles of BLOCK_N rows
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs_n = tl.arange(0, BLOCK_N)
    blk = tl.max_contiguous(tl.arange(0, BLOCK_B), VEC)  # [BB]: the whole K (KB <= BB)
    ok = blk < KB
    # NOTE: x rows past M read row M - 1 (valid memory, no masks); their stores are masked
    x_r0 = x_ptr
    x_r1 = x_ptr + tl.minimum(1, M - 1).to(tl.int64) * stride_xm
    x_r2 = x_ptr + tl.minimum(2, M - 1).to(tl.int64) * stride_xm
    x_r3 = x_ptr + tl.minimum(3, M - 1).to(tl.int64) * stride_xm
    xs0, inv0 = _h2_x_scale(x_r0, 0, KB, BLOCK_B)
    if HOIST_X:
        xw0 = _h2_x_words(x_r0, blk, ok, xs0)
    if BLOCK_M > 1:
        xs1, inv1 = _h2_x_scale(x_r1, 0, KB, BLOCK_B)
        if HOIST_X:
            xw1 = _h2_x_words(x_r1, blk, ok, xs1)
    if BLOCK_M > 2:
        xs2, inv2 = _h2_x_scale(x_r2, 0, KB, BLOCK_B)
        xs3, inv3 = _h2_x_scale(x_r3, 0, KB, BLOCK_B)
        if HOIST_X:
            xw2 = _h2_x_words(x_r2, blk, ok, xs2)
            xw3 = _h2_x_words(x_r3, blk, ok, xs3)
    if PREFETCH:
        v, raw = _load_tile(w_ptr, s_ptr, pid * BLOCK_N + offs_n, N, KB, blk, ok)
    for t in tl.range(pid, num_tiles, step, num_stages=NUM_STAGES):
        rows = t * BLOCK_N + offs_n  # [BN]
        if PREFETCH:
            cur_v = v
            cur_raw = raw
            # NOTE: the next tile's loads go out before this tile's math (past the last tile
            # every row is masked: no memory traffic)
            v, raw = _load_tile(w_ptr, s_ptr, rows + step * BLOCK_N, N, KB, blk, ok)
        else:
            cur_v, cur_raw = _load_tile(w_ptr, s_ptr, rows, N, KB, blk, ok)
        if not HOIST_X:
            xw0 = _h2_x_words(x_r0, blk, ok, xs0)
            if BLOCK_M > 1:
                xw1 = _h2_x_words(x_r1, blk, ok, xs1)
            if BLOCK_M > 2:
                xw2 = _h2_x_words(x_r2, blk, ok, xs2)
                xw3 = _h2_x_words(x_r3, blk, ok, xs3)
        lo = cur_v.to(tl.uint32)  # inputs 16b + 0..7
        hi = (cur_v >> 32).to(tl.uint32)  # inputs 16b + 8..15
        q = (_h2_pair(lo, 0), _h2_pair(lo, 1), _h2_pair(lo, 2), _h2_pair(lo, 3),
             _h2_pair(hi, 0), _h2_pair(hi, 1), _h2_pair(hi, 2), _h2_pair(hi, 3))
        scale = _e4m3(cur_raw)  # [BN, BB]
        row_ok = rows < N
        zero = rows * 0  # NOTE: vector masks only (the interpreter rejects scalars)
        _h2_row_out(q, xw0, scale, inv0, factor, out_ptr, rows, row_ok, USE_ASM)
        if BLOCK_M > 1:
            _h2_row_out(q, xw1, scale, inv1, factor, out_ptr + N, rows, row_ok & (zero + 1 < M),
                        USE_ASM)
        if BLOCK_M > 2:
            _h2_row_out(q, xw2, scale, inv2, factor, out_ptr + 2 * N, rows,
                        row_ok & (zero + 2 < M), USE_ASM)
            _h2_row_out(q, xw3, scale, inv3, factor, out_ptr + 3 * N, rows,
                        row_ok & (zero + 3 < M), USE_ASM)

def persistent_grid(num_tiles: int, sms: int, programs_per_sm: int) -> int:
    """Programs of the persistent gemv: programs_per_sm per SM, at most one per tile."""
    return max(1, min(num_tiles, sms * programs_per_sm))

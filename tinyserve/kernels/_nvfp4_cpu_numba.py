"""The numba code of `kernels.nvfp4_cpu` (imported on its first use: numba is imported here).

Arrays: x [N, H] fp32, rows [N, k] int64 (-1: skipped), wts [N, k] fp32; the store's fields
w13 uint8 [R, 2F, H/2], s13 uint8 [R, 2F, H/16], g13 fp32 [R, 2], w2 uint8 [R, H, F/2],
s2 uint8 [R, H, F/16], g2 fp32 [R]; out [N, H] fp32; e4 fp32 [256] (E4M3 values).
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.extending import intrinsic
from numba.np.ufunc.parallel import _launch_threads

RB = 32  # rows per work item: kernels.nvfp4_cpu.ROW_BLOCK
DW = 19  # descriptor words: kernels.nvfp4_cpu.DESC_WORDS


@intrinsic
def _e2m1(typingctx, code):
    """fp32 value of the E2M1 code in the low 4 bits of a uint32, in 32-bit integer lanes:
    magnitude m >= 2 is exactly the fp32 with bits (m << 22) + 0x3F000000; m = 0 and 1 are
    0 and 0.5 (bits m * 0x3F000000); the sign is bit 3."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)

        def k(v: int) -> ir.Constant:
            return ir.Constant(i32, v)

        c = args[0]
        m = builder.and_(c, k(7))
        big = builder.add(builder.shl(m, k(22)), k(0x3F000000))
        small = builder.mul(m, k(0x3F000000))
        bits = builder.select(builder.icmp_unsigned(">=", m, k(2)), big, small)
        sign = builder.shl(builder.and_(c, k(8)), k(28))
        return builder.bitcast(builder.or_(bits, sign), ir.FloatType())

    return sig, codegen


@intrinsic
def _addr(typingctx, ptr):
    sig = types.int64(types.voidptr)

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return sig, codegen


def _typed_ptr(dtype):
    @intrinsic
    def ptr(typingctx, addr):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return ptr


@intrinsic
def _call_i32(typingctx, addr, value):
    """`int f(int)` at address `addr` called with `value` (numba's threading-layer setters,
    reached through addresses passed in: a cached function may not hold their ctypes
    objects)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = builder.inttoptr(args[0], ir.FunctionType(i32, [i32]).as_pointer())
        return builder.sext(builder.call(fn, [builder.trunc(args[1], i32)]), ir.IntType(64))

    return sig, codegen


_ptr_f32 = _typed_ptr(types.float32)
_ptr_i32 = _typed_ptr(types.int32)
_ptr_i64 = _typed_ptr(types.int64)
_ptr_u8 = _typed_ptr(types.uint8)


@njit(inline="always", fastmath=True)
def _decode_row(codes, scales, scale, e4, lo, hi):
    """lo[i], hi[i] = the weights of inputs 2i and 2i + 1 of one row, times `scale`."""
    for blk in range(scales.shape[0]):
        s = e4[scales[blk]] * scale
        for i in range(blk * 8, blk * 8 + 8):
            b = np.uint32(codes[i])
            lo[i] = _e2m1(b & np.uint32(15)) * s
            hi[i] = _e2m1(b >> np.uint32(4)) * s


@njit(inline="always", fastmath=True)
def _dot2(lo, hi, xe, xo):
    acc = np.float32(0.0)
    for i in range(lo.shape[0]):
        acc += lo[i] * xe[i] + hi[i] * xo[i]
    return acc


@njit(inline="always", fastmath=True)
def _dot_row(codes, scales, scale, e4, xe, xo):
    """One row's dot with the deinterleaved input, decoded on the fly: each block's products
    are summed unscaled and its scale applied once (what a row used by one pair takes: no
    decoded copy of the row is written and read back)."""
    acc = np.float32(0.0)
    for blk in range(scales.shape[0]):
        a = np.float32(0.0)
        for i in range(blk * 8, blk * 8 + 8):
            b = np.uint32(codes[i])
            a += _e2m1(b & np.uint32(15)) * xe[i] + _e2m1(b >> np.uint32(4)) * xo[i]
        acc += e4[scales[blk]] * a
    return acc * scale


@njit(parallel=True, fastmath=True, nogil=True, cache=True, error_model="numpy")
def moe(x, rows, wts, w13, s13, g13, w2, s2, g2, out, e4, threads, setters):
    """Every pair's expert (module docstring of kernels.nvfp4_cpu) on `threads` threads
    (`setters`: the addresses of numba's set_num_threads and set_parallel_chunksize);
    returns the number of distinct experts computed."""
    n, topk = rows.shape
    h = x.shape[1]
    f = w2.shape[2] * 2
    # pairs with a row, grouped by row (ascending; stable within a row)
    flat = rows.reshape(-1)
    order = np.argsort(flat, kind="mergesort")
    first = 0
    while first < order.shape[0] and flat[order[first]] < 0:
        first += 1
    pairs = order[first:]
    npairs = pairs.shape[0]
    starts = np.zeros(npairs + 1, np.int64)  # group u = pairs[starts[u]:starts[u + 1]]
    groups = 0
    for p in range(npairs):
        if p == 0 or flat[pairs[p]] != flat[pairs[p - 1]]:
            starts[groups] = p
            groups += 1
    starts[groups] = npairs
    if groups == 0:
        out[:] = 0.0
        return 0
    _call_i32(setters[0], threads)
    # work items handed out one at a time: a thread the OS preempts (the engine's own threads
    # share the cores) delays one item, not a fixed share of the call
    chunk = _call_i32(setters[1], 1)
    # x deinterleaved: even / odd inputs [N, H/2]
    xe = np.empty((n, h // 2), np.float32)
    xo = np.empty((n, h // 2), np.float32)
    for t in range(n):
        for i in range(h // 2):
            xe[t, i] = x[t, 2 * i]
            xo[t, i] = x[t, 2 * i + 1]
    gu = np.empty((npairs, 2 * f), np.float32)  # gate | up of each pair (in `pairs` order)
    nb1 = 2 * f // RB
    for item in prange(groups * nb1):
        u = item // nb1
        o0 = (item % nb1) * RB
        r = flat[pairs[starts[u]]]
        if starts[u + 1] - starts[u] == 1:  # one pair: dot each row as it is decoded
            p, t = starts[u], pairs[starts[u]] // topk
            for o in range(o0, o0 + RB):
                gu[p, o] = _dot_row(w13[r, o], s13[r, o], g13[r, o // f], e4, xe[t], xo[t])
        else:  # several pairs: decode each row once
            lo = np.empty(h // 2, np.float32)
            hi = np.empty(h // 2, np.float32)
            for o in range(o0, o0 + RB):
                _decode_row(w13[r, o], s13[r, o], g13[r, o // f], e4, lo, hi)
                for p in range(starts[u], starts[u + 1]):
                    t = pairs[p] // topk
                    gu[p, o] = _dot2(lo, hi, xe[t], xo[t])
    he = np.empty((npairs, f // 2), np.float32)  # silu(gate) * up, deinterleaved
    ho = np.empty((npairs, f // 2), np.float32)
    for p in range(npairs):
        for i in range(f):
            g = gu[p, i]
            v = g / (np.float32(1.0) + np.exp(-g)) * gu[p, f + i]
            if i % 2 == 0:
                he[p, i // 2] = v
            else:
                ho[p, i // 2] = v
    for item in prange(h // RB):
        lo = np.empty(f // 2, np.float32)
        hi = np.empty(f // 2, np.float32)
        acc = np.zeros(n, np.float32)
        for o in range(item * RB, item * RB + RB):
            acc[:] = 0.0
            for u in range(groups):
                r = flat[pairs[starts[u]]]
                if starts[u + 1] - starts[u] == 1:
                    q = pairs[starts[u]]
                    acc[q // topk] += wts.reshape(-1)[q] * _dot_row(
                        w2[r, o], s2[r, o], g2[r], e4, he[starts[u]], ho[starts[u]])
                    continue
                _decode_row(w2[r, o], s2[r, o], g2[r], e4, lo, hi)
                for p in range(starts[u], starts[u + 1]):
                    q = pairs[p]
                    acc[q // topk] += wts.reshape(-1)[q] * _dot2(lo, hi, he[p], ho[p])
            for t in range(n):
                out[t, o] = acc[t]
    _call_i32(setters[1], chunk)
    return groups


def _e4m3_values() -> np.ndarray:
    """fp32 [256]: every E4M3 bit pattern's value (specs/nvfp4.md §1; NaN for 0x7F / 0xFF)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8) * 2.0 ** (e - 7.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


_E4M3 = _e4m3_values()
# NOTE: the threading layer first: a cached `entry` (it calls the parallel `moe`) links
# against its scheduler symbols when loaded.
_launch_threads()


@cfunc(types.void(types.voidptr), nopython=True, cache=True)
def entry(desc):
    """`void entry(void *descriptor)`: kernels.nvfp4_cpu.host_descriptor's layout."""
    d = carray(_ptr_i64(_addr(desc)), (DW,))
    n, topk, base = d[2], d[3], d[4]
    nrows, h, f = d[11], d[12], d[13]
    width = h + 2 * topk
    stage_f = carray(_ptr_f32(d[0]), (n, width))
    stage_i = carray(_ptr_i32(d[0]), (n, width))
    out = carray(_ptr_f32(d[1]), (n, h))
    w13 = carray(_ptr_u8(d[5]), (nrows, 2 * f, h // 2))
    s13 = carray(_ptr_u8(d[6]), (nrows, 2 * f, h // 16))
    g13 = carray(_ptr_f32(d[7]), (nrows, 2))
    w2 = carray(_ptr_u8(d[8]), (nrows, h, f // 2))
    s2 = carray(_ptr_u8(d[9]), (nrows, h, f // 16))
    g2 = carray(_ptr_f32(d[10]), (nrows,))
    x = np.empty((n, h), np.float32)
    rows = np.empty((n, topk), np.int64)
    wts = np.empty((n, topk), np.float32)
    for t in range(n):
        for i in range(h):
            x[t, i] = stage_f[t, i]
        for j in range(topk):
            r = stage_i[t, h + j]
            rows[t, j] = r + base if r >= 0 else -1
            wts[t, j] = stage_f[t, h + topk + j]
    e4 = np.empty(256, np.float32)  # (a writable array: the same `moe` as Python calls)
    e4[:] = _E4M3
    setters = np.empty(2, np.int64)
    setters[0], setters[1] = d[17], d[18]
    d[14] += moe(x, rows, wts, w13, s13, g13, w2, s2, g2, out, e4, d[16], setters)
    d[15] += 1


def build(row_block: int, desc_words: int) -> SimpleNamespace:
    """The compiled kernels: `moe`, the E4M3 table it takes and the C entry's address."""
    if row_block != RB or desc_words != DW:
        raise ValueError("kernels.nvfp4_cpu and its numba code disagree on their constants")
    from numba.np.ufunc import parallel

    setters = np.array([ctypes.cast(f, ctypes.c_void_p).value for f in
                        (parallel._set_num_threads, parallel._set_parallel_chunksize)], np.int64)
    return SimpleNamespace(moe=moe, e4m3=_E4M3.copy(), entry_address=entry.address,
                           read_sum=read_sum, setters=setters)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def read_sum(words):
    """Sum of uint64 words [n] read by every thread (a host read-bandwidth probe)."""
    chunks = 256
    per = (words.shape[0] + chunks - 1) // chunks
    part = np.zeros(chunks, np.uint64)
    for c in prange(chunks):
        acc = np.uint64(0)
        for i in range(c * per, min(words.shape[0], (c + 1) * per)):
            acc += words[i]
        part[c] = acc
    return part.sum()

"""The numba code of `cpu.py` (imported on first use): the pool's thread loops and the work
they share (the LLVM IR it calls: `cpu_ir.py`). Store arrays (descriptor words): w13 uint8
[R, 2F, H/2], s13 [R, 2F, H/16], g13 fp32 [R, 2], w2 uint8 [R, H, F/2], s2 [R, H, F/16],
g2 fp32 [R]; per call: x [N, H] fp32 (quantized to xq int8 [N, H], xs fp32 [N, H/16]), the
pairs' rows [N * k] int64 (-1: skipped) and weights [N * k] fp32, out [N, H] fp32."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from numba import carray, cfunc, njit, types

from tinyserve.kernels.moe.cpu_ir import (
    addr,
    call_i32,
    dot,
    fetch_add,
    load_acquire_i32,
    load_acquire_i64,
    pause,
    ptr_f32,
    ptr_i8,
    ptr_i32,
    ptr_i64,
    ptr_u8,
    store_release_i32,
    store_release_i64,
)

RB = 32  # rows per work item: kernels.moe.cpu.ROW_BLOCK
DW = 17  # descriptor words: kernels.moe.cpu.DESC_WORDS


@njit(nogil=True, cache=True, error_model="numpy")
def _quantize(x, q, s, first, end):
    """x fp32 [K] -> q int8 [K], s fp32 [K/16], blocks `first` to `end` - 1 of 16 inputs: per
    block s = max|x| / 127 and q = round(x * 127 / max|x|), stored per chunk of 64 inputs as
    its 32 even inputs then its 32 odd ones (the order the dot splits the code bytes in). Not
    fast-math: the torch reference rounds the same way."""
    for blk in range(first, end):
        amax = np.float32(0.0)
        for i in range(blk * 16, blk * 16 + 16):
            amax = max(amax, abs(x[i]))
        s[blk] = amax / np.float32(127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        base = (blk // 4) * 64 + (blk % 4) * 8
        for j in range(8):
            q[base + j] = np.int8(np.round(x[blk * 16 + 2 * j] * inv))
            q[base + 32 + j] = np.int8(np.round(x[blk * 16 + 2 * j + 1] * inv))


def _e4m3_values() -> np.ndarray:
    """fp32 [256]: every E4M3 bit pattern's value (specs/nvfp4.md §1; NaN for 0x7F / 0xFF)."""
    b = np.arange(256)
    e, m = (b >> 3) & 15, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0**-9, (1.0 + m / 8) * 2.0 ** (e - 7.0))
    mag = np.where((b & 0x7F) == 0x7F, np.nan, mag)
    return np.where(b & 0x80, -mag, mag).astype(np.float32)


_E4M3 = _e4m3_values()

# The pool's shared words (int64; each field on its own 64-byte line): the call generation,
# the two phases' work-item counters, items of phase 1 done, the stop request, the call record
# (written by the leader before it publishes a generation, read-only during the call), then
# per thread the last generation it finished.
P_GEN, P_NEXT1, P_DONE1, P_NEXT2, P_STOP, P_CALL, P_FIN = 0, 8, 16, 24, 32, 40, 64
(C_DESC, C_THREADS, C_XQ, C_XS, C_HID, C_HQ, C_HS, C_FLAT, C_WTS, C_PAIRS, C_STARTS, C_GROUPS,
 C_NPAIRS) = range(13)


def pool_words(threads: int) -> int:
    return P_FIN + 8 * threads


@njit(nogil=True, cache=True)
def _weights(d):
    """The store's arrays named by descriptor words `d` (kernels.moe.cpu.host_descriptor)."""
    nrows, h, f = d[11], d[12], d[13]
    return (carray(ptr_u8(d[5]), (nrows, 2 * f, h // 2)),
            carray(ptr_u8(d[6]), (nrows, 2 * f, h // 16)),
            carray(ptr_f32(d[7]), (nrows, 2)),
            carray(ptr_u8(d[8]), (nrows, h, f // 2)),
            carray(ptr_u8(d[9]), (nrows, h, f // 16)),
            carray(ptr_f32(d[10]), (nrows,)))


@njit(nogil=True, fastmath=True, cache=True, error_model="numpy")
def _work(pool, tid):
    """Thread `tid`'s part of the published call: work items taken one at a time (a thread
    the OS preempts delays one item, not a share of the call). Phase 1, per expert and block
    of RB hidden units: their gate and up rows, silu(gate) * up, rounded as x is (whole scale
    blocks: RB % 16 == 0). Phase 2, once every phase-1 item is done, per block of RB output
    rows: the down rows of every pair, summed in a fixed order (the same bits for any thread
    count)."""
    c = carray(ptr_i64(pool + 8 * P_CALL), (16,))
    d = carray(ptr_i64(c[C_DESC]), (DW,))
    w13, s13, g13, w2, s2, g2 = _weights(d)
    n, topk, h, f = d[2], d[3], d[12], d[13]
    groups, npairs = c[C_GROUPS], c[C_NPAIRS]
    out = carray(ptr_f32(d[1]), (n, h))
    xq = carray(ptr_i8(c[C_XQ]), (n, h))
    xs = carray(ptr_f32(c[C_XS]), (n, h // 16))
    hid = carray(ptr_f32(c[C_HID]), (npairs, f))
    hq = carray(ptr_i8(c[C_HQ]), (npairs, f))
    hs = carray(ptr_f32(c[C_HS]), (npairs, f // 16))
    flat = carray(ptr_i64(c[C_FLAT]), (n * topk,))
    wts = carray(ptr_f32(c[C_WTS]), (n * topk,))
    pairs = carray(ptr_i64(c[C_PAIRS]), (npairs,))
    starts = carray(ptr_i64(c[C_STARTS]), (groups + 1,))
    nb1 = f // RB
    mine = 0  # phase-1 items done here, counted once when the phase runs out of items
    while True:
        item = fetch_add(pool + 8 * P_NEXT1, 1)
        if item >= groups * nb1:
            break
        mine += 1
        u = item // nb1
        r = flat[pairs[starts[u]]]
        first = item % nb1 * RB
        g_gate, g_up = g13[r, 0] * np.float32(0.5), g13[r, 1] * np.float32(0.5)
        for o in range(first, first + RB):
            for p in range(starts[u], starts[u + 1]):
                t = pairs[p] // topk
                g = dot(w13[r, o], s13[r, o], _E4M3, xq[t], xs[t]) * g_gate
                up = dot(w13[r, f + o], s13[r, f + o], _E4M3, xq[t], xs[t]) * g_up
                hid[p, o] = g / (np.float32(1.0) + np.exp(-g)) * up
        for p in range(starts[u], starts[u + 1]):
            _quantize(hid[p], hq[p], hs[p], first // 16, (first + RB) // 16)
    fetch_add(pool + 8 * P_DONE1, mine)
    while load_acquire_i64(pool + 8 * P_DONE1) < groups * nb1:
        pause()
    acc = np.zeros(n, np.float32)
    while True:
        item = fetch_add(pool + 8 * P_NEXT2, 1)
        if item >= h // RB:
            break
        for o in range(item * RB, item * RB + RB):
            acc[:] = 0.0
            for u in range(groups):
                r = flat[pairs[starts[u]]]
                for p in range(starts[u], starts[u + 1]):
                    q = pairs[p]
                    acc[q // topk] += wts[q] * g2[r] * np.float32(0.5) * dot(
                        w2[r, o], s2[r, o], _E4M3, hq[p], hs[p])
            for t in range(n):
                out[t, o] = acc[t]


@njit(nogil=True, cache=True)
def _publish_and_work(pool, address, threads, xq, xs, hid, hq, hs, flat, wts, pairs, starts,
                      groups):
    """Publish the call (its arrays stay alive as this function's arguments), do thread 0's
    part and wait until every helper of the call finished its own."""
    c = carray(ptr_i64(pool + 8 * P_CALL), (16,))
    c[C_DESC], c[C_THREADS], c[C_GROUPS], c[C_NPAIRS] = address, threads, groups, hid.shape[0]
    c[C_XQ], c[C_XS], c[C_HID], c[C_HQ], c[C_HS] = (xq.ctypes.data, xs.ctypes.data,
                                                    hid.ctypes.data, hq.ctypes.data,
                                                    hs.ctypes.data)
    c[C_FLAT], c[C_WTS], c[C_PAIRS], c[C_STARTS] = (flat.ctypes.data, wts.ctypes.data,
                                                    pairs.ctypes.data, starts.ctypes.data)
    words = carray(ptr_i64(pool), (P_CALL,))
    words[P_NEXT1], words[P_DONE1], words[P_NEXT2] = 0, 0, 0
    gen = words[P_GEN] + 1
    store_release_i64(pool + 8 * P_GEN, gen)
    _work(pool, 0)
    for i in range(1, threads):
        while load_acquire_i64(pool + 8 * (P_FIN + 8 * i)) != gen:
            pause()


@njit(nogil=True, cache=True)
def _lead(pool, size, address):
    """Run the call of the descriptor at `address` (kernels.moe.cpu.host_descriptor) on the
    pool of `size` threads: read the stage, group the pairs by row, quantize x, then share
    the experts' work with the helpers."""
    d = carray(ptr_i64(address), (DW,))
    n, topk, base, h, f = d[2], d[3], d[4], d[12], d[13]
    width = h + 2 * topk
    stage_f = carray(ptr_f32(d[0]), (n, width))
    stage_i = carray(ptr_i32(d[0]), (n, width))
    flat = np.empty(n * topk, np.int64)
    wts = np.empty(n * topk, np.float32)
    for t in range(n):
        for j in range(topk):
            r = stage_i[t, h + j]
            flat[t * topk + j] = r + base if r >= 0 else -1
            wts[t * topk + j] = stage_f[t, h + topk + j]
    # pairs with a row, grouped by row (ascending; stable within a row)
    order = np.argsort(flat, kind="mergesort")
    first = 0
    while first < order.shape[0] and flat[order[first]] < 0:
        first += 1
    pairs = order[first:].copy()
    npairs = pairs.shape[0]
    starts = np.zeros(npairs + 1, np.int64)  # group u = pairs[starts[u]:starts[u + 1]]
    groups = 0
    for p in range(npairs):
        if p == 0 or flat[pairs[p]] != flat[pairs[p - 1]]:
            starts[groups] = p
            groups += 1
    starts[groups] = npairs
    d[15] += 1
    if groups == 0:
        carray(ptr_f32(d[1]), (n, h))[:] = 0.0
        return
    xq = np.empty((n, h), np.int8)
    xs = np.empty((n, h // 16), np.float32)
    for t in range(n):
        _quantize(stage_f[t, :h], xq[t], xs[t], 0, h // 16)
    hid = np.empty((npairs, f), np.float32)
    hq = np.empty((npairs, f), np.int8)
    hs = np.empty((npairs, f // 16), np.float32)
    _publish_and_work(pool, address, max(1, min(d[16], size)), xq, xs, hid, hq, hs, flat, wts,
                      pairs, starts, groups)
    d[14] += groups


@njit(nogil=True, cache=True)
def _idle(idle, usleep, spin):
    """One idle poll's wait: spin (`pause`) for `spin` polls, then sleep 50 us per poll, and
    1 ms after a further ~0.1 s (an idle server costs next to nothing)."""
    if idle < spin:
        pause()
    else:
        call_i32(usleep, 50 if idle < spin + 2000 else 1000)
    return idle + 1


@cfunc(types.void(types.voidptr), nopython=True, cache=True)
def lead(control):
    """`void lead(void *control)`: thread 0 of kernels.moe.cpu.HostWorker. Waits for a request
    (flag GO = i + 1), runs descriptor table[i] with the helpers, then answers (DONE = i + 1);
    returns on STOP. Control words: flags, table, its size, usleep, spin polls, pool, size."""
    c = carray(ptr_i64(addr(control)), (7,))
    go, done, stop = c[0], c[0] + 4, c[0] + 8
    table = carray(ptr_i64(c[1]), (c[2],))
    idle = 0
    while True:
        i = load_acquire_i32(go)
        if i > 0:
            store_release_i32(go, 0)
            _lead(c[5], c[6], table[i - 1])
            store_release_i32(done, i)
            idle = 0
        elif load_acquire_i32(stop) != 0:
            return
        else:
            idle = _idle(idle, c[3], c[4])


@cfunc(types.void(types.voidptr), nopython=True, cache=True)
def assist(control):
    """`void assist(void *control)`: helper thread `tid` of the pool. On each new generation
    it joins the call if the call runs on more than `tid` threads, then records the generation
    as finished; returns on the pool's STOP. Control words: pool, tid, usleep, spin polls."""
    c = carray(ptr_i64(addr(control)), (4,))
    pool, tid = c[0], c[1]
    seen, idle = 0, 0  # from generation 0: a thread started late still joins the first call
    while True:
        gen = load_acquire_i64(pool + 8 * P_GEN)
        if gen != seen:
            seen = gen
            if tid < carray(ptr_i64(pool + 8 * P_CALL), (16,))[C_THREADS]:
                _work(pool, tid)
                store_release_i64(pool + 8 * (P_FIN + 8 * tid), gen)
                idle = 0
                continue
        if load_acquire_i64(pool + 8 * P_STOP) != 0:
            return
        idle = _idle(idle, c[2], c[3])


@njit(nogil=True, cache=True)
def read_sum(words):
    """Sum of uint64 words [n] (one thread's share of the host read-bandwidth probe)."""
    acc = np.uint64(0)
    for i in range(words.shape[0]):
        acc += words[i]
    return acc


def build(row_block: int, desc_words: int) -> SimpleNamespace:
    """The compiled kernels: the pool's thread loops (addresses), a call led from Python and
    the read probe."""
    if row_block != RB or desc_words != DW:
        raise ValueError("kernels.moe.cpu and its numba code disagree on their constants")
    return SimpleNamespace(lead_address=lead.address, assist_address=assist.address,
                           lead_call=_lead, read_sum=read_sum, pool_words=pool_words,
                           P_STOP=P_STOP)

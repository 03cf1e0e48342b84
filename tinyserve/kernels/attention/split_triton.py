"""Pieces of the Triton split-K decode kernels (`iso/triton.py`, `paged_triton.py`): pass 1,
grid (splits, batch * kv heads), a program per `chunk` tokens of one (sequence, kv head) and
its GQA group (`split_program`), K/V rows through the page table (`kv_rows`), fp32 partials
[B, Hq, splits, D] and (max in base 2, sum); pass 2 (`decode_merge_kernel`) merges the splits
by log-sum-exp."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def split_program(lens_ptr, chunk, HKV: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr,
                  D: tl.constexpr):
    """Program (split, b * HKV + kvh): (split, b, kvh, its tokens [t_begin, t_end), the query
    head lanes hs [BLOCK_H] with their mask (G heads per KV head), the query rows' offsets)."""
    split = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // HKV
    kvh = bh % HKV
    seq_len = tl.load(lens_ptr + b)
    t_begin = split * chunk
    t_end = tl.minimum(seq_len, t_begin + chunk)
    hs = tl.arange(0, BLOCK_H)
    hmask = hs < G
    qrow = (b * (HKV * G) + kvh * G + hs).to(tl.int64) * D
    return split, b, kvh, t_begin, t_end, hs, hmask, qrow


@triton.jit
def kv_rows(pt_ptr, pt_stride, b, ts, tmask, page_size, slot_stride, kvh, RB: tl.constexpr):
    """Offsets (in the cache's elements: bytes of a packed ISO cache) of KV head `kvh`'s rows
    of tokens `ts` of sequence b (paged; a row is RB elements, a slot `slot_stride`)."""
    page = tl.load(pt_ptr + b.to(tl.int64) * pt_stride + ts // page_size, mask=tmask, other=0)
    return (page.to(tl.int64) * page_size + ts % page_size) * slot_stride + kvh * RB


@triton.jit
def decode_merge_kernel(part_acc_ptr, part_ml_ptr, rot_ptr, out_ptr, n_splits, out_stride_b,
                        HQ: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                        IS_ROTATED: tl.constexpr):
    """Pass 2: out[b, h] = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s over the splits.
    IS_ROTATED: the ISO kernel's accumulators, in the rotated space (inverse rotation per 4-D
    group from rot_ptr [2, 32, 4, 4], the inverse at offset 512) and field-major (element
    128b + 4g + c stored at 128b + 32c + g). D a multiple of 4 and D / 4 a power of two."""
    row = tl.program_id(0).to(tl.int64)  # b * HQ + h
    b = row // HQ
    h = row % HQ
    ss = tl.arange(0, BLOCK_S)
    mx = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        sm = tl.load(part_ml_ptr + (row * n_splits + s0 + ss) * 2, mask=s0 + ss < n_splits,
                     other=float("-inf"))
        mx = tl.maximum(mx, sm)
    big = tl.max(mx, 0)  # split 0 always holds >= 1 token, so this is finite
    G4: tl.constexpr = D // 4
    gi = tl.arange(0, G4)
    ci = tl.arange(0, 4)
    acc = tl.zeros([G4, 4], dtype=tl.float32)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    for s0 in range(0, n_splits, BLOCK_S):
        s = s0 + ss
        smask = s < n_splits
        ms = tl.load(part_ml_ptr + (row * n_splits + s) * 2, mask=smask, other=float("-inf"))
        ls = tl.load(part_ml_ptr + (row * n_splits + s) * 2 + 1, mask=smask, other=0.0)
        w = tl.where(ms > float("-inf"), tl.exp2(ms - big), 0.0)
        total += w * ls
        if IS_ROTATED:  # field-major: element 128b + 4g + c stored at 128b + 32c + g
            eoff = (gi // 32 * 128 + gi % 32)[:, None] + ci[None, :] * 32
        else:
            eoff = gi[:, None] * 4 + ci[None, :]
        a = tl.load(part_acc_ptr + (row * n_splits + s)[:, None, None] * D + eoff[None, :, :],
                    mask=smask[:, None, None], other=0.0)
        acc += tl.sum(w[:, None, None] * a, 0)
    lsum = tl.sum(total, 0)
    inv = tl.where(lsum > 0, 1.0 / lsum, 0.0)
    if IS_ROTATED:
        # inverse rotation: y[g, c] = sum_k Rinv[g % 32, c, k] * acc[g, k]
        coef = tl.load(rot_ptr + 512 + (gi % 32)[:, None, None] * 16 + ci[None, :, None] * 4
                       + ci[None, None, :])
        y = tl.sum(coef * acc[:, None, :], 2) * inv
    else:
        y = acc * inv
    optr = out_ptr + b * out_stride_b + h * D + gi[:, None] * 4 + ci[None, :]
    tl.store(optr, y.to(out_ptr.dtype.element_ty))

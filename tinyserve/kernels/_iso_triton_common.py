"""Pieces shared by the two Triton ISO decode kernels (`iso_triton._iso_decode_partial`,
`_iso_triton_fields.iso_decode_partial_fields`): what a program works on, and where the
packed K/V rows of a token tile live."""

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
    """Byte offsets of KV head `kvh`'s packed rows of tokens `ts` of sequence b (paged)."""
    page = tl.load(pt_ptr + b.to(tl.int64) * pt_stride + ts // page_size, mask=tmask, other=0)
    return (page.to(tl.int64) * page_size + ts % page_size) * slot_stride + kvh * RB

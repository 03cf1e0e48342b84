"""Paged bf16/fp16 K/V in Triton: the store and split-K decode of the bf16 KV cache (the
references and layout: `paged_ref.py`).

Decode follows `split_triton.py`: pass 1 reads a program's K/V rows in place through the page
table, S = Q @ K^T in the cache dtype (fp32 accumulation), online softmax in base 2 and
acc += P @ V with P rounded to the cache dtype; tokens past a length are never loaded (stale
pages cannot leak). The grid is sized by the host bound `max_seq_len`: no host sync (CUDA-graph
safe). Error vs fp32: <= 1e-2 * max|ref| (P's rounding)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tinyserve.kernels.attention.split import decode_splits, split_buffers
from tinyserve.kernels.attention.split_triton import decode_merge_kernel, kv_rows, split_program
from tinyserve.kernels.launch import FLOATS, check_pages, decode_output

_LOG2E = 1.4426950408889634
CACHE_DTYPES = (torch.bfloat16, torch.float16)
MAX_GROUP = 16  # query heads per kv head: one 16-row MMA tile
# Launch settings (bench/kv_decode.py sweeps them; not yet measured on a GPU).
BLOCK_T = 32
NUM_WARPS = 4
NUM_STAGES = 2
MIN_SPLIT_TOKENS = 64
CTAS_PER_SM = 4


@triton.jit
def paged_store_kernel(k_ptr, v_ptr, slots_ptr, kc_ptr, vc_ptr, stride_kn, stride_kh,
                       stride_vn, stride_vh, slot_stride, pad_slot,
                       D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    slot = tl.load(slots_ptr + n).to(tl.int64)
    slot = tl.where(slot < 0, pad_slot, slot)
    cols = tl.arange(0, D)
    dst = slot * slot_stride + h * D + cols
    k = tl.load(k_ptr + n * stride_kn + h * stride_kh + cols)
    v = tl.load(v_ptr + n * stride_vn + h * stride_vh + cols)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty))
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty))


@triton.jit
def _dot(a, b, USE_F32_DOT: tl.constexpr):
    """a @ b with fp32 accumulation; USE_F32_DOT widens the operands first (exact for
    16-bit operands): the interpreter's tl.dot is wrong on bf16 (Triton 3.9)."""
    if USE_F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    return tl.dot(a, b)


@triton.jit
def paged_decode_partial_kernel(q_ptr, k_ptr, v_ptr, slot_stride, pt_ptr, pt_stride, lens_ptr,
                                part_acc_ptr, part_ml_ptr, chunk, n_splits, page_size,
                                scale_log2, HKV: tl.constexpr, G: tl.constexpr,
                                BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                                USE_F32_DOT: tl.constexpr):
    split, b, kvh, t_begin, t_end, hs, hmask, qrow = split_program(lens_ptr, chunk, HKV, G,
                                                                   BLOCK_H, D)
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] + cols[None, :], mask=hmask[:, None], other=0.0)
    q = q.to(k_ptr.dtype.element_ty)  # [BLOCK_H, D]
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, D], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < t_end
        row = kv_rows(pt_ptr, pt_stride, b, ts, tmask, page_size, slot_stride, kvh, D)
        k = tl.load(k_ptr + row[:, None] + cols[None, :], mask=tmask[:, None], other=0.0)
        s = _dot(q, tl.trans(k), USE_F32_DOT) * scale_log2  # [BLOCK_H, BLOCK_T] fp32, base 2
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + row[:, None] + cols[None, :], mask=tmask[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, USE_F32_DOT)
        m = m_new
    prow = (b * (HKV * G) + kvh * G + hs).to(tl.int64) * n_splits + split  # [BLOCK_H]
    tl.store(part_acc_ptr + prow[:, None] * D + cols[None, :], acc, mask=hmask[:, None])
    tl.store(part_ml_ptr + prow * 2, m, mask=hmask)
    tl.store(part_ml_ptr + prow * 2 + 1, l_sum, mask=hmask)


def _check_caches(k_cache: torch.Tensor, v_cache: torch.Tensor, hkv: int | None,
                  d: int) -> None:
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 3 or c.dtype not in CACHE_DTYPES or c.stride(2) != 1 \
                or c.stride(1) != d or c.shape[2] != d or (hkv is not None and c.shape[1] != hkv):
            raise ValueError(f"{name} must be bf16/fp16 [slots, {hkv or 'Hkv'}, {d}] "
                             f"with contiguous rows, got {c.dtype} {tuple(c.shape)} strides "
                             f"{c.stride()}")
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype \
            or k_cache.stride() != v_cache.stride() or k_cache.device != v_cache.device:
        raise ValueError("k_cache and v_cache must have one shape, dtype, strides and device")


def paged_store(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                k: torch.Tensor, v: torch.Tensor, pad_slot: int) -> None:
    """`paged_ref.paged_store_ref` in one launch: k, v [N, Hkv, D] float (any row stride,
    unit head and last strides as `D, 1`), slots [N] int32/int64, caches bf16/fp16
    [slots, Hkv, D] with contiguous rows; D a power of two."""
    n, hkv, d = k.shape
    _check_caches(k_cache, v_cache, hkv, d)
    for name, t in (("k", k), ("v", v)):
        if t.shape != (n, hkv, d) or t.dtype not in FLOATS or t.stride(2) != 1 \
                or t.stride(1) != d:
            raise ValueError(f"{name} must be float [{n}, {hkv}, {d}] with contiguous heads, "
                             f"got {t.dtype} {tuple(t.shape)} strides {t.stride()}")
    if slots.shape != (n,) or slots.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slots must be int32/int64 [{n}], got {slots.dtype} "
                         f"{tuple(slots.shape)}")
    if d & (d - 1):
        raise ValueError(f"head_dim must be a power of two, got {d}")
    if not 0 <= pad_slot < k_cache.shape[0]:
        raise ValueError(f"pad_slot {pad_slot} is outside the cache's {k_cache.shape[0]} slots")
    if n:
        paged_store_kernel[(n, hkv)](k, v, slots.contiguous(), k_cache, v_cache, k.stride(0),
                                     k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0),
                                     pad_slot, D=d, num_warps=max(1, min(4, d // 64)))


def decode_supported(num_q_heads: int, num_kv_heads: int, head_dim: int,
                     dtype: torch.dtype) -> bool:
    """Whether `paged_decode_attention` takes this shape and cache dtype: a GQA group of at
    most MAX_GROUP heads, head_dim a power of two in 16 .. 256, a bf16/fp16 cache."""
    return (num_q_heads % num_kv_heads == 0 and num_q_heads // num_kv_heads <= MAX_GROUP
            and 16 <= head_dim <= 256 and not head_dim & (head_dim - 1)
            and dtype in CACHE_DTYPES)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                           scale: float, *, max_seq_len: int | None = None,
                           out: torch.Tensor | None = None, split_tokens: int | None = None,
                           block_t: int = BLOCK_T, num_warps: int = NUM_WARPS,
                           num_stages: int = NUM_STAGES, ctas_per_sm: int = CTAS_PER_SM,
                           min_split_tokens: int = MIN_SPLIT_TOKENS) -> torch.Tensor:
    """The contract of `paged_ref.paged_decode_ref` (caches with contiguous rows, int32 page
    table and lengths); `max_seq_len` sizes the split grid (None: read from seq_lens, a device
    sync), `split_tokens` forces the split. Returns [B, Hq, D] in q's dtype (or into `out`).
    Raises ValueError on shapes `decode_supported` refuses."""
    if q.dim() != 3 or q.dtype not in FLOATS:
        raise ValueError(f"q must be [B, Hq, D] float, got {q.dtype} {tuple(q.shape)}")
    b, hq, d = q.shape
    hkv = k_cache.shape[1] if k_cache.dim() == 3 else 0
    _check_caches(k_cache, v_cache, None, d)
    if not decode_supported(hq, hkv, d, k_cache.dtype):
        raise ValueError(f"unsupported decode shape: {hq} query heads over {hkv} kv heads "
                         f"(at most {MAX_GROUP} per kv head), head_dim {d} (a power of two "
                         f"in 16 .. 256)")
    check_pages(page_table, seq_lens, b)
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    out = decode_output(out, q, b, hq, d)
    if b == 0:
        return out
    chunk, splits = decode_splits(q, seq_lens, hkv, max_seq_len, split_tokens,
                                  split_tile=block_t, min_tokens=min_split_tokens,
                                  ctas_per_sm=ctas_per_sm, tile=block_t)
    part_acc, part_ml = split_buffers(q, splits)
    paged_decode_partial_kernel[(splits, b * hkv)](
        q.contiguous(), k_cache, v_cache, k_cache.stride(0), page_table,
        page_table.stride(0), seq_lens.contiguous(), part_acc, part_ml, chunk, splits,
        page_size, float(scale) * _LOG2E, HKV=hkv, G=hq // hkv, BLOCK_H=16, D=d,
        BLOCK_T=block_t, USE_F32_DOT=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=num_warps, num_stages=num_stages)
    decode_merge_kernel[(b * hq,)](
        part_acc, part_ml, part_ml, out, splits, out.stride(0), HQ=hq, D=d,
        BLOCK_S=max(2, min(16, triton.next_power_of_2(splits))), IS_ROTATED=False,
        num_warps=4)
    return out

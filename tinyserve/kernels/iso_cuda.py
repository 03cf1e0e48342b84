"""ISO3/ISO4 CUDA kernels: launchers that check shapes and dtypes.

The kernels live in `csrc/iso_store.cu` and `csrc/iso_decode_mma.cu` (device code only);
`cuda_launch` compiles each instance with NVRTC at first use (cached in TINYSERVE_CACHE_DIR)
and launches it on torch's current stream, so the launches can be captured in CUDA graphs.
Nothing here runs at import.

- `iso_store`: quantize-on-write, byte-exact with `iso.quantize_ref`.
- `iso_dequant_rows`: packed rows -> dense rows (bit-exact with `iso.dequantize_ref` in fp32).
- the split-K plan and partial buffers of the decode kernels (`plan_splits`, `decode_splits`,
  `split_buffers`) and their shared input checks (`_check_decode`); the ISO3 tensor-core
  decode is in `iso_mma`, the Triton decode (iso4, wide GQA groups) in `iso_triton`.
The extend attention that uses `iso_dequant_rows` is in `iso_extend`.
"""

from __future__ import annotations

import ctypes
import math

import torch

from tinyserve.kernels import cuda_launch
from tinyserve.kernels.cuda_launch import I64, F, I, ptr
from tinyserve.kernels.iso import BLOCK, FORMATS, packed_row_bytes
from tinyserve.kernels.launch import FLOATS, cdiv, check_pages

STORE = "iso_store.cu"
_BITS = {"iso3": 3, "iso4": 4}
# the kernels' element types of fp32 / bf16 / fp16 tensors (csrc/prelude.cuh)
CTYPE = {torch.float32: "float", torch.bfloat16: "ts::bf16", torch.float16: "ts::f16"}
# `plan_splits` defaults: splits of whole 32-token tiles, at least 256 tokens each
_TILE = 32
MIN_SPLIT_TOKENS = 256
STORE_WARPS = 4  # csrc/iso_store.cu kStoreWarps


def scale_log2(scale: float) -> ctypes.c_float:
    """scale * log2(e) rounded as the kernels' fp32 product (scores in exp2 units)."""
    return F(F(scale).value * F(1.4426950408889634).value)


def format_bits(fmt: str) -> int:
    """The bits per index of an ISO format; ValueError for an unknown one."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown ISO format {fmt!r}; expected one of {FORMATS}")
    return _BITS[fmt]


def _check_cache(cache: torch.Tensor, heads: int, head_dim: int, fmt: str, name: str) -> None:
    rb = packed_row_bytes(head_dim, fmt)
    if cache.dtype != torch.uint8 or cache.dim() != 3 or tuple(cache.shape[1:]) != (heads, rb):
        raise ValueError(f"{name} must be uint8 [slots, {heads}, {rb}], got {cache.dtype} "
                         f"{tuple(cache.shape)}")
    if cache.stride(2) != 1 or cache.stride(1) != rb:
        raise ValueError(f"{name} rows must be contiguous (strides {cache.stride()})")


def iso_store(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, fmt: str) -> None:
    """Quantize k, v [N, H, D] (fp32 / bf16 / fp16) into the caches at slots loc [N] (int32
    or int64), all on one CUDA device. Caches: uint8 [slots, H, row_bytes]. Raises ValueError
    on bad input."""
    bits = format_bits(fmt)
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.dtype not in FLOATS:
        raise ValueError(f"k and v must be [N, H, D] of one float dtype, got {k.dtype} "
                         f"{tuple(k.shape)} and {v.dtype} {tuple(v.shape)}")
    n, heads, d = k.shape
    _check_cache(k_cache, heads, d, fmt, "k_cache")
    _check_cache(v_cache, heads, d, fmt, "v_cache")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("k_cache and v_cache must have the same slot stride")
    if loc.dtype not in (torch.int32, torch.int64) or loc.shape != (n,):
        raise ValueError(f"loc must be int32/int64 [{n}], got {loc.dtype} {tuple(loc.shape)}")
    if any(t.device != k_cache.device for t in (v_cache, loc, k, v)):
        raise ValueError(f"the caches, loc, k and v must be on {k_cache.device}")
    if n == 0:
        return
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()
    loc = loc.contiguous()
    be = cuda_launch.backend(k.device)
    idx = "int64_t" if loc.dtype == torch.int64 else "int32_t"
    kern = be.kernel(STORE, f"iso::store_kernel<{bits}, {CTYPE[k.dtype]}, {idx}>")
    kern.launch((cdiv(n * heads * 2, STORE_WARPS),), 32 * STORE_WARPS,
                (ptr(k_cache), ptr(v_cache), I64(k_cache.stride(0)), ptr(k), ptr(v),
                 I64(k.stride(0)), I64(v.stride(0)), ptr(loc), I(n), I(heads), I(d // BLOCK)),
                stream=be.stream())


def iso_dequant_rows(cache: torch.Tensor, slots: torch.Tensor, fmt: str, head_dim: int,
                     dtype: torch.dtype = torch.bfloat16, *, head_major: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed rows at slots [M] -> [M, H, head_dim] of `dtype` ([H, M, head_dim] with
    head_major=True, the layout attention kernels want). `out`: write there instead (that
    shape and dtype, rows and heads at any stride, the last dimension contiguous)."""
    bits = format_bits(fmt)
    heads = cache.shape[1]
    _check_cache(cache, heads, head_dim, fmt, "cache")
    if dtype not in FLOATS:
        raise ValueError(f"dtype must be one of {FLOATS}, got {dtype}")
    m = slots.numel()
    shape = (heads, m, head_dim) if head_major else (m, heads, head_dim)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=cache.device)
    elif (tuple(out.shape) != shape or out.dtype != dtype or out.device != cache.device
          or out.stride(2) != 1):
        raise ValueError(f"out must be {shape} {dtype} on {cache.device} with a contiguous "
                         f"last dimension, got {tuple(out.shape)} {out.dtype} on {out.device} "
                         f"strides {out.stride()}")
    row_stride, head_stride = ((out.stride(1), out.stride(0)) if head_major
                               else (out.stride(0), out.stride(1)))
    if m:
        slots = slots.long().contiguous()
        be = cuda_launch.backend(cache.device)
        kern = be.kernel(STORE, f"iso::dequant_rows_kernel<{bits}, {CTYPE[dtype]}>")
        kern.launch((cdiv(m * heads, 4),), 128,
                    (ptr(cache), I64(cache.stride(0)), ptr(slots), ptr(out), I64(row_stride),
                     I64(head_stride), I(m), I(heads), I(head_dim // BLOCK)),
                    stream=be.stream())
    return out


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                min_tokens: int = MIN_SPLIT_TOKENS, ctas_per_sm: int = 4,
                tile: int = _TILE, one_wave: bool = False) -> tuple[int, int]:
    """(tokens per split, number of splits): about `ctas_per_sm` CTAs per SM (with
    `one_wave`: at most ctas_per_sm x num_sms CTAs, the most that run at once when
    ctas_per_sm is the kernel's occupancy) and at least `min_tokens` tokens per split, the
    split a multiple of `tile` tokens."""
    max_seq_len = max(1, max_seq_len)
    rows = max(1, batch * num_kv_heads)
    if one_wave:
        want = max(1, ctas_per_sm * num_sms // rows)
    else:
        want = max(1, math.ceil(ctas_per_sm * num_sms / rows))
    splits = max(1, min(math.ceil(max_seq_len / max(1, min_tokens)), want))
    chunk = math.ceil(math.ceil(max_seq_len / splits) / tile) * tile
    return chunk, math.ceil(max_seq_len / chunk)


def decode_splits(q: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
                  max_seq_len: int | None, split_tokens: int | None, *, split_tile: int,
                  **plan: int) -> tuple[int, int]:
    """(tokens per split, number of splits) of a split-K decode launcher: `split_tokens`
    (rounded up to `split_tile`) when forced, else `plan_splits(..., **plan)` for the device.
    Reads max(seq_lens) (a device sync) only when `max_seq_len` is None."""
    b = q.shape[0]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if b else 1
    if split_tokens:
        chunk = math.ceil(split_tokens / split_tile) * split_tile
        return chunk, math.ceil(max(1, max_seq_len) / chunk)
    return plan_splits(b, num_kv_heads, max_seq_len, cuda_launch.num_sms(q.device), **plan)


def split_buffers(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials of a split-K decode: accumulators [B, Hq, splits, D] and (max, sum)
    [B, Hq, splits, 2]."""
    b, hq, d = q.shape
    return (torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(b, hq, splits, 2, dtype=torch.float32, device=q.device))


def _check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, seq_lens: torch.Tensor,
                  fmt: str) -> tuple[int, int, int, int]:
    """Shape/dtype checks shared by the decode launchers; returns (B, Hq, D, Hkv)."""
    if q.dim() != 3 or q.dtype not in FLOATS:
        raise ValueError(f"q must be [B, Hq, D] float, got {q.dtype} {tuple(q.shape)}")
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    _check_cache(k_cache, hkv, d, fmt, "k_cache")
    _check_cache(v_cache, hkv, d, fmt, "v_cache")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("k_cache and v_cache must have the same slot stride")
    if hq % hkv:
        raise ValueError(f"unsupported GQA group {hq}/{hkv}")
    check_pages(page_table, seq_lens, b)
    if any(t.device != k_cache.device for t in (q, v_cache, page_table, seq_lens)):
        raise ValueError(f"q, the caches, page_table and seq_lens must be on {k_cache.device}")
    return b, hq, d, hkv

"""ISO3/ISO4 CUDA launchers (`csrc/iso_store.cu`): `iso_store` (quantize on write, byte-exact
with `ref.quantize_ref`), `iso_dequant_rows` (bit-exact with `ref.dequantize_ref`) and the
decode launchers' shared input checks."""

from __future__ import annotations

import ctypes

import torch

from tinyserve.kernels import cuda_launch
from tinyserve.kernels.cuda_launch import I64, F, I, ptr
from tinyserve.kernels.iso.ref import BLOCK, FORMATS, packed_row_bytes
from tinyserve.kernels.launch import FLOATS, cdiv, check_pages

STORE = "iso_store.cu"
_BITS = {"iso3": 3, "iso4": 4}
# the kernels' element types of fp32 / bf16 / fp16 tensors (csrc/prelude.cuh)
CTYPE = {torch.float32: "float", torch.bfloat16: "ts::bf16", torch.float16: "ts::f16"}
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

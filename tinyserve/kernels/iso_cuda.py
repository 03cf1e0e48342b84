"""ISO3/ISO4 CUDA kernels: build at first use, launchers that check shapes and dtypes.

The kernels live in `csrc/iso_store.cu` and `csrc/iso_decode.cu` (plain CUDA, no torch
headers, extern "C" launchers). At first use nvcc compiles them for the running GPU's
architecture into a shared library cached in TINYSERVE_CACHE_DIR (keyed by a hash of the
sources; `cuda_build`), loaded with ctypes; launches go to torch's current stream, so they
can be captured in CUDA graphs. Nothing here runs at import.

- `iso_store`: quantize-on-write, byte-exact with `iso.quantize_ref`.
- `iso_dequant_rows`: packed rows -> dense rows (bit-exact with `iso.dequantize_ref` in fp32).
- `iso_decode_attention`: paged split-K decode attention in the rotated space (§6.5); the
  tensor-core variant's launcher and settings are in `iso_mma` (built into the same library).
The extend attention that uses `iso_dequant_rows` is in `iso_extend`.
"""

from __future__ import annotations

import ctypes
import math

import torch

from tinyserve.kernels import cuda_build
from tinyserve.kernels.iso import BLOCK, FORMATS, packed_row_bytes

_SOURCES = ("iso_store.cu", "iso_decode.cu", "iso_decode_mma.cu")
_HEADERS = ("iso_common.cuh", "iso_split.cuh", "iso_mma_prims.cuh",
            "dependent_launch.cuh")  # in the build hash
_BITS = {"iso3": 3, "iso4": 4}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_TILE = 32
MIN_SPLIT_TOKENS = 256
_ERRORS = {2: "bad format or head_dim", 3: "unsupported GQA group", 4: "bad n_warps",
           5: "bad q dtype, wide, pdl, CTA cap or page-table columns (the MMA decode needs "
              "page_table.stride(0) >= page_table.shape[1])"}

_I, _I64, _F, _P = ctypes.c_int, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p
_SIGNATURES = (  # (entry, ctypes argument types)
    ("tinyserve_iso_store", (_P, _P, _I64, _P, _P, _I64, _I64, _P, _I, _I, _I, _I, _I, _I, _P)),
    ("tinyserve_iso_store_debug", (_P, _P, _I64, _P, _P, _I64, _I64, _P, _I, _I, _I, _I, _I,
                                   _I, _P, _P)),
    ("tinyserve_iso_dequant_rows", (_P, _I64, _P, _P, _I64, _I64, _I, _I, _I, _I, _I, _P)),
    ("tinyserve_iso_decode", (_P, _P, _P, _I64, _P, _I64, _P, _I, _I, _I, _I, _I, _I, _I, _F,
                              _I, _P, _P, _P, _I64, _I, _P)),
    ("tinyserve_iso_decode_mma", (_P, _P, _P, _I64, _P, _I64, _P, _I, _I, _I, _I, _I, _I, _I,
                                  _F, _I, _P, _P, _P, _I64, _I, _I, _I, _I, _I, _I, _P)),
    ("tinyserve_iso_decode_mma_occupancy", (_I, _I, _I)),
)


def _library(major: int, minor: int) -> ctypes.CDLL:
    """The ISO kernels (csrc/iso_*.cu) built for sm_{major}{minor} and loaded."""
    return cuda_build.library("tinyserve_iso", _SOURCES, _HEADERS, _SIGNATURES, major, minor)


def _call(device: torch.device, name: str, *args) -> None:
    lib = _library(*torch.cuda.get_device_capability(device))
    stream = torch.cuda.current_stream(device).cuda_stream
    rc = getattr(lib, name)(*args, stream)
    if rc != 0:
        raise RuntimeError(f"{name} failed: {_ERRORS.get(rc, f'CUDA error {rc}')}")


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
    if not cache.is_cuda:
        raise ValueError(f"{name} must be on a CUDA device")


def _store_args(k_cache, v_cache, loc, k, v, fmt):
    bits = format_bits(fmt)
    if k.dim() != 3 or k.shape != v.shape or k.dtype != v.dtype or k.dtype not in _FLOATS:
        raise ValueError(f"k and v must be [N, H, D] of one float dtype, got {k.dtype} "
                         f"{tuple(k.shape)} and {v.dtype} {tuple(v.shape)}")
    n, heads, d = k.shape
    _check_cache(k_cache, heads, d, fmt, "k_cache")
    _check_cache(v_cache, heads, d, fmt, "v_cache")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("k_cache and v_cache must have the same slot stride")
    if loc.dtype not in (torch.int32, torch.int64) or loc.shape != (n,):
        raise ValueError(f"loc must be int32/int64 [{n}], got {loc.dtype} {tuple(loc.shape)}")
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()
    loc = loc.contiguous()
    return (k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k.data_ptr(),
            v.data_ptr(), k.stride(0), v.stride(0), loc.data_ptr(),
            int(loc.dtype == torch.int64), n, heads, d, bits, _DTYPE_CODE[k.dtype]), (k, v, loc)


def iso_store(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor, fmt: str) -> None:
    """Quantize k, v [N, H, D] (fp32 / bf16 / fp16, CUDA) into the caches at slots loc [N]
    (int32 or int64). Caches: uint8 [slots, H, row_bytes]. Raises ValueError on bad input."""
    args, keep = _store_args(k_cache, v_cache, loc, k, v, fmt)
    if k.shape[0] == 0:
        return
    _call(k.device, "tinyserve_iso_store", *args)
    del keep


def iso_store_debug(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, fmt: str) -> torch.Tensor:
    """`iso_store` that also returns the per-block norm arithmetic, float32
    [N, H, 2 (K, V), D/128, 6]: sum of squares, norm, reconstruction sum of squares,
    reconstruction norm, corrected norm, stored fp16 bits (as a float)."""
    args, keep = _store_args(k_cache, v_cache, loc, k, v, fmt)
    n, heads, d = k.shape
    dbg = torch.full((n, heads, 2, d // BLOCK, 6), float("nan"), device=k.device)
    if n:
        _call(k.device, "tinyserve_iso_store_debug", *args, dbg.data_ptr())
    del keep
    return dbg


def iso_dequant_rows(cache: torch.Tensor, slots: torch.Tensor, fmt: str, head_dim: int,
                     dtype: torch.dtype = torch.bfloat16, *, head_major: bool = False,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Packed rows at slots [M] -> [M, H, head_dim] of `dtype` ([H, M, head_dim] with
    head_major=True, the layout attention kernels want). `out`: write there instead (that
    shape and dtype, rows and heads at any stride, the last dimension contiguous)."""
    bits = format_bits(fmt)
    heads = cache.shape[1]
    _check_cache(cache, heads, head_dim, fmt, "cache")
    if dtype not in _FLOATS:
        raise ValueError(f"dtype must be one of {_FLOATS}, got {dtype}")
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
        _call(cache.device, "tinyserve_iso_dequant_rows", cache.data_ptr(), cache.stride(0),
              slots.data_ptr(), out.data_ptr(), row_stride, head_stride, m, heads, head_dim,
              bits, _DTYPE_CODE[dtype])
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
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 4
    return plan_splits(b, num_kv_heads, max_seq_len, sms, **plan)


def run_split_decode(entry: str, variant: int, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor,
                     page_size: int, scale: float, chunk: int, splits: int,
                     out: torch.Tensor | None, *, native_q: bool = False,
                     tail: tuple[int, ...] = ()) -> torch.Tensor:
    """Run the library's split-K decode `entry` (`variant`: its bits / warps argument) with
    fp32 partials [B, Hq, splits, D] and (max, sum) [B, Hq, splits, 2]; [B, Hq, D] in q's
    dtype, or written into `out`. With `native_q` the entry reads q in its own dtype and
    takes q's dtype code after out's (no fp32 copy of q); `tail` are further int arguments
    before the stream. Shapes are the caller's to check."""
    b, hq, d = q.shape
    if out is None:
        out = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    part_acc = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(b, hq, splits, 2, dtype=torch.float32, device=q.device)
    qf = q.contiguous() if native_q else q.float().contiguous()
    seq_lens = seq_lens.contiguous()
    q_code = (_DTYPE_CODE[qf.dtype],) if native_q else ()
    _call(q.device, entry, qf.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
          k_cache.stride(0), page_table.data_ptr(), page_table.stride(0), seq_lens.data_ptr(),
          b, hq, k_cache.shape[1], d, page_size, chunk, splits, float(scale), variant,
          part_acc.data_ptr(), part_ml.data_ptr(), out.data_ptr(), out.stride(0),
          _DTYPE_CODE[out.dtype], *q_code, *tail)
    return out


def _check_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  page_table: torch.Tensor, seq_lens: torch.Tensor,
                  fmt: str) -> tuple[int, int, int, int]:
    """Shape/dtype checks shared by the decode launchers; returns (B, Hq, D, Hkv)."""
    if q.dim() != 3 or q.dtype not in _FLOATS:
        raise ValueError(f"q must be [B, Hq, D] float, got {q.dtype} {tuple(q.shape)}")
    b, hq, d = q.shape
    hkv = k_cache.shape[1]
    _check_cache(k_cache, hkv, d, fmt, "k_cache")
    _check_cache(v_cache, hkv, d, fmt, "v_cache")
    if k_cache.stride(0) != v_cache.stride(0):
        raise ValueError("k_cache and v_cache must have the same slot stride")
    if hq % hkv:
        raise ValueError(f"unsupported GQA group {hq}/{hkv}")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("page_table and seq_lens must be int32")
    if page_table.shape[0] != b or seq_lens.shape != (b,) or page_table.stride(1) != 1:
        raise ValueError(f"page_table [{b}, P] (rows contiguous) and seq_lens [{b}] expected")
    if any(t.device != k_cache.device for t in (q, v_cache, page_table, seq_lens)):
        raise ValueError(f"q, the caches, page_table and seq_lens must be on {k_cache.device}")
    return b, hq, d, hkv


def _check_out(out: torch.Tensor | None, q: torch.Tensor, b: int, hq: int, d: int) -> None:
    # the decode kernels write through out's pointer: float [B, Hq, D] on q's device
    if out is None:
        return
    if out.dtype not in _FLOATS or out.device != q.device:
        raise ValueError(f"out must be a float tensor on {q.device}, got {out.dtype} on "
                         f"{out.device}")
    if out.shape != (b, hq, d) or out.stride(2) != 1 or out.stride(1) != d:
        raise ValueError(f"out must be [{b}, {hq}, {d}] with contiguous rows")


def iso_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                         fmt: str, scale: float, *, max_seq_len: int | None = None,
                         out: torch.Tensor | None = None,
                         split_tokens: int | None = None) -> torch.Tensor:
    """One query per sequence over its packed K/V (rotated-space, split-K).

    Args:
        q: [B, Hq, D] float (CUDA); Hq / Hkv in {1, 2, 4, 8, 16} (D=128) or {1, 2, 4, 8} (D=256).
        k_cache, v_cache: uint8 [slots, Hkv, row_bytes].
        page_table: int32 [B, max_pages]; seq_lens: int32 [B] (>= 1, the new token included).
        max_seq_len: an upper bound of seq_lens (avoids a device sync; needed under CUDA graphs:
            the split grid covers exactly max_seq_len tokens, so it must not be exceeded).
        split_tokens: force this many tokens per split (tuning); default from `plan_splits`.
    Returns:
        [B, Hq, D] in q's dtype (or written into `out`).
    """
    bits = format_bits(fmt)
    b, hq, d, hkv = _check_decode(q, k_cache, v_cache, page_table, seq_lens, fmt)
    _check_out(out, q, b, hq, d)
    group = hq // hkv
    if group not in (1, 2, 4, 8, 16) or group * (d // BLOCK) > 16:
        raise ValueError(f"unsupported GQA group {hq}/{hkv} for head_dim {d}")
    chunk, splits = decode_splits(q, seq_lens, hkv, max_seq_len, split_tokens, split_tile=_TILE)
    return run_split_decode("tinyserve_iso_decode", bits, q, k_cache, v_cache, page_table,
                            seq_lens, page_size, scale, chunk, splits, out)

"""ISO3 decode attention on tensor cores (`csrc/iso_decode_mma.cu`): its settings by batch
size (`MMA_CONFIG`), the shapes and caches it takes (`mma_supported`, `caches_aligned`) and
the launcher (the contract of `ref.decode_attention_ref`)."""

from __future__ import annotations

import functools

import torch

from tinyserve.kernels import cuda_launch
from tinyserve.kernels.attention.split import decode_splits, split_buffers
from tinyserve.kernels.cuda_launch import I64, SHARED_SIZE_BYTES, I, ptr
from tinyserve.kernels.iso.cuda import CTYPE, _check_decode, scale_log2
from tinyserve.kernels.iso.ref import BLOCK
from tinyserve.kernels.launch import decode_output, dependent_launch

SOURCE = "iso_decode_mma.cu"
# csrc/iso_split.cuh: the merge's columns and threads per CTA, split slices per CTA, splits
# a thread folds at once
MERGE_COLS, MERGE_THREADS, MERGE_SLICES, MERGE_BATCH = 32, 256, 32, 4

# Warps per CTA the kernel is built for: a CTA's warps share its split's tokens (interleaved
# 16-token sub-tiles, merged in shared memory), so 16 warps add warps per SM, not partials.
WARPS = (4, 16)
_Q_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's q_code

# Settings by batch and context (the first row with batch <= `max_batch` and the longest
# sequence >= `min_context`): `warps` per CTA, about `ctas_per_sm` CTAs per SM (None: one full
# wave by the kernel's occupancy), at least `min_split_tokens` (one 16-token sub-tile per
# warp) per split. From bench/iso_attention.py (docs/RESULTS.md, "ISO3/ISO4 KV cache").
MMA_CONFIG: tuple[dict, ...] = (
    # batch 1 from 96k tokens: one full wave of 4-warp CTAs
    dict(max_batch=1, min_context=98304, warps=4, ctas_per_sm=None, min_split_tokens=64),
    # batch 1 below: 2 CTAs of 4 warps per SM
    dict(max_batch=1, warps=4, ctas_per_sm=2, min_split_tokens=64),
    # batch > 1: one wave of 16-warp CTAs (1 per SM)
    dict(max_batch=1 << 30, warps=16, ctas_per_sm=None, min_split_tokens=256),
)
# CTAs per SM assumed for a one-wave grid where the occupancy is unknown (no CUDA device).
FALLBACK_CTAS_PER_SM = 2


def mma_config(batch: int, context: int = 0) -> dict:
    """The MMA_CONFIG row for `batch` sequences of up to `context` tokens."""
    for row in MMA_CONFIG:
        if batch <= row["max_batch"] and context >= row.get("min_context", 0):
            return row
    return MMA_CONFIG[-1]


def _kernel(device: torch.device, head_dim: int, warps: int):
    """The compiled kernel for (head_dim, warps) and its dynamic shared memory."""
    args = f"{head_dim // BLOCK}, {warps}"
    smem = f"&iso::mma::kDynamicSmem<{args}>"
    kern = cuda_launch.backend(device).kernel(SOURCE, f"iso::mma::decode_mma_kernel<{args}>",
                                              (smem,))
    return kern, kern.global_int(smem)


@functools.cache
def _occupancy(device: torch.device, head_dim: int, warps: int) -> int:
    """CTAs of the kernel one SM holds (registers and all shared memory)."""
    kern, need = _kernel(device, head_dim, warps)
    if need:
        kern.set_max_dynamic_smem(need)
    return kern.occupancy(warps * 32, need)


def _capped_smem(device: torch.device, kern, need: int, cap: int) -> int:
    """Dynamic shared memory (at least `need`) such that at most `cap` CTAs fit on an SM
    (0: no cap), so a grid of cap x SMs CTAs spreads evenly."""
    if cap <= 0:
        return need
    be = cuda_launch.backend(device)
    fixed = kern.attribute(SHARED_SIZE_BYTES) + be.reserved_smem_per_block
    dyn = be.smem_per_sm // (cap + 1) - fixed + 1  # cap + 1 CTAs must not fit, cap must
    if dyn <= need:
        return need
    return dyn if cap * (fixed + dyn) <= be.smem_per_sm else need


def ctas_per_sm_fit(device: torch.device, head_dim: int, warps: int) -> int:
    """CTAs of the kernel one SM holds (FALLBACK_CTAS_PER_SM off CUDA or if unknown)."""
    if device.type != "cuda":
        return FALLBACK_CTAS_PER_SM
    return _occupancy(device, head_dim, warps) or FALLBACK_CTAS_PER_SM


def mma_supported(fmt: str, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `iso_decode_attention_mma` takes these shapes (iso3, group <= 8, D 128/256)."""
    return (fmt == "iso3" and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= 8 and head_dim in (128, 256))


def caches_aligned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel's 16-byte copies can stage rows of these caches (16-byte aligned,
    the slot stride whole 4-byte words)."""
    return ((k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0
            and k_cache.stride(0) % 4 == 0)


def iso_decode_attention_mma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                             fmt: str, scale: float, *, max_seq_len: int | None = None,
                             out: torch.Tensor | None = None, split_tokens: int | None = None,
                             warps: int | None = None, ctas_per_sm: int | None = None,
                             min_split_tokens: int | None = None) -> torch.Tensor:
    """One query per sequence over its packed K/V on tensor cores (rotated space, split-K,
    fp16 operands, fp32 accumulation).

    Args:
        q: [B, Hq, D] float; iso3, Hq / Hkv <= 8, D 128 or 256.
        k_cache, v_cache: uint8 [slots, Hkv, row_bytes], `caches_aligned`.
        page_table: int32 [B, max_pages]; seq_lens: int32 [B] (>= 1).
        max_seq_len: a bound of seq_lens (no device sync; under CUDA graphs the grid covers
            exactly that many tokens).
        split_tokens, warps, ctas_per_sm (0: one wave), min_split_tokens: override
            `mma_config` (tuning).
    Returns [B, Hq, D] in q's dtype (or into `out`). On sm_90+ the kernel and the merge are
    dependent launches; the CTAs per SM are capped by padded shared memory, since a dependent
    launch starts while the previous kernel holds some SMs and would stack unevenly.
    Raises ValueError on shapes, caches or settings it does not take.
    """
    b, hq, d, hkv = _check_decode(q, k_cache, v_cache, page_table, seq_lens, fmt)
    out = decode_output(out, q, b, hq, d)
    if not mma_supported(fmt, hq, hkv, d):
        raise ValueError(f"the MMA decode kernel takes iso3, GQA group <= 8, head_dim 128/256; "
                         f"got {fmt}, {hq}/{hkv} heads, head_dim {d}")
    if not caches_aligned(k_cache, v_cache):
        raise ValueError("the MMA decode kernel needs 16-byte aligned caches and a slot stride "
                         f"of whole 4-byte words, got stride {k_cache.stride(0)}")
    cfg = mma_config(b, max_seq_len or 0)
    warps = warps or cfg["warps"]
    if warps not in WARPS:
        raise ValueError(f"warps must be one of {WARPS}, got {warps}")
    ctas = ctas_per_sm if ctas_per_sm is not None else cfg["ctas_per_sm"]
    chunk, splits = decode_splits(q, seq_lens, hkv, max_seq_len, split_tokens, split_tile=16,
                                  min_tokens=min_split_tokens or cfg["min_split_tokens"],
                                  ctas_per_sm=ctas or ctas_per_sm_fit(q.device, d, warps),
                                  one_wave=not ctas)
    if b == 0:
        return out
    kern, need = _kernel(q.device, d, warps)
    smem = _capped_smem(q.device, kern, need, ctas or 0)
    if smem:
        kern.set_max_dynamic_smem(smem)  # above the default 48 KB: allowed per kernel
    part_acc, part_ml = split_buffers(q, splits)
    qc, seq_lens = q.contiguous(), seq_lens.contiguous()
    dependent = dependent_launch(q.device)
    be = cuda_launch.backend(q.device)
    stream = be.stream()
    kern.launch((splits, hkv, b), warps * 32,
                (ptr(qc), I(_Q_CODE[q.dtype]), ptr(k_cache), ptr(v_cache),
                 I64(k_cache.stride(0)), ptr(page_table), I64(page_table.stride(0)),
                 I(page_table.shape[1]), ptr(seq_lens), I(page_size), I(hkv), I(hq // hkv),
                 I(chunk), I(splits), scale_log2(scale), ptr(part_acc), ptr(part_ml)),
                smem=smem, stream=stream, pdl=dependent)
    batch = MERGE_BATCH if splits > MERGE_SLICES else 1
    merge = be.kernel(SOURCE, f"iso::decode_merge_cols_kernel<{CTYPE[out.dtype]}, {batch}>")
    merge.launch((hq, b, d // MERGE_COLS), MERGE_THREADS,
                 (ptr(part_acc), ptr(part_ml), ptr(seq_lens), I(chunk), I(splits), I(hq), I(d),
                  ptr(out), I64(out.stride(0))), stream=stream, pdl=dependent)
    return out

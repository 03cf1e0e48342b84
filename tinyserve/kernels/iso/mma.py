"""ISO3 decode attention on tensor cores (csrc/iso_decode_mma.cu): settings and launcher.

The kernel is compiled and launched like the other ISO kernels (`iso_cuda`, `cuda_launch`);
this module holds what is specific to it: the measured settings by batch size (`MMA_CONFIG`,
`mma_config`), which shapes and caches it takes (`mma_supported`, `caches_aligned`) and the
launcher `iso_decode_attention_mma` (the contract of `iso.decode_attention_ref`; iso4 and
other shapes decode with `iso_triton`). Nothing here runs at import.
"""

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
# csrc/iso_split.cuh: the split merge's columns and threads per CTA, split slices per CTA and
# splits a thread folds at once where it has several
MERGE_COLS, MERGE_THREADS, MERGE_SLICES, MERGE_BATCH = 32, 256, 32, 4

# Warps per CTA the kernel is built for (the `warps` of MMA_CONFIG's rows). The warps of a CTA
# share its split's tokens (each its own interleaved 16-token sub-tiles, merged in shared
# memory at the end), so 16 warps give more warps per SM at the same number of split partials;
# the tile buffers are dynamic shared memory (one CTA of 16 warps per SM, 128 registers).
WARPS = (4, 16)
_Q_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's q_code

# Settings of the tensor-core decode kernel (csrc/iso_decode_mma.cu) by batch size and
# context: the first row with `max_batch` >= batch and `min_context` (0 if absent) <= the
# call's longest sequence (its bound) is used (the last row otherwise). `warps` per CTA
# (one of WARPS), about `ctas_per_sm` CTAs per SM (None: one full wave, as many CTAs as the
# kernel's occupancy lets every SM hold), at least `min_split_tokens` tokens per split.
# The CTA count comes from the kernel's occupancy (sm_90: 151-153 registers, 3 CTAs of 4
# warps per SM), so a grid never runs a partial second wave. min_split_tokens = one 16-token
# sub-tile per warp (64 for 4 warps, 256 for 16): short contexts get more, shorter splits.
# Values from the sweeps of bench/iso_attention.py (numbers in docs/RESULTS.md, "ISO3/ISO4 KV
# cache").
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
    """CTAs of the kernel one SM holds (registers and shared memory, the dynamic part
    included)."""
    kern, need = _kernel(device, head_dim, warps)
    if need:
        kern.set_max_dynamic_smem(need)
    return kern.occupancy(warps * 32, need)


def _capped_smem(device: torch.device, kern, need: int, cap: int) -> int:
    """Dynamic shared memory for a CTA that needs `need` bytes such that at most `cap` CTAs
    fit on one SM (0: no cap): a grid of cap x SMs CTAs then runs cap on every SM instead
    of, possibly, up to the occupancy on some SMs and fewer on others."""
    if cap <= 0:
        return need
    be = cuda_launch.backend(device)
    fixed = kern.attribute(SHARED_SIZE_BYTES) + be.reserved_smem_per_block
    dyn = be.smem_per_sm // (cap + 1) - fixed + 1  # cap + 1 CTAs must not fit, cap must
    if dyn <= need:
        return need
    return dyn if cap * (fixed + dyn) <= be.smem_per_sm else need


def ctas_per_sm_fit(device: torch.device, head_dim: int, warps: int) -> int:
    """How many CTAs of the kernel (head_dim, warps) one SM holds: the CUDA occupancy on a
    CUDA device, FALLBACK_CTAS_PER_SM elsewhere or when the query fails."""
    if device.type != "cuda":
        return FALLBACK_CTAS_PER_SM
    return _occupancy(device, head_dim, warps) or FALLBACK_CTAS_PER_SM


def mma_supported(fmt: str, num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether `iso_decode_attention_mma` takes these shapes (iso3, group <= 8, D 128/256)."""
    return (fmt == "iso3" and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0
            and num_q_heads // num_kv_heads <= 8 and head_dim in (128, 256))


def caches_aligned(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel can stage rows of these caches: it copies 16-byte chunks, so both
    caches must start on 16 bytes and the slot stride be a multiple of 4 bytes."""
    return ((k_cache.data_ptr() | v_cache.data_ptr()) % 16 == 0
            and k_cache.stride(0) % 4 == 0)


def iso_decode_attention_mma(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                             fmt: str, scale: float, *, max_seq_len: int | None = None,
                             out: torch.Tensor | None = None, split_tokens: int | None = None,
                             warps: int | None = None, ctas_per_sm: int | None = None,
                             min_split_tokens: int | None = None) -> torch.Tensor:
    """One query per sequence over its packed K/V on tensor cores (rotated space, split-K):
    fp16 query and centroid operands, fp32 accumulation, q read in its own dtype.

    Args:
        q: [B, Hq, D] float; iso3 only, Hq / Hkv <= 8, D 128 or 256.
        k_cache, v_cache: uint8 [slots, Hkv, row_bytes], `caches_aligned`.
        page_table: int32 [B, max_pages]; seq_lens: int32 [B] (>= 1, the new token included).
        max_seq_len: an upper bound of seq_lens (avoids a device sync; needed under CUDA
            graphs: the split grid covers exactly max_seq_len tokens).
        split_tokens, warps (one of WARPS), ctas_per_sm (0: one wave from the occupancy),
            min_split_tokens: override the settings of `mma_config(B, max_seq_len)` (tuning;
            a split shorter than 16 x warps tokens leaves warps idle).
    Returns:
        [B, Hq, D] in q's dtype (or written into `out`).

    On sm_90+ the decode kernel and the split merge are programmatic dependent launches. A
    grid of `ctas_per_sm` CTAs per SM runs with at most that many on any SM (padded dynamic
    shared memory; the occupancy would allow more): a dependent launch is scheduled while
    the kernel before it still holds some SMs, and uncapped its one wave would stack unevenly
    on the SMs free first. Raises ValueError on shapes, caches or settings it does not take.
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

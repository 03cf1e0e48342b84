"""ISO3/ISO4 paged decode attention on tensor cores (Triton), in the rotated space (§6.5).

Pass 1 (`_iso_decode_partial`), grid (splits, batch * kv heads): one program owns `chunk`
context tokens of one (sequence, kv head) and the G query heads of its GQA group (padded to
16 rows for the MMA). It rotates the query once (forward quaternion per 4-D group, fp32),
scales it by scale * log2(e) and keeps it in fp16. Per tile of BLOCK_T tokens it gathers the
packed K rows through the page table, unpacks the indices into fp16 centroid values (rotated
space, unscaled), and computes S = sum_b norm_b * (Q_b @ C_b^T) with tl.dot (one dot per
128-block, fp32 accumulation); online softmax in base 2; then acc_b += (P * norm_v_b) @ Cv_b.
It writes the unnormalised rotated accumulator and (max, sum) per split.
Pass 2 (`_decode_triton_common.decode_merge_kernel`, shared with the bf16 kernel), one program
per (sequence, query head): log-sum-exp merge of the splits, inverse rotation per 4-D group
(fp32), divide by the sum, cast, store.

Precision: fp16 query and centroid operands (11-bit mantissa), fp32 accumulation; the
softmax weights enter the V product in fp16. Results agree with the fp32 reference to ~1e-3.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tinyserve.kernels import iso, iso_cuda
from tinyserve.kernels._decode_triton_common import decode_merge_kernel, kv_rows, split_program
from tinyserve.kernels._iso_triton_fields import iso_decode_partial_fields
from tinyserve.kernels.launch import decode_output

_LOG2E = 1.4426950408889634
# Launch settings from the bench/iso_attention.py sweep: 32-token tiles, 4 warps, registers
# capped at 128 (several programs per SM, a little spilling), ~8 programs per SM; 64-token
# tiles need ~250 registers and leave one program per SM.
BLOCK_T = 32
NUM_WARPS = 4
MAXNREG = 128
MIN_SPLIT_TOKENS = 128
CTAS_PER_SM = 8
VARIANT = "fields"


@triton.jit
def _unpack_block(cache_ptr, row, tmask, blk: tl.constexpr, cent_ptr, BITS: tl.constexpr,
                  BB: tl.constexpr):
    """Centroid values fp16 [T, 128] and norms fp32 [T] of block `blk` of the rows at byte
    offsets `row` [T] (int64); masked rows give norm 0."""
    base = cache_ptr + row + blk * BB  # [T] pointers
    lo = tl.load(base, mask=tmask, other=0).to(tl.int32)
    hi = tl.load(base + 1, mask=tmask, other=0).to(tl.int32)
    bits = (lo | (hi << 8)).to(tl.int16)
    nrm = bits.to(tl.float16, bitcast=True).to(tl.float32)
    nrm = tl.where(tmask, nrm, 0.0)
    if BITS == 4:
        cols = tl.arange(0, 64)
        qs = tl.load(base[:, None] + 4 + cols[None, :], mask=tmask[:, None], other=0)
        qs = qs.to(tl.int32)
        idx = tl.interleave(qs & 15, qs >> 4)  # element 2i: low nibble, 2i+1: high nibble
    else:
        cols = tl.arange(0, 32)
        qs = tl.load(base[:, None] + 2 + cols[None, :], mask=tmask[:, None], other=0)
        qs = qs.to(tl.int32)
        scol = tl.arange(0, 16)
        sg = tl.load(base[:, None] + 34 + scol[None, :], mask=tmask[:, None], other=0)
        sg = sg.to(tl.int32)
        nib = tl.interleave(sg & 15, sg >> 4)  # [T, 32]: the 4 high bits of group g
        f0 = (qs & 3) | ((nib << 2) & 4)  # index of element 4g + c
        f1 = ((qs >> 2) & 3) | ((nib << 1) & 4)
        f2 = ((qs >> 4) & 3) | (nib & 4)
        f3 = ((qs >> 6) & 3) | ((nib >> 1) & 4)
        idx = tl.interleave(tl.interleave(f0, f2), tl.interleave(f1, f3))
    cent = tl.load(cent_ptr + idx)  # fp16 table lookup (L1)
    return cent, nrm


@triton.jit
def _rotated_query(q_ptr, qrow, hmask, blk: tl.constexpr, rot_ptr, scale_log2,
                   BLOCK_H: tl.constexpr):
    """Forward-rotated query block `blk` [BLOCK_H, 128] as fp16, times scale * log2(e)."""
    g = tl.arange(0, 32)
    c = tl.arange(0, 4)
    # r[h, g, c] = sum_k R[g, c, k] * q[h, g, k]
    r = tl.zeros([BLOCK_H, 32, 4], dtype=tl.float32)
    for k in tl.static_range(4):
        qk = tl.load(q_ptr + qrow[:, None] + blk * 128 + g[None, :] * 4 + k,
                     mask=hmask[:, None], other=0.0).to(tl.float32)  # [BLOCK_H, 32]
        rk = tl.load(rot_ptr + g[:, None] * 16 + c[None, :] * 4 + k)  # [32, 4]
        r += qk[:, :, None] * rk[None, :, :]
    return (tl.reshape(r, [BLOCK_H, 128]) * scale_log2).to(tl.float16)


@triton.jit
def _iso_decode_partial(q_ptr, k_ptr, v_ptr, slot_stride, pt_ptr, pt_stride, lens_ptr,
                        cent_ptr, rot_ptr, part_acc_ptr, part_ml_ptr, chunk, n_splits,
                        page_size, scale_log2,
                        HKV: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr,
                        NB: tl.constexpr, BITS: tl.constexpr, BB: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    D: tl.constexpr = NB * 128
    RB: tl.constexpr = NB * BB
    split, b, kvh, t_begin, t_end, hs, hmask, qrow = split_program(lens_ptr, chunk, HKV, G,
                                                                   BLOCK_H, D)
    q0 = _rotated_query(q_ptr, qrow, hmask, 0, rot_ptr, scale_log2, BLOCK_H)
    if NB == 2:
        q1 = _rotated_query(q_ptr, qrow, hmask, 1, rot_ptr, scale_log2, BLOCK_H)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc0 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, 128], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < t_end
        row = kv_rows(pt_ptr, pt_stride, b, ts, tmask, page_size, slot_stride, kvh, RB)
        ck, nk = _unpack_block(k_ptr, row, tmask, 0, cent_ptr, BITS, BB)
        s = tl.dot(q0, tl.trans(ck)) * nk[None, :]
        if NB == 2:
            ck1, nk1 = _unpack_block(k_ptr, row, tmask, 1, cent_ptr, BITS, BB)
            s += tl.dot(q1, tl.trans(ck1)) * nk1[None, :]
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        cv, nv = _unpack_block(v_ptr, row, tmask, 0, cent_ptr, BITS, BB)
        acc0 = acc0 * alpha[:, None] + tl.dot((p * nv[None, :]).to(tl.float16), cv)
        if NB == 2:
            cv1, nv1 = _unpack_block(v_ptr, row, tmask, 1, cent_ptr, BITS, BB)
            acc1 = acc1 * alpha[:, None] + tl.dot((p * nv1[None, :]).to(tl.float16), cv1)
        m = m_new
    prow = ((b * (HKV * G) + kvh * G + hs).to(tl.int64) * n_splits + split)  # [BLOCK_H]
    cols = tl.arange(0, 128)
    tl.store(part_acc_ptr + prow[:, None] * D + cols[None, :], acc0, mask=hmask[:, None])
    if NB == 2:
        tl.store(part_acc_ptr + prow[:, None] * D + 128 + cols[None, :], acc1,
                 mask=hmask[:, None])
    tl.store(part_ml_ptr + prow * 2, m, mask=hmask)
    tl.store(part_ml_ptr + prow * 2 + 1, l_sum, mask=hmask)


@functools.cache
def _tables(device: torch.device, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(centroids fp16 [8|16], rotations fp32 [2, 32, 4, 4]: forward R_g, inverse R_g^T)."""
    q = iso.quat_table().double()
    w, x, y, z = q[:, 0], q[:, 1], q[:, 2], q[:, 3]
    fwd = torch.stack([
        torch.stack([w, -x, -y, -z], -1), torch.stack([x, w, -z, y], -1),
        torch.stack([y, z, w, -x], -1), torch.stack([z, -y, x, w], -1)], 1)  # [32, 4, 4]
    rot = torch.stack([fwd, fwd.transpose(1, 2)]).float().contiguous()
    cent = iso.centroid_table(fmt).half()
    return cent.to(device), rot.to(device)


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                min_tokens: int = MIN_SPLIT_TOKENS, ctas_per_sm: int = CTAS_PER_SM,
                tile: int = BLOCK_T) -> tuple[int, int]:
    """`iso_cuda.plan_splits` with this kernel's defaults."""
    return iso_cuda.plan_splits(batch, num_kv_heads, max_seq_len, num_sms,
                                min_tokens=min_tokens, ctas_per_sm=ctas_per_sm, tile=tile)


def iso_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                page_table: torch.Tensor, seq_lens: torch.Tensor,
                                page_size: int, fmt: str, scale: float, *,
                                max_seq_len: int | None = None, out: torch.Tensor | None = None,
                                split_tokens: int | None = None, block_t: int = BLOCK_T,
                                ctas_per_sm: int = CTAS_PER_SM, num_warps: int = NUM_WARPS,
                                num_stages: int = 2, maxnreg: int | None = MAXNREG,
                                variant: str = VARIANT) -> torch.Tensor:
    """One query per sequence over its packed K/V (same contract as
    `iso_cuda.iso_decode_attention`): q [B, Hq, D] float, caches uint8 [slots, Hkv, row_bytes],
    page_table int32 [B, P] (rows contiguous), seq_lens int32 [B] (each >= 1, <= max_seq_len).
    Hq / Hkv <= 16. Returns [B, Hq, D] in q's dtype (or written into `out`). `variant`:
    "fields" (per-field dots, kernels/_iso_triton_fields.py) or "interleave" (whole-block
    dots, the block rebuilt with tl.interleave)."""
    if variant not in ("fields", "interleave"):
        raise ValueError(f"variant must be fields or interleave, got {variant!r}")
    iso_cuda.format_bits(fmt)  # (checks the format)
    b, hq, d, hkv = iso_cuda._check_decode(q, k_cache, v_cache, page_table, seq_lens, fmt)
    if hq // hkv > 16 or d // iso.BLOCK not in (1, 2):
        raise ValueError(f"unsupported GQA group {hq}/{hkv} or head_dim {d}")
    out = decode_output(out, q, b, hq, d)
    if b == 0:
        return out
    chunk, splits = iso_cuda.decode_splits(q, seq_lens, hkv, max_seq_len, split_tokens,
                                           split_tile=block_t, min_tokens=MIN_SPLIT_TOKENS,
                                           ctas_per_sm=ctas_per_sm, tile=block_t)
    group = hq // hkv
    cent, rot = _tables(q.device, fmt)
    qc = q.contiguous()
    part_acc, part_ml = iso_cuda.split_buffers(q, splits)
    kernel = iso_decode_partial_fields if variant == "fields" else _iso_decode_partial
    kernel[(splits, b * hkv)](
        qc, k_cache, v_cache, k_cache.stride(0), page_table, page_table.stride(0),
        seq_lens.contiguous(), cent, rot, part_acc, part_ml, chunk, splits, page_size,
        float(scale) * _LOG2E, HKV=hkv, G=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        NB=d // iso.BLOCK, BITS=3 if fmt == "iso3" else 4, BB=iso.BLOCK_BYTES[fmt],
        BLOCK_T=block_t, num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    decode_merge_kernel[(b * hq,)](
        part_acc, part_ml, rot, out, splits, out.stride(0), HQ=hq, D=d,
        BLOCK_S=max(2, min(16, triton.next_power_of_2(splits))), FIELD_MAJOR=variant == "fields",
        IS_ROTATED=True, num_warps=4)
    return out

"""ISO3/ISO4 paged decode attention on tensor cores (Triton), in the rotated space (§6.5): iso4
and GQA groups over 8 (iso3 at groups <= 8 runs `mma.py`).

Pass 1, grid (splits, batch * kv heads), a program per `chunk` tokens of one (sequence, kv
head) and its G query heads (padded to 16 rows). A 128-block is 4 fields of 32 (field c =
element 4g + c of each 4-D group g), read straight from the packed bytes. The query is rotated
into the fields once (fp32), scaled by scale * log2(e), kept in fp16;
S = sum_b norm_b * sum_c Q_bc @ C_bc^T, online softmax in base 2, acc_bc += (P * norm_v) @ Cv_bc;
the accumulator is written field-major. Pass 2: `split_triton.decode_merge_kernel` with the
inverse rotation. fp16 operands, fp32 accumulation: ~1e-3 from the fp32 reference."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tinyserve.kernels.attention import split as decode_split
from tinyserve.kernels.attention.split_triton import decode_merge_kernel, kv_rows, split_program
from tinyserve.kernels.iso import cuda as iso_cuda
from tinyserve.kernels.iso import ref as iso
from tinyserve.kernels.launch import decode_output

_LOG2E = 1.4426950408889634
# Launch settings: 32-token tiles, 4 warps, registers capped at 128 (several programs per
# SM, a little spilling), ~8 programs per SM.
BLOCK_T = 32
NUM_WARPS = 4
NUM_STAGES = 2
MAXNREG = 128
MIN_SPLIT_TOKENS = 128
CTAS_PER_SM = 8


@triton.jit
def _fields(cache_ptr, row, tmask, blk: tl.constexpr, cent_ptr, BITS: tl.constexpr,
            BB: tl.constexpr):
    """Centroid values fp16 [T, 32] of fields 0..3 of block `blk`, and norms fp32 [T]."""
    base = cache_ptr + row + blk * BB
    lo = tl.load(base, mask=tmask, other=0).to(tl.int32)
    hi = tl.load(base + 1, mask=tmask, other=0).to(tl.int32)
    nrm = (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    nrm = tl.where(tmask, nrm, 0.0)
    g = tl.arange(0, 32)
    if BITS == 4:
        be = tl.load(base[:, None] + 4 + 2 * g[None, :], mask=tmask[:, None], other=0)
        bo = tl.load(base[:, None] + 5 + 2 * g[None, :], mask=tmask[:, None], other=0)
        be = be.to(tl.int32)
        bo = bo.to(tl.int32)
        i0, i1, i2, i3 = be & 15, be >> 4, bo & 15, bo >> 4
    else:
        qs = tl.load(base[:, None] + 2 + g[None, :], mask=tmask[:, None], other=0)
        sg = tl.load(base[:, None] + 34 + (g // 2)[None, :], mask=tmask[:, None], other=0)
        qs = qs.to(tl.int32)
        nib = sg.to(tl.int32) >> ((g % 2) * 4)[None, :]
        i0 = (qs & 3) | ((nib << 2) & 4)
        i1 = ((qs >> 2) & 3) | ((nib << 1) & 4)
        i2 = ((qs >> 4) & 3) | (nib & 4)
        i3 = ((qs >> 6) & 3) | ((nib >> 1) & 4)
    return (tl.load(cent_ptr + i0), tl.load(cent_ptr + i1), tl.load(cent_ptr + i2),
            tl.load(cent_ptr + i3), nrm)


@triton.jit
def _query_fields(q_ptr, qrow, hmask, blk: tl.constexpr, rot_ptr, scale_log2):
    """The forward-rotated query of block `blk` as 4 fields fp16 [BLOCK_H, 32], times
    scale * log2(e)."""
    g = tl.arange(0, 32)
    base = q_ptr + qrow[:, None] + blk * 128 + 4 * g[None, :]
    v0 = tl.load(base, mask=hmask[:, None], other=0.0).to(tl.float32)
    v1 = tl.load(base + 1, mask=hmask[:, None], other=0.0).to(tl.float32)
    v2 = tl.load(base + 2, mask=hmask[:, None], other=0.0).to(tl.float32)
    v3 = tl.load(base + 3, mask=hmask[:, None], other=0.0).to(tl.float32)
    r = rot_ptr + g * 16  # R[g, c, k] at g*16 + c*4 + k
    f0 = (tl.load(r)[None, :] * v0 + tl.load(r + 1)[None, :] * v1
          + tl.load(r + 2)[None, :] * v2 + tl.load(r + 3)[None, :] * v3)
    f1 = (tl.load(r + 4)[None, :] * v0 + tl.load(r + 5)[None, :] * v1
          + tl.load(r + 6)[None, :] * v2 + tl.load(r + 7)[None, :] * v3)
    f2 = (tl.load(r + 8)[None, :] * v0 + tl.load(r + 9)[None, :] * v1
          + tl.load(r + 10)[None, :] * v2 + tl.load(r + 11)[None, :] * v3)
    f3 = (tl.load(r + 12)[None, :] * v0 + tl.load(r + 13)[None, :] * v1
          + tl.load(r + 14)[None, :] * v2 + tl.load(r + 15)[None, :] * v3)
    return ((f0 * scale_log2).to(tl.float16), (f1 * scale_log2).to(tl.float16),
            (f2 * scale_log2).to(tl.float16), (f3 * scale_log2).to(tl.float16))


@triton.jit
def _block_scores(k_ptr, row, tmask, blk: tl.constexpr, cent_ptr, BITS: tl.constexpr,
                  BB: tl.constexpr, q0, q1, q2, q3):
    """The scores fp32 [BLOCK_H, T] of block `blk`: norm_b * sum_c Q_bc @ C_bc^T."""
    c0, c1, c2, c3, nk = _fields(k_ptr, row, tmask, blk, cent_ptr, BITS, BB)
    s = (tl.dot(q0, tl.trans(c0)) + tl.dot(q1, tl.trans(c1)) + tl.dot(q2, tl.trans(c2))
         + tl.dot(q3, tl.trans(c3)))
    return s * nk[None, :]


@triton.jit
def _accumulate(v_ptr, row, tmask, blk: tl.constexpr, cent_ptr, BITS: tl.constexpr,
                BB: tl.constexpr, p, alpha, a0, a1, a2, a3):
    """The accumulator fields of block `blk` rescaled by alpha, plus (P * norm_v) @ Cv_bc."""
    c0, c1, c2, c3, nv = _fields(v_ptr, row, tmask, blk, cent_ptr, BITS, BB)
    pv = (p * nv[None, :]).to(tl.float16)
    return (a0 * alpha + tl.dot(pv, c0), a1 * alpha + tl.dot(pv, c1),
            a2 * alpha + tl.dot(pv, c2), a3 * alpha + tl.dot(pv, c3))


@triton.jit
def _store_fields(ptr, prow, hmask, off: tl.constexpr, a0, a1, a2, a3):
    g = tl.arange(0, 32)
    base = ptr + prow[:, None] + off + g[None, :]
    tl.store(base, a0, mask=hmask[:, None])
    tl.store(base + 32, a1, mask=hmask[:, None])
    tl.store(base + 64, a2, mask=hmask[:, None])
    tl.store(base + 96, a3, mask=hmask[:, None])


@triton.jit
def iso_decode_partial_kernel(q_ptr, k_ptr, v_ptr, slot_stride, pt_ptr, pt_stride, lens_ptr,
                               cent_ptr, rot_ptr, part_acc_ptr, part_ml_ptr, chunk, n_splits,
                               page_size, scale_log2,
                               HKV: tl.constexpr, G: tl.constexpr, BLOCK_H: tl.constexpr,
                               NB: tl.constexpr, BITS: tl.constexpr, BB: tl.constexpr,
                               BLOCK_T: tl.constexpr):
    D: tl.constexpr = NB * 128
    RB: tl.constexpr = NB * BB
    split, b, kvh, t_begin, t_end, hs, hmask, qrow = split_program(lens_ptr, chunk, HKV, G,
                                                                   BLOCK_H, D)
    q00, q01, q02, q03 = _query_fields(q_ptr, qrow, hmask, 0, rot_ptr, scale_log2)
    if NB == 2:
        q10, q11, q12, q13 = _query_fields(q_ptr, qrow, hmask, 1, rot_ptr, scale_log2)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    a00 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a01 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a02 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a03 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a10 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a11 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a12 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    a13 = tl.zeros([BLOCK_H, 32], dtype=tl.float32)
    for t0 in range(t_begin, t_end, BLOCK_T):
        ts = t0 + tl.arange(0, BLOCK_T)
        tmask = ts < t_end
        row = kv_rows(pt_ptr, pt_stride, b, ts, tmask, page_size, slot_stride, kvh, RB)
        s = _block_scores(k_ptr, row, tmask, 0, cent_ptr, BITS, BB, q00, q01, q02, q03)
        if NB == 2:
            s += _block_scores(k_ptr, row, tmask, 1, cent_ptr, BITS, BB, q10, q11, q12, q13)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)[:, None]
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * tl.exp2(m - m_new) + tl.sum(p, 1)
        a00, a01, a02, a03 = _accumulate(v_ptr, row, tmask, 0, cent_ptr, BITS, BB, p, alpha,
                                         a00, a01, a02, a03)
        if NB == 2:
            a10, a11, a12, a13 = _accumulate(v_ptr, row, tmask, 1, cent_ptr, BITS, BB, p,
                                             alpha, a10, a11, a12, a13)
        m = m_new
    prow = (b * (HKV * G) + kvh * G + hs).to(tl.int64) * n_splits + split
    _store_fields(part_acc_ptr, prow * D, hmask, 0, a00, a01, a02, a03)
    if NB == 2:
        _store_fields(part_acc_ptr, prow * D, hmask, 128, a10, a11, a12, a13)
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


def iso_decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                page_table: torch.Tensor, seq_lens: torch.Tensor,
                                page_size: int, fmt: str, scale: float, *,
                                max_seq_len: int | None = None, out: torch.Tensor | None = None,
                                split_tokens: int | None = None) -> torch.Tensor:
    """The contract of `ref.decode_attention_ref` with int32 page table and lengths, Hq / Hkv
    <= 16, D 128 or 256; `max_seq_len` None reads it from seq_lens (a device sync),
    `split_tokens` forces the split. Returns [B, Hq, D] in q's dtype (or into `out`)."""
    b, hq, d, hkv = iso_cuda._check_decode(q, k_cache, v_cache, page_table, seq_lens, fmt)
    if hq // hkv > 16 or d // iso.BLOCK not in (1, 2):
        raise ValueError(f"unsupported GQA group {hq}/{hkv} or head_dim {d}")
    out = decode_output(out, q, b, hq, d)
    if b == 0:
        return out
    chunk, splits = decode_split.decode_splits(q, seq_lens, hkv, max_seq_len, split_tokens,
                                               split_tile=BLOCK_T, min_tokens=MIN_SPLIT_TOKENS,
                                               ctas_per_sm=CTAS_PER_SM, tile=BLOCK_T)
    group = hq // hkv
    cent, rot = _tables(q.device, fmt)
    qc = q.contiguous()
    part_acc, part_ml = decode_split.split_buffers(q, splits)
    iso_decode_partial_kernel[(splits, b * hkv)](
        qc, k_cache, v_cache, k_cache.stride(0), page_table, page_table.stride(0),
        seq_lens.contiguous(), cent, rot, part_acc, part_ml, chunk, splits, page_size,
        float(scale) * _LOG2E, HKV=hkv, G=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        NB=d // iso.BLOCK, BITS=3 if fmt == "iso3" else 4, BB=iso.BLOCK_BYTES[fmt],
        BLOCK_T=BLOCK_T, num_warps=NUM_WARPS, num_stages=NUM_STAGES, maxnreg=MAXNREG)
    decode_merge_kernel[(b * hq,)](
        part_acc, part_ml, rot, out, splits, out.stride(0), HQ=hq, D=d,
        BLOCK_S=max(2, min(16, triton.next_power_of_2(splits))), IS_ROTATED=True, num_warps=4)
    return out

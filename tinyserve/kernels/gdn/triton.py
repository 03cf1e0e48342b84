"""Triton GDN kernels (launchers in `ops.py`, `chunk.py`, which import this on their first
call). State math is fp32; the chunk dots take PREC: "tf32x3" (fp32-level tensor cores),
"ieee" or "tf32"."""

from __future__ import annotations

import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------
# causal conv1d (state [C, K-1] per slot, oldest column first)


@triton.jit
def _conv_state_tile(C, K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    """This program's channels c [BLOCK_C] and state columns j [KP], with their masks."""
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    j = tl.arange(0, KP)
    return c, j, c < C, j < K - 1


@triton.jit
def conv1d_update_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, y_ptr, C,
                         stride_xb, stride_ps, stride_pc, stride_yb,
                         K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c, j, cmask, jmask = _conv_state_tile(C, K, KP, BLOCK_C)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    st_ptrs = pool_ptr + slot * stride_ps + c[:, None] * stride_pc + j[None, :]  # [BC, KP]
    m2 = cmask[:, None] & jmask[None, :]
    st = tl.load(st_ptrs, mask=m2, other=0.0)
    # state shifted left by one column, x appended
    nxt = tl.load(st_ptrs + 1, mask=cmask[:, None] & (j[None, :] < K - 2), other=0.0)
    x = tl.load(x_ptr + b * stride_xb + c, mask=cmask, other=0.0)
    w = tl.load(w_ptr + c[:, None] * K + j[None, :], mask=m2, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + c * K + (K - 1), mask=cmask, other=0.0).to(tl.float32)
    acc = tl.sum(w * st.to(tl.float32), 1) + w_last * x.to(tl.float32)  # [BC]
    nxt = tl.where(j[None, :] == K - 2, x[:, None].to(nxt.dtype), nxt)
    tl.debug_barrier()
    tl.store(st_ptrs, nxt, mask=m2)
    u = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + b * stride_yb + c, (u * tl.sigmoid(u)).to(y_ptr.dtype.element_ty),
             mask=cmask)


@triton.jit
def conv1d_varlen_kernel(x_ptr, w_ptr, pool_ptr, slots_ptr, cu_ptr, init_ptr, seq_ptr, y_ptr,
                         T, C, stride_xt, stride_ps, stride_pc, stride_yt,
                         K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    tmask = t < T
    cmask = c < C
    seq = tl.load(seq_ptr + t, mask=tmask, other=0)
    start = tl.load(cu_ptr + seq, mask=tmask, other=0)
    slot = tl.load(slots_ptr + seq, mask=tmask, other=0).to(tl.int64)
    init = tl.load(init_ptr + seq, mask=tmask, other=0) != 0
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for j in tl.static_range(K):
        src = t - (K - 1) + j  # [BT] input row feeding tap j
        in_x = src >= start
        xm = (tmask & in_x)[:, None] & cmask[None, :]
        xv = tl.load(x_ptr + src[:, None] * stride_xt + c[None, :], mask=xm, other=0.0)
        sidx = (K - 1) + src - start  # state column when src < start
        sm = (tmask & ~in_x & init)[:, None] & cmask[None, :]
        sv = tl.load(pool_ptr + slot[:, None] * stride_ps + c[None, :] * stride_pc
                     + sidx[:, None], mask=sm, other=0.0)
        w = tl.load(w_ptr + c * K + j, mask=cmask, other=0.0).to(tl.float32)
        acc += w[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
    u = acc.to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + t[:, None] * stride_yt + c[None, :],
             (u * tl.sigmoid(u)).to(y_ptr.dtype.element_ty),
             mask=tmask[:, None] & cmask[None, :])


@triton.jit
def conv1d_state_writeback_kernel(x_ptr, pool_ptr, slots_ptr, cu_ptr, init_ptr, C,
                                  stride_xt, stride_ps, stride_pc,
                                  K: tl.constexpr, KP: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    c, j, cmask, jmask = _conv_state_tile(C, K, KP, BLOCK_C)
    start = tl.load(cu_ptr + b)
    end = tl.load(cu_ptr + b + 1)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    init = tl.load(init_ptr + b + j * 0) != 0  # [KP] (a block, not a scalar, for the mask)
    pos = end - (K - 1) + j  # [KP] input row that becomes state column j
    in_x = pos >= start
    xm = cmask[:, None] & (jmask & in_x)[None, :]
    xv = tl.load(x_ptr + pos[None, :] * stride_xt + c[:, None], mask=xm, other=0.0)
    st_base = pool_ptr + slot * stride_ps + c[:, None] * stride_pc
    sm = cmask[:, None] & (jmask & ~in_x & init)[None, :]
    sv = tl.load(st_base + ((K - 1) + pos - start)[None, :], mask=sm, other=0.0)
    new = tl.where(in_x[None, :], xv.to(sv.dtype), sv)
    tl.debug_barrier()
    tl.store(st_base + j[None, :], new, mask=cmask[:, None] & jmask[None, :])


# --------------------------------------------------------------------------------------------
# gated delta rule; state [Hv, dk, dv] fp32 per slot; grid (B, Hv, cdiv(dv, BV))


@triton.jit
def gdn_recurrent_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, pool_ptr,
                         slots_ptr, cu_ptr, init_ptr, o_ptr,
                         s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_bt, s_ot, s_oh,
                         s_ps, s_ph, scale, G, DK, DV,
                         IS_VARLEN: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    bid = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    kmask = kk < DK
    vmask = vv < DV
    hk = h // G
    slot = tl.load(slots_ptr + bid).to(tl.int64)
    if IS_VARLEN:
        start = tl.load(cu_ptr + bid).to(tl.int64)
        end = tl.load(cu_ptr + bid + 1).to(tl.int64)
    else:
        start = bid.to(tl.int64)
        end = start + 1
    s_ptrs = pool_ptr + slot * s_ps + h * s_ph + kk[:, None] * DV + vv[None, :]  # [BK, BV]
    smask = kmask[:, None] & vmask[None, :]
    if IS_VARLEN:
        use_init = tl.load(init_ptr + bid + vv * 0) != 0  # [BV]
        S = tl.load(s_ptrs, mask=smask & use_init[None, :], other=0.0)
    else:
        S = tl.load(s_ptrs, mask=smask, other=0.0)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    for t in range(start, end):
        q = tl.load(q_ptr + t * s_qt + hk * s_qh + kk, mask=kmask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * s_kt + hk * s_kh + kk, mask=kmask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * s_vt + h * s_vh + vv, mask=vmask, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + t * s_at + h).to(tl.float32)
        b = tl.load(b_ptr + t * s_bt + h).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 0) + 1e-6) * scale)
        k = k * tl.rsqrt(tl.sum(k * k, 0) + 1e-6)
        x = a + dtb
        g = A * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus
        beta = tl.sigmoid(b)
        S = S * tl.exp(g)
        kv = tl.sum(S * k[:, None], 0)  # [BV]
        S = S + k[:, None] * (beta * (v - kv))[None, :]
        o = tl.sum(S * q[:, None], 0)  # [BV]
        tl.store(o_ptr + t * s_ot + h * s_oh + vv, o.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_ptrs, S, mask=smask)


@triton.jit
def gdn_chunk_prep_kernel(q_ptr, k_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, cseq_ptr, cstart_ptr,
                          cu_ptr, ti_ptr, att_ptr, s_qt, s_qh, s_kt, s_kh, s_at, s_bt, s_tt,
                          s_th, scale, G, DK,
                          BT: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
                          NATIVE_QK: tl.constexpr, NLEVELS: tl.constexpr,
                          BLOCKED: tl.constexpr):
    # NOTE: grid (chunks, Hv); every chunk independent. For the chunk's rows t writes
    # Ti = (I + L)^-1 with L = strictly-lower((kb k^T) * D) (spec §2.7) to ti[t, h, 0:BT] and
    # att = lower-incl-diagonal((q k^T) * D) to att[t, h, 0:BT] (same strides).
    c = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BK)
    rows = tl.arange(0, BT)
    kmask = kk < DK
    seq = tl.load(cseq_ptr + c)
    start = tl.load(cstart_ptr + c)
    end = tl.load(cu_ptr + seq + 1)  # padding chunks have start == end
    t = (start + rows).to(tl.int64)
    tmask = t < end
    m2 = tmask[:, None] & kmask[None, :]
    # NATIVE_QK: q k^T and k k^T take the 16-bit inputs as they are (bf16 x bf16 products are
    # exact in the fp32 accumulator); otherwise fp32 dots at PREC. The l2norm factors are
    # applied after the dots. (The interpreter's 16-bit dot is wrong: the launcher passes
    # NATIVE_QK=False there.)
    k = tl.load(k_ptr + t[:, None] * s_kt + (h // G) * s_kh + kk[None, :], mask=m2,
                other=0.0)  # [BT, BK]
    q = tl.load(q_ptr + t[:, None] * s_qt + (h // G) * s_qh + kk[None, :], mask=m2,
                other=0.0)  # [BT, BK]
    a = tl.load(a_ptr + t * s_at + h, mask=tmask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * s_bt + h, mask=tmask, other=0.0).to(tl.float32)
    kf = k.to(tl.float32)
    kn = tl.rsqrt(tl.sum(kf * kf, 1) + 1e-6)  # [BT]
    qf = q.to(tl.float32)
    qn = tl.rsqrt(tl.sum(qf * qf, 1) + 1e-6) * scale
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    x = a + tl.load(dtb_ptr + h).to(tl.float32)
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus
    g = tl.where(tmask, A * sp, 0.0)
    beta = tl.where(tmask, tl.sigmoid(b), 0.0)
    cum = tl.cumsum(g, 0)  # [BT]
    causal = rows[:, None] >= rows[None, :]
    D = tl.where(causal, tl.exp(tl.minimum(cum[:, None] - cum[None, :], 0.0)), 0.0)
    if NATIVE_QK:  # 16-bit inputs: exact products, fp32 accumulation
        kT = tl.trans(k)
        qk = tl.dot(q, kT)
        kk2 = tl.dot(k, kT)
    else:
        kfT = tl.trans(kf)
        qk = tl.dot(qf, kfT, input_precision=PREC)
        kk2 = tl.dot(kf, kfT, input_precision=PREC)
    att = qk * (qn[:, None] * kn[None, :])
    att = tl.where(causal, att * D, 0.0)
    tl.store(att_ptr + t[:, None] * s_tt + h * s_th + rows[None, :], att, mask=tmask[:, None])
    strict = rows[:, None] > rows[None, :]
    L = kk2 * ((beta * kn)[:, None] * kn[None, :])
    L = tl.where(strict, L * D, 0.0)
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)
    if BLOCKED:
        # (I + L)^-1 blockwise (16-row blocks, all diagonal blocks at once): X = (I + Lb)^-1 - I
        # of the block diagonal Lb by substitution, one 16-row step per dot (row i of X is
        # -Lb[i] - Lb[i] X once the rows above it are final); then with N = (I + X) Lo, Lo the
        # strictly block-lower rest (N^NB = 0): Ti = (I - N)(I + N^2)(I + N^4)... (I + X).
        same = (rows // 16)[:, None] == (rows // 16)[None, :]
        Lb = tl.where(same, L, 0.0)
        X = -Lb
        for i in range(2, 16):
            P = tl.dot(Lb, X, input_precision=PREC)
            X = tl.where(((rows % 16) == i)[:, None], -Lb - P, X)
        Tb = X + eye
        N = tl.dot(Tb, L - Lb, input_precision=PREC)
        R = eye - N
        for _ in tl.static_range(1, NLEVELS):
            N = tl.dot(N, N, input_precision=PREC)
            R = R + tl.dot(R, N, input_precision=PREC)
        Ti = tl.dot(R, Tb, input_precision=PREC)
    else:  # forward substitution, row by row: row i of Ti - I = -L[i] - sum_j L[i, j] (Ti - I)[j]
        Ti = -L
        for i in range(1, BT):
            sel = rows == i
            r = tl.sum(tl.where(sel[:, None], Ti, 0.0), 0)
            r = r + tl.sum(r[:, None] * Ti, 0) * (rows < i)
            Ti = tl.where(sel[:, None], r[None, :], Ti)
        Ti = Ti + eye
    tl.store(ti_ptr + t[:, None] * s_tt + h * s_th + rows[None, :], Ti, mask=tmask[:, None])


@triton.jit
def gdn_chunk_kernel(q_ptr, k_ptr, v_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, pool_ptr,
                     slots_ptr, cu_ptr, init_ptr, ti_ptr, att_ptr, o_ptr,
                     s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_at, s_bt, s_ot, s_oh,
                     s_tt, s_th, s_ps, s_ph, scale, G, DK, DV,
                     BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                     PREC: tl.constexpr):
    # NOTE: one program walks all chunks of one (sequence, value head, dv block), carrying
    # S [BK, BV] in registers; per chunk (spec §2.7), with Ti and att from the prep kernel and
    # W S = Ti ((kb * exp(cum)) S) reassociated so no [BT, BK] product is formed here:
    # v_new = Ti (vb - (kb * exp(cum)) S), o = (q * exp(cum)) S + att v_new,
    # S <- S exp(cum_last) + (k * exp(cum_last - cum))^T v_new. Padded rows have q=k=v=0,
    # beta=0, g=0, which changes neither o nor S.
    bid = tl.program_id(0)
    h = tl.program_id(1)
    kk = tl.arange(0, BK)
    vv = tl.program_id(2) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    kmask = kk < DK
    vmask = vv < DV
    hk = h // G
    slot = tl.load(slots_ptr + bid).to(tl.int64)
    start = tl.load(cu_ptr + bid).to(tl.int64)
    end = tl.load(cu_ptr + bid + 1).to(tl.int64)
    use_init = tl.load(init_ptr + bid + vv * 0) != 0  # [BV]
    s_ptrs = pool_ptr + slot * s_ps + h * s_ph + kk[:, None] * DV + vv[None, :]  # [BK, BV]
    smask = kmask[:, None] & vmask[None, :]
    S = tl.load(s_ptrs, mask=smask & use_init[None, :], other=0.0)
    A = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    # [BT, *] int32 offsets within a chunk; each chunk adds a scalar int64 row base
    q_off = rows[:, None] * s_qt + kk[None, :]
    k_off = rows[:, None] * s_kt + kk[None, :]
    v_off = rows[:, None] * s_vt + vv[None, :]
    o_off = rows[:, None] * s_ot + vv[None, :]
    w_off = rows[:, None] * s_tt + rows[None, :]
    for cs in range(start, end, BT):
        t = cs + rows  # [BT] int64
        tmask = t < end
        a = tl.load(a_ptr + t * s_at + h, mask=tmask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + t * s_bt + h, mask=tmask, other=0.0).to(tl.float32)
        x = a + dtb
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # softplus
        g = tl.where(tmask, A * sp, 0.0)
        beta = tl.where(tmask, tl.sigmoid(b), 0.0)
        cum = tl.cumsum(g, 0)  # [BT]
        last = tl.sum(tl.where(rows == BT - 1, cum, 0.0), 0)
        ecum = tl.exp(cum)
        qm = tmask[:, None] & kmask[None, :]
        k = tl.load(k_ptr + cs * s_kt + hk * s_kh + k_off, mask=qm, other=0.0).to(tl.float32)
        kn = tl.rsqrt(tl.sum(k * k, 1) + 1e-6)  # [BT] l2norm factors
        v = tl.load(v_ptr + cs * s_vt + h * s_vh + v_off, mask=tmask[:, None] & vmask[None, :],
                    other=0.0).to(tl.float32)  # [BT, BV]
        Ti = tl.load(ti_ptr + cs * s_tt + h * s_th + w_off, mask=tmask[:, None],
                     other=0.0)  # [BT, BT]
        X = tl.dot(k * (kn * beta * ecum)[:, None], S, input_precision=PREC)  # [BT, BV]
        v_new = tl.dot(Ti, v * beta[:, None] - X, input_precision=PREC)  # [BT, BV]
        q = tl.load(q_ptr + cs * s_qt + hk * s_qh + q_off, mask=qm, other=0.0).to(tl.float32)
        q = q * (tl.rsqrt(tl.sum(q * q, 1) + 1e-6) * scale * ecum)[:, None]
        att = tl.load(att_ptr + cs * s_tt + h * s_th + w_off, mask=tmask[:, None],
                      other=0.0)  # [BT, BT]
        o = tl.dot(q, S, input_precision=PREC)
        o += tl.dot(att, v_new, input_precision=PREC)
        tl.store(o_ptr + cs * s_ot + h * s_oh + o_off,
                 o.to(o_ptr.dtype.element_ty), mask=tmask[:, None] & vmask[None, :])
        # k again (an L1/L2 hit) rather than a [BT, BK] tile live across the chunk
        k = tl.load(k_ptr + cs * s_kt + hk * s_kh + k_off, mask=qm, other=0.0).to(tl.float32)
        k_dec = k * (kn * tl.exp(last - cum))[:, None]
        S = S * tl.exp(last) + tl.dot(tl.trans(k_dec), v_new, input_precision=PREC)
    tl.store(s_ptrs, S, mask=smask)

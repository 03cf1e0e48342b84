"""NVFP4 decode kernels (W4A16): the gemv behind `linear.py` and the row-dot cores of the fused
MoE decode (`moe/decode_triton.py`). Decoding without lookup tables:
- E2M1 code c -> fp16 bits ((c & 7) << 9) | ((c & 8) << 12) = E2M1[c] * 2^-14 exactly;
- E4M3 bits b -> fp16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) = e4m3(b) * 2^-8 exactly
  (no fp8 type, runs below sm_89).
So E2M1 * e4m3 = product * 2^22 (`FP4_UNIT`), folded into the global factor. The gemv decodes
as bf16 patterns with fp32 FMAs (`_nibble_pair`); the MoE gate_up with "h2" (fp16x2 pairs,
half2 FMAs, `_fp4_rows_dot_h2`), in the same unit."""

from __future__ import annotations

import triton
import triton.language as tl

FP4_UNIT = float(2**22)
FP4_UNIT_C = tl.constexpr(FP4_UNIT)
# gemv: x * 2^64 keeps x * E2M1 * 2^-126 normal. NOTE: exact products for 2^-63 <= |x| < 2^64;
# smaller |x| lose bits (fp32 subnormals), |x| >= 2^64 overflow to inf (no max pass: the
# "h2" decode has one and takes any finite x)
X_PRESCALE_C = tl.constexpr(float(2**64))
GEMV_RESCALE_C = tl.constexpr(float(2**48))  # 2^(126 + 8 - 64 - 22)


@triton.jit
def _e2m1(codes):
    # codes: int32 in 0..15 -> E2M1[code] * 2^-14, fp32
    bits = ((codes & 7) << 9) | ((codes & 8) << 12)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _e4m3(raw):
    # raw: uint8 E4M3 bits -> e4m3 * 2^-8, fp32
    b = raw.to(tl.int32)
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _nibble_pair(w, I: tl.constexpr):
    """Nibbles I and I + 4 of uint32 words `w` -> two fp32 tensors E2M1 * 2^-126: both bf16
    patterns built at once (one per 16-bit half), each made fp32 by a shift or a mask. Code 1
    is an fp32 subnormal, exact (no .ftz); callers prescale x by X_PRESCALE."""
    SM: tl.constexpr = 6 - 4 * I
    SS: tl.constexpr = 12 - 4 * I
    if SM >= 0:
        mag = w << SM
    else:
        mag = w >> (-SM)
    if SS >= 0:
        sign = w << SS
    else:
        sign = w >> (-SS)
    bits = (mag & 0x01C001C0) | (sign & 0x80008000)
    a = (bits << 16).to(tl.float32, bitcast=True)
    b = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return a, b


@triton.jit
def _x_quad(xk, I: tl.constexpr, m, XS):
    # X_PRESCALE * x at inputs 16b + I, +4, +8, +12 of the blocks at `xk` (mask m), fp32 [BB];
    # input 16b + i sits at xk + i * XS
    x0 = tl.load(xk + I * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x1 = tl.load(xk + (I + 4) * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x2 = tl.load(xk + (I + 8) * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    x3 = tl.load(xk + (I + 12) * XS, mask=m, other=0.0).to(tl.float32) * X_PRESCALE_C
    return x0, x1, x2, x3


@triton.jit
def _fma4(p, w0, w4, w8, w12, x0, x4, x8, x12):
    p += w0 * x0[None, :]
    p += w4 * x4[None, :]
    p += w8 * x8[None, :]
    p += w12 * x12[None, :]
    return p


@triton.jit
def _fp4_rows_dot(x_ptr, stride_xm, m_rows, w_ptr, s_ptr, rows, row_mask, KB,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    """sum_k x[m, k] * (E2M1 * e4m3)[rows, k] for the first BLOCK_M (1, 2, 4) rows of x (rows
    >= m_rows read as 0): four fp32 [BLOCK_N] lacking FP4_UNIT * global_scale. `w_ptr`: int64
    view of the codes [rows, KB] (one word = 16 codes), `s_ptr`: uint8 scales [rows, KB]. The
    weight tile is decoded once for every row of x, each block's sum scaled once."""
    offs_b = tl.arange(0, BLOCK_B)
    rows64 = rows.to(tl.int64)
    w_rows = w_ptr + rows64[:, None] * KB
    s_rows = s_ptr + rows64[:, None] * KB
    acc0 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    for b0 in range(0, KB, BLOCK_B):
        # NOTE: contiguity capped at 2 words so a thread loads 16 bytes per row and holds
        # several rows (they share its x values) instead of one long row segment
        blk = tl.max_contiguous(b0 + offs_b, 2)  # [BB]
        ok = blk < KB
        zero = tl.zeros_like(blk)  # NOTE: vector masks only (the interpreter rejects scalars)
        mask = row_mask[:, None] & ok[None, :]
        v = tl.load(w_rows + blk[None, :], mask=mask, other=0)  # [BN, BB] int64
        scale = _e4m3(tl.load(s_rows + blk[None, :], mask=mask, other=0))  # [BN, BB]
        lo = v.to(tl.uint32)  # inputs 16b + 0..7
        hi = (v >> 32).to(tl.uint32)  # inputs 16b + 8..15
        xk = x_ptr + blk * 16
        p0 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p1 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p2 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        p3 = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
        for i in tl.static_range(4):
            w0, w4 = _nibble_pair(lo, i)
            w8, w12 = _nibble_pair(hi, i)
            x0, x4, x8, x12 = _x_quad(xk, i, ok & (zero < m_rows), 1)
            p0 = _fma4(p0, w0, w4, w8, w12, x0, x4, x8, x12)
            if BLOCK_M > 1:
                x0, x4, x8, x12 = _x_quad(xk + stride_xm, i, ok & (zero + 1 < m_rows), 1)
                p1 = _fma4(p1, w0, w4, w8, w12, x0, x4, x8, x12)
            if BLOCK_M > 2:
                x0, x4, x8, x12 = _x_quad(xk + 2 * stride_xm, i, ok & (zero + 2 < m_rows), 1)
                p2 = _fma4(p2, w0, w4, w8, w12, x0, x4, x8, x12)
                x0, x4, x8, x12 = _x_quad(xk + 3 * stride_xm, i, ok & (zero + 3 < m_rows), 1)
                p3 = _fma4(p3, w0, w4, w8, w12, x0, x4, x8, x12)
        acc0 += p0 * scale
        if BLOCK_M > 1:
            acc1 += p1 * scale
        if BLOCK_M > 2:
            acc2 += p2 * scale
            acc3 += p3 * scale
    # NOTE: sums are x * E2M1 * e4m3 * 2^(64 - 126 - 8); rescale to the common 2^-22 unit
    u = GEMV_RESCALE_C
    return (tl.sum(acc0, axis=1) * u, tl.sum(acc1, axis=1) * u, tl.sum(acc2, axis=1) * u,
            tl.sum(acc3, axis=1) * u)


# --------------------------------------------------------------------------------------------
# "h2" decode: fp16x2 pairs of E2M1 values, packed half2 FMAs (one row of x; the fused MoE
# decode's gate_up).

# out = lo-lane + hi-lane of sum_i P_i * X_i over 8 (weight pair, x pair) words, in two
# chains of four; $1..$8 weight pairs, $9..$16 the matching x pairs, $0 fp32 bits
_H2_DOT8_ASM = tl.constexpr("""{
.reg .b32 a, b;
.reg .b16 l, h;
.reg .f32 fl, fh;
mul.rn.f16x2 a, $1, $9;
mul.rn.f16x2 b, $5, $13;
fma.rn.f16x2 a, $2, $10, a;
fma.rn.f16x2 b, $6, $14, b;
fma.rn.f16x2 a, $3, $11, a;
fma.rn.f16x2 b, $7, $15, b;
fma.rn.f16x2 a, $4, $12, a;
fma.rn.f16x2 b, $8, $16, b;
add.rn.f16x2 a, a, b;
mov.b32 {l, h}, a;
cvt.f32.f16 fl, l;
cvt.f32.f16 fh, h;
add.f32 fl, fl, fh;
mov.b32 $0, fl;
}""")


@triton.jit
def _h2_pair(w, I: tl.constexpr):
    """Nibbles I and I + 4 of uint32 words `w` -> one uint32 of two fp16 E2M1 * 2^-14 (low
    half nibble I): magnitude bits 4I..4I+2 -> 9..11, sign bit 4I+3 -> 15 (and +16)."""
    SM: tl.constexpr = 9 - 4 * I
    SS: tl.constexpr = 12 - 4 * I
    if SM >= 0:
        mag = w << SM
    else:
        mag = w >> (-SM)
    if SS > 0:
        sign = w << SS
    else:
        sign = w
    return (mag & 0x0E000E00) | (sign & 0x80008000)


@triton.jit
def _h2_half(v, HIGH: tl.constexpr):
    # the fp16 in the low (or high) 16 bits of uint32 `v`, as fp32 (emulation only)
    if HIGH:
        h = v >> 16
    else:
        h = v & 0xFFFF
    return h.to(tl.int32).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _h2_x_pair(xk, A: tl.constexpr, B: tl.constexpr, XS, m, xs):
    # x inputs A (low half) and B (high half) of the blocks at `xk`, times xs, as fp16x2
    xa = (tl.load(xk + A * XS, mask=m, other=0.0).to(tl.float32) * xs).to(tl.float16)
    xb = (tl.load(xk + B * XS, mask=m, other=0.0).to(tl.float32) * xs).to(tl.float16)
    ia = xa.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    ib = xb.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (ia | (ib << 16)).to(tl.uint32)


@triton.jit
def _bcast(v, like):
    # v [1, BB] -> like's shape [BN, BB] (inline asm takes operands of one shape)
    return tl.broadcast_to(v, like.shape)


@triton.jit
def _h2_dot8(p0, p1, p2, p3, q0, q1, q2, q3, x0, x1, x2, x3, y0, y1, y2, y3,
             USE_ASM: tl.constexpr):
    """sum of the 16 fp16 products of 8 weight-pair words with 8 x-pair words, fp32."""
    if USE_ASM:
        bits = tl.inline_asm_elementwise(
            _H2_DOT8_ASM, "=r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r,r",
            [p0, p1, p2, p3, q0, q1, q2, q3, x0, x1, x2, x3, y0, y1, y2, y3],
            dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(tl.float32, bitcast=True)
    acc = _h2_half(p0, False) * _h2_half(x0, False) + _h2_half(p0, True) * _h2_half(x0, True)
    acc += _h2_half(p1, False) * _h2_half(x1, False) + _h2_half(p1, True) * _h2_half(x1, True)
    acc += _h2_half(p2, False) * _h2_half(x2, False) + _h2_half(p2, True) * _h2_half(x2, True)
    acc += _h2_half(p3, False) * _h2_half(x3, False) + _h2_half(p3, True) * _h2_half(x3, True)
    acc += _h2_half(q0, False) * _h2_half(y0, False) + _h2_half(q0, True) * _h2_half(y0, True)
    acc += _h2_half(q1, False) * _h2_half(y1, False) + _h2_half(q1, True) * _h2_half(y1, True)
    acc += _h2_half(q2, False) * _h2_half(y2, False) + _h2_half(q2, True) * _h2_half(y2, True)
    acc += _h2_half(q3, False) * _h2_half(y3, False) + _h2_half(q3, True) * _h2_half(y3, True)
    return acc


@triton.jit
def _h2_scale(amax):
    # (xs, 1 / xs) with amax * xs in [2^13, 2^14): the biased exponent of xs = 2^(13 - e)
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    c = tl.minimum(tl.maximum(267 - e, 2), 253)
    return (c << 23).to(tl.float32, bitcast=True), ((254 - c) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _h2_x_scale(x_ptr, b_lo, b_hi, BLOCK_B: tl.constexpr):
    """`_h2_scale` of max|x| over inputs [16 b_lo, 16 b_hi) (x all zero: xs = 2^126)."""
    offs_x = tl.arange(0, 16 * BLOCK_B)
    xmax = tl.zeros([16 * BLOCK_B], dtype=tl.float32)
    for b0 in range(b_lo, b_hi, BLOCK_B):
        kx = 16 * b0 + offs_x
        xv = tl.load(x_ptr + kx, mask=kx < 16 * b_hi, other=0.0).to(tl.float32)
        xmax = tl.maximum(xmax, tl.abs(xv))
    return _h2_scale(tl.max(xmax, axis=0))



@triton.jit
def _h2_pack(a, b):
    # two fp32 tensors -> one uint32 of fp16x2 (a in the low half)
    ia = a.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    ib = b.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (ia | (ib << 16)).to(tl.uint32)


@triton.jit
def _h2_one_step(v, raw, xk, XS, ok, USE_ASM: tl.constexpr):
    """The "h2" dot of a single K step covering the program's x: fp32 [BN] in the unit of
    `_fp4_rows_dot_h2`, x loaded once and its scale taken from those values (no scale pass)."""
    x0 = tl.load(xk + 0 * XS, mask=ok, other=0.0).to(tl.float32)
    x1 = tl.load(xk + 1 * XS, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(xk + 2 * XS, mask=ok, other=0.0).to(tl.float32)
    x3 = tl.load(xk + 3 * XS, mask=ok, other=0.0).to(tl.float32)
    x4 = tl.load(xk + 4 * XS, mask=ok, other=0.0).to(tl.float32)
    x5 = tl.load(xk + 5 * XS, mask=ok, other=0.0).to(tl.float32)
    x6 = tl.load(xk + 6 * XS, mask=ok, other=0.0).to(tl.float32)
    x7 = tl.load(xk + 7 * XS, mask=ok, other=0.0).to(tl.float32)
    x8 = tl.load(xk + 8 * XS, mask=ok, other=0.0).to(tl.float32)
    x9 = tl.load(xk + 9 * XS, mask=ok, other=0.0).to(tl.float32)
    x10 = tl.load(xk + 10 * XS, mask=ok, other=0.0).to(tl.float32)
    x11 = tl.load(xk + 11 * XS, mask=ok, other=0.0).to(tl.float32)
    x12 = tl.load(xk + 12 * XS, mask=ok, other=0.0).to(tl.float32)
    x13 = tl.load(xk + 13 * XS, mask=ok, other=0.0).to(tl.float32)
    x14 = tl.load(xk + 14 * XS, mask=ok, other=0.0).to(tl.float32)
    x15 = tl.load(xk + 15 * XS, mask=ok, other=0.0).to(tl.float32)
    m = tl.maximum(tl.maximum(tl.maximum(tl.abs(x0), tl.abs(x1)),
                              tl.maximum(tl.abs(x2), tl.abs(x3))),
                   tl.maximum(tl.maximum(tl.abs(x4), tl.abs(x5)),
                              tl.maximum(tl.abs(x6), tl.abs(x7))))
    m = tl.maximum(m, tl.maximum(tl.maximum(tl.maximum(tl.abs(x8), tl.abs(x9)),
                                            tl.maximum(tl.abs(x10), tl.abs(x11))),
                                 tl.maximum(tl.maximum(tl.abs(x12), tl.abs(x13)),
                                            tl.maximum(tl.abs(x14), tl.abs(x15)))))
    xs, inv_xs = _h2_scale(tl.max(m, axis=0))
    lo = v.to(tl.uint32)  # inputs 16b + 0..7
    hi = (v >> 32).to(tl.uint32)  # inputs 16b + 8..15
    p = _h2_dot8(_h2_pair(lo, 0), _h2_pair(lo, 1), _h2_pair(lo, 2), _h2_pair(lo, 3),
                 _h2_pair(hi, 0), _h2_pair(hi, 1), _h2_pair(hi, 2), _h2_pair(hi, 3),
                 _bcast(_h2_pack(x0 * xs, x4 * xs)[None, :], lo),
                 _bcast(_h2_pack(x1 * xs, x5 * xs)[None, :], lo),
                 _bcast(_h2_pack(x2 * xs, x6 * xs)[None, :], lo),
                 _bcast(_h2_pack(x3 * xs, x7 * xs)[None, :], lo),
                 _bcast(_h2_pack(x8 * xs, x12 * xs)[None, :], lo),
                 _bcast(_h2_pack(x9 * xs, x13 * xs)[None, :], lo),
                 _bcast(_h2_pack(x10 * xs, x14 * xs)[None, :], lo),
                 _bcast(_h2_pack(x11 * xs, x15 * xs)[None, :], lo), USE_ASM)
    return tl.sum(p * _e4m3(raw), axis=1) * inv_xs


@triton.jit
def _fp4_rows_dot_h2(x_ptr, w_ptr, s_ptr, rows, row_mask, KB, b_lo, b_hi,
                     BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr, USE_ASM: tl.constexpr,
                     ONE_STEP: tl.constexpr):
    """`_fp4_rows_dot` for one row of x with the "h2" decode (same unit). x is scaled by
    xs = 2^s so that max|x| over inputs [16 b_lo, 16 b_hi) lies in [2^13, 2^14): bf16 x is
    exact in fp16 and a block's fp16 sums stay <= 48; each block's 16 products are summed in
    fp16, then scaled by its e4m3 in fp32. The first step's loads are issued first; ONE_STEP
    (b_hi - b_lo <= BLOCK_B): `_h2_one_step`; else the scale pass runs under those loads and
    each step is requested one ahead."""
    # NOTE: the hint on the range too: with b_lo a literal 0 the sum folds away, and its hint
    # with it (the loads then take another layout, twice the registers)
    offs_b = tl.max_contiguous(tl.arange(0, BLOCK_B), 2)
    rows64 = rows.to(tl.int64)
    w_rows = w_ptr + rows64[:, None] * KB
    s_rows = s_ptr + rows64[:, None] * KB
    blk = tl.max_contiguous(b_lo + offs_b, 2)  # [BB]
    ok = blk < b_hi
    mask = row_mask[:, None] & ok[None, :]
    v_next = tl.load(w_rows + blk[None, :], mask=mask, other=0)  # [BN, BB] int64
    raw_next = tl.load(s_rows + blk[None, :], mask=mask, other=0)  # [BN, BB] uint8
    # NOTE: the input stride stays a literal 1 (a constexpr: the compiler merges the 16 loads
    # of a block)
    if ONE_STEP:
        return _h2_one_step(v_next, raw_next, x_ptr + blk * 16, 1, ok, USE_ASM)
    xs, inv_xs = _h2_x_scale(x_ptr, b_lo, b_hi, BLOCK_B)
    acc = tl.zeros([BLOCK_N, BLOCK_B], dtype=tl.float32)
    for b0 in range(b_lo, b_hi, BLOCK_B):
        v = v_next
        raw = raw_next
        blk = tl.max_contiguous(b0 + offs_b, 2)  # [BB]
        ok = blk < b_hi
        nblk = tl.max_contiguous(b0 + BLOCK_B + offs_b, 2)
        nmask = row_mask[:, None] & (nblk < b_hi)[None, :]
        v_next = tl.load(w_rows + nblk[None, :], mask=nmask, other=0)
        raw_next = tl.load(s_rows + nblk[None, :], mask=nmask, other=0)
        lo = v.to(tl.uint32)  # inputs 16b + 0..7
        hi = (v >> 32).to(tl.uint32)  # inputs 16b + 8..15
        xk = x_ptr + blk * 16
        x0 = _h2_x_pair(xk, 0, 4, 1, ok, xs)[None, :]
        x1 = _h2_x_pair(xk, 1, 5, 1, ok, xs)[None, :]
        x2 = _h2_x_pair(xk, 2, 6, 1, ok, xs)[None, :]
        x3 = _h2_x_pair(xk, 3, 7, 1, ok, xs)[None, :]
        y0 = _h2_x_pair(xk, 8, 12, 1, ok, xs)[None, :]
        y1 = _h2_x_pair(xk, 9, 13, 1, ok, xs)[None, :]
        y2 = _h2_x_pair(xk, 10, 14, 1, ok, xs)[None, :]
        y3 = _h2_x_pair(xk, 11, 15, 1, ok, xs)[None, :]
        p = _h2_dot8(_h2_pair(lo, 0), _h2_pair(lo, 1), _h2_pair(lo, 2), _h2_pair(lo, 3),
                     _h2_pair(hi, 0), _h2_pair(hi, 1), _h2_pair(hi, 2), _h2_pair(hi, 3),
                     _bcast(x0, lo), _bcast(x1, lo), _bcast(x2, lo), _bcast(x3, lo),
                     _bcast(y0, lo), _bcast(y1, lo), _bcast(y2, lo), _bcast(y3, lo), USE_ASM)
        acc += p * _e4m3(raw)
    # NOTE: sums are x * xs * E2M1 * 2^-14 * e4m3 * 2^-8: dividing by xs gives the 2^-22 unit
    return tl.sum(acc, axis=1) * inv_xs


@triton.jit
def nvfp4_gemv_kernel(x_ptr, w_ptr, s_ptr, out_ptr, factor, M, N, KB, stride_xm,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_B: tl.constexpr):
    # out[m, n] = factor * sum_k x[m, k] * W[n, k], BLOCK_M rows of x at once; grid
    # cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # NOTE: x row groups vary fastest so one weight tile is reused from L2
    pid_n = pid // num_m
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    m0 = pid_m * BLOCK_M
    x_row = x_ptr + m0.to(tl.int64) * stride_xm
    a0, a1, a2, a3 = _fp4_rows_dot(x_row, stride_xm, M - m0, w_ptr, s_ptr, rows, row_mask, KB,
                                   BLOCK_M, BLOCK_N, BLOCK_B)
    out = out_ptr + m0.to(tl.int64) * N + rows
    ty = out_ptr.dtype.element_ty
    tl.store(out, (a0 * factor).to(ty), mask=row_mask)
    if BLOCK_M > 1:
        tl.store(out + N, (a1 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 1 < M))
    if BLOCK_M > 2:
        tl.store(out + 2 * N, (a2 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 2 < M))
        tl.store(out + 3 * N, (a3 * factor).to(ty), mask=row_mask & (rows * 0 + m0 + 3 < M))

"""The numba code of `cpu.py` (imported on first use). Arrays: x [N, H] fp32, rows [N, k]
int64 (-1: skipped), wts [N, k] fp32; w13 uint8 [R, 2F, H/2], s13 [R, 2F, H/16], g13 fp32
[R, 2], w2 uint8 [R, H, F/2], s2 [R, H, F/16], g2 fp32 [R]; out [N, H] fp32.

One file, past the usual size: numba's on-disk cache (cache=True) checks only the source file
of the function it caches, so the LLVM IR its functions inline (the block dot, the silu-mul)
lives beside them, and a change to either recompiles everything."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from llvmlite import ir
from numba import carray, cfunc, njit, prange, types
from numba.extending import intrinsic

RB = 32  # rows per work item: kernels.moe.cpu.ROW_BLOCK
DW = 17  # descriptor words: kernels.moe.cpu.DESC_WORDS
# code bytes the dot prefetches ahead of its loads: rows are contiguous, so this runs into the
# next rows of the work item and keeps the memory reads in flight while the core computes
PREFETCH = 2048


@intrinsic
def _addr(typingctx, ptr):
    sig = types.int64(types.voidptr)

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return sig, codegen


def _typed_ptr(dtype):
    @intrinsic
    def ptr(typingctx, addr):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return ptr


@intrinsic
def _call_i32(typingctx, addr, value):
    """`int f(int)` at address `addr` called with `value` (usleep, reached through an address
    passed in: a cached function may not hold its ctypes object)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = builder.inttoptr(args[0], ir.FunctionType(i32, [i32]).as_pointer())
        return builder.sext(builder.call(fn, [builder.trunc(args[1], i32)]), ir.IntType(64))

    return sig, codegen


@intrinsic
def _load_acquire_i32(typingctx, addr):
    """The int32 at address `addr`, read with acquire ordering (never hoisted out of a loop)."""
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        return builder.sext(builder.load_atomic(ptr, "acquire", 4), ir.IntType(64))

    return sig, codegen


@intrinsic
def _store_release_i32(typingctx, addr, value):
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(32).as_pointer())
        builder.store_atomic(builder.trunc(args[1], ir.IntType(32)), ptr, "release", 4)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _load_acquire_i64(typingctx, addr):
    sig = types.int64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.load_atomic(builder.inttoptr(args[0], _I64.as_pointer()), "acquire", 8)

    return sig, codegen


@intrinsic
def _store_release_i64(typingctx, addr, value):
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        builder.store_atomic(args[1], builder.inttoptr(args[0], _I64.as_pointer()), "release", 8)
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cas_i64(typingctx, addr, expected, new):
    """The int64 at address `addr` set to `new` if it holds `expected`, atomically; returns the
    value it held."""
    sig = types.int64(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        pair = builder.cmpxchg(ptr, args[1], args[2], "acq_rel", "acquire")
        return builder.extract_value(pair, 0)

    return sig, codegen


@intrinsic
def _add_release(typingctx, addr, value):
    """The int64 at address `addr` += value, atomically, after every earlier write of this
    thread (release: whoever reads the new sum with acquire sees them)."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], _I64.as_pointer())
        builder.atomic_rmw("add", ptr, args[1], "release")
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _pause(typingctx):
    """The spin-wait hint (x86 `pause`)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.call(_declare(builder.module, "llvm.x86.sse2.pause", ir.VoidType()), [])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _tsc(typingctx):
    """The time-stamp counter (x86 `rdtsc`: constant rate on every CPU the kernel runs on)."""
    sig = types.int64()

    def codegen(context, builder, signature, args):
        return builder.call(_declare(builder.module, "llvm.readcyclecounter", _I64), [])

    return sig, codegen


@njit(nogil=True, cache=True)
def tsc():
    """The time-stamp counter, from Python."""
    return _tsc()


_ptr_f32 = _typed_ptr(types.float32)
_ptr_i32 = _typed_ptr(types.int32)
_ptr_i64 = _typed_ptr(types.int64)
_ptr_i8 = _typed_ptr(types.int8)
_ptr_u8 = _typed_ptr(types.uint8)


# The block dot, written in LLVM IR with AVX2, FMA and F16C instructions (every x86-64 CPU
# since 2013-2015: Haswell, Zen): two chunks of 32 code bytes (128 inputs, eight scale blocks,
# one cache line of each row) per iteration.
_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())
_V8I8, _V8I16, _V32I8, _V16I16, _V8I32, _V8F32 = (
    ir.VectorType(_I8, 8), ir.VectorType(_I16, 8), ir.VectorType(_I8, 32),
    ir.VectorType(_I16, 16), ir.VectorType(_I32, 8), ir.VectorType(_F32, 8))
# twice the E2M1 value of each code (integers; the sign is bit 3)
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)
# the dot's table holds 2 * E2M1 + OFFSET (0..24: unsigned, as pmaddubsw takes its first
# operand); each block's sum then holds OFFSET * the block's input codes too, which an input
# carries precomputed (`_quantize`) and the dot subtracts
OFFSET = 12
# the block dot's sums are the dot times this: 2 * E2M1 (the table) times E4M3 / 256 (a scale
# read as fp16), both exact
DOT_SCALE = 2.0 / 256.0
_UNSCALE = np.float32(1.0 / DOT_SCALE)  # (a power of two: folded into the global scales)
# a pair of chunks' eight blocks (A0..A3, then B0..B3) as the dot sums them: lane k holds
# block _GROUP_ORDER[k], and block j sits in lane _GROUP_ORDER[j] (the order is its own inverse)
_GROUP_ORDER = (0, 1, 4, 5, 2, 3, 6, 7)  # [A0, A1, B0, B1, A2, A3, B2, B3]
_SCALE_SLOT = np.array(_GROUP_ORDER, np.int64)  # (as numba code indexes it)


def _declare(module: ir.Module, name: str, ret: ir.Type, *args: ir.Type) -> ir.Function:
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name)


def _splat(ty: ir.VectorType, value: int | float) -> ir.Constant:
    return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)


def _lanes(ty: ir.Type, values) -> ir.Constant:
    return ir.Constant(ir.VectorType(ty, len(values)), [ir.Constant(ty, v) for v in values])


def _add_neighbours(b: ir.IRBuilder, u: ir.Value, v: ir.Value) -> ir.Value:
    """[u0 + u1, u2 + u3, u4 + u5, u6 + u7, v0 + v1, ..., v6 + v7] of two <8 x float>."""
    return b.fadd(b.shuffle_vector(u, v, _lanes(_I32, range(0, 16, 2))),
                  b.shuffle_vector(u, v, _lanes(_I32, range(1, 16, 2))))


def _e4m3_as_half(b: ir.IRBuilder, codes: ir.Value) -> ir.Value:
    """<8 x float> of <8 x i8> E4M3 codes, each E4M3 / 256 exactly: the code's bits moved
    into fp16's (exponent bias 7 -> 15, subnormals included), then converted (F16C). 0x7F reads
    480 / 256, as the GPU kernels read it (a NaN scale is no checkpoint's)."""
    bits = b.shl(b.sext(codes, _V8I16), _splat(_V8I16, 7))  # the sign lands on bits 14 and 15
    bits = b.and_(bits, _splat(_V8I16, 0xBFFF - 0x10000))
    return b.fpext(b.bitcast(bits, ir.VectorType(ir.HalfType(), 8)), _V8F32)


def _dot_function(module: ir.Module, nrows: int, ntok: int) -> ir.Function:
    """`void dot(i8 *codes, i64 row_bytes, i8 *scales, i64 row_scales, i8 *xq, i64 xq_step,
    float *xs, i32 *xc, i64 xs_step, i64 chunks, float *out)`: for each of `nrows` weight rows
    (row j's codes and scales at j * row_bytes / j * row_scales past the first's) and each of
    `ntok` inputs (input t's xq at t * xq_step past the first's, its xs and xc at t *
    xs_step), the sum over blocks of 16 inputs of E4M3(scale) * xs * (sum of E2M1(code) * xq)
    times `DOT_SCALE`, into out[j * ntok + t] (`_quantize` gives xq's, xs's and xc's layouts);
    `chunks` >= 1 chunks of 32 code bytes per row, two per iteration and an odd last one
    alone. Per chunk the codes' products with xq are summed to int16 per four inputs; a pair
    of chunks' are then summed to one int32 per block (`_GROUP_ORDER`), less `OFFSET` times
    the block's xq (xc), and scaled in fp32. The rows share the inputs' loads, the inputs
    each row's decoded codes and scales, and all of them the loop."""
    if not 2 <= nrows * ntok <= 8:  # the final sums fill one vector
        raise ValueError(f"a block dot holds 2 to 8 accumulators, not {nrows} x {ntok}")
    name = f"tinyserve_nvfp4_i8_dot{nrows}x{ntok}"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    i8p, f32p = _I8.as_pointer(), _F32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [
        i8p, _I64, i8p, _I64, i8p, _I64, f32p, _I32.as_pointer(), _I64, _I64, f32p]), name)
    fn.linkage = "internal"
    codes, row_bytes, scales, row_scales, xq, xq_step, xs, xc, xs_step, chunks, out = fn.args
    pshufb = _declare(module, "llvm.x86.avx2.pshuf.b", _V32I8, _V32I8, _V32I8)
    maddubs = _declare(module, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, _V32I8, _V32I8)
    phaddw = _declare(module, "llvm.x86.avx2.phadd.w", _V16I16, _V16I16, _V16I16)
    maddwd = _declare(module, "llvm.x86.avx2.pmadd.wd", _V8I32, _V16I16, _V16I16)
    fma = _declare(module, "llvm.fma.v8f32", _V8F32, _V8F32, _V8F32, _V8F32)
    prefetch = _declare(module, "llvm.prefetch.p0", ir.VoidType(), i8p, _I32, _I32, _I32)
    entry, loop, after, tail, done = (fn.append_basic_block(n)
                                      for n in ("entry", "loop", "after", "tail", "done"))
    b = ir.IRBuilder(entry)

    def const(v: int) -> ir.Constant:
        return ir.Constant(_I64, v)

    def load(ptr: ir.Value, offset: ir.Value, ty: ir.Type) -> ir.Value:
        return b.load(b.bitcast(b.gep(ptr, [offset]), ty.as_pointer()), align=1)

    row_codes = [b.gep(codes, [b.mul(row_bytes, const(j))]) for j in range(nrows)]
    row_scale = [b.gep(scales, [b.mul(row_scales, const(j))]) for j in range(nrows)]
    tok_q = [b.gep(xq, [b.mul(xq_step, const(t))]) for t in range(ntok)]
    tok_s = [b.gep(xs, [b.mul(xs_step, const(t))]) for t in range(ntok)]
    tok_c = [b.gep(xc, [b.mul(xs_step, const(t))]) for t in range(ntok)]
    table = _lanes(_I8, [v + OFFSET for v in _E2M1_X2 * 2])

    def group(accs: list, g: ir.Value, both: bool) -> list:
        """The accumulators after pair of chunks `g` (`both`), or its first chunk alone (the
        second's sums and scales zero)."""
        if both:
            w_scale = [_e4m3_as_half(b, b.shuffle_vector(s, s, _lanes(_I32, _GROUP_ORDER)))
                       for s in (load(r, b.mul(g, const(8)), _V8I8) for r in row_scale)]
        else:  # (only the chunk's own four scales are read: the row may end there)
            four = ir.VectorType(_I8, 4)
            pad = [j if j < 4 else 4 for j in _GROUP_ORDER]  # (B's lanes: a zero)
            w_scale = [_e4m3_as_half(b, b.shuffle_vector(s, _splat(four, 0), _lanes(_I32, pad)))
                       for s in (load(r, b.mul(g, const(8)), four) for r in row_scale)]
        x_scale = [load(s, b.mul(g, const(8)), _V8F32) for s in tok_s]
        x_sums = [load(c, b.mul(g, const(8)), _V8I32) for c in tok_c]
        sums = {}  # (chunk, row, input) -> int16 per four inputs
        for c in range(2 if both else 1):
            chunk = b.add(b.mul(g, const(2)), const(c))
            x_even = [load(q, b.mul(chunk, const(64)), _V32I8) for q in tok_q]
            x_odd = [load(q, b.add(b.mul(chunk, const(64)), const(32)), _V32I8) for q in tok_q]
            for j, row in enumerate(row_codes):
                if c == 0:  # one line ahead per iteration: the reads stay in flight
                    b.call(prefetch, [b.gep(row, [b.add(b.mul(chunk, const(32)),
                                                        const(PREFETCH))]),
                                      *(ir.Constant(_I32, v) for v in (0, 3, 1))])
                code = load(row, b.mul(chunk, const(32)), _V32I8)
                w_even = b.call(pshufb, [table, b.and_(code, _splat(_V32I8, 15))])
                w_odd = b.call(pshufb, [table, b.lshr(code, _splat(_V32I8, 4))])
                for t in range(ntok):
                    # (w + OFFSET) times x, neighbours summed to int16: lanes 4b .. 4b + 3 hold
                    # block b of the chunk (at most 4 * 24 * 127 each, and 8 * 24 * 127 <
                    # 2^15 once a pair's are summed)
                    sums[c, j, t] = b.add(b.call(maddubs, [w_even, x_even[t]]),
                                          b.call(maddubs, [w_odd, x_odd[t]]))
        accs = list(accs)
        for j in range(nrows):
            for t in range(ntok):
                second = sums[1, j, t] if both else _splat(_V16I16, 0)
                blocks = b.sub(b.call(maddwd, [b.call(phaddw, [sums[0, j, t], second]),
                                               _splat(_V16I16, 1)]), x_sums[t])
                k = j * ntok + t
                accs[k] = b.call(fma, [b.sitofp(blocks, _V8F32),
                                       b.fmul(w_scale[j], x_scale[t]), accs[k]])
        return accs

    zeros = [_splat(_V8F32, 0.0)] * (nrows * ntok)
    pairs = b.lshr(chunks, const(1))
    b.cbranch(b.icmp_unsigned("!=", pairs, const(0)), loop, after)
    b.position_at_end(loop)
    i = b.phi(_I64)
    accs = [b.phi(_V8F32) for _ in zeros]
    looped = group(accs, i, True)
    i_next = b.add(i, const(1))
    i.add_incoming(const(0), entry)
    i.add_incoming(i_next, loop)
    for acc, acc_next, zero in zip(accs, looped, zeros, strict=True):
        acc.add_incoming(zero, entry)
        acc.add_incoming(acc_next, loop)
    b.cbranch(b.icmp_unsigned("<", i_next, pairs), loop, after)

    def merge(*incoming: tuple) -> list:
        """The accumulators where the blocks of `incoming` ((values, block), ...) meet."""
        phis = [b.phi(_V8F32) for _ in zeros]
        for values, block in incoming:
            for phi, v in zip(phis, values, strict=True):
                phi.add_incoming(v, block)
        return phis

    b.position_at_end(after)
    paired = merge((zeros, entry), (looped, loop))
    b.cbranch(b.icmp_unsigned("!=", b.and_(chunks, const(1)), const(0)), tail, done)
    b.position_at_end(tail)
    last = group(paired, pairs, False)
    b.branch(done)
    b.position_at_end(done)
    final = merge((paired, after), (last, tail))
    # every accumulator's eight lanes summed as ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 +
    # l7)), all of them at once: three rounds of adding neighbouring lanes of two vectors
    m = len(final)
    level = final
    for _ in range(3):
        level = [_add_neighbours(b, level[k], level[min(k + 1, len(level) - 1)])
                 for k in range(0, len(level), 2)]
    total = level[0]  # lanes 0..m-1: the m dots
    if m < 8:
        total = b.shuffle_vector(total, total, _lanes(_I32, range(m)))
    b.store(total, b.bitcast(out, ir.VectorType(_F32, m).as_pointer()), align=4)
    b.ret_void()
    return fn


def _dots(nrows: int, ntok: int):
    """The intrinsic `_dots(codes, row_bytes, scales, row_scales, xq, xs, xc, step, out)`:
    `nrows` weight rows (the first's codes uint8 [K/2] and scales uint8 [K/16], the others
    row_bytes / row_scales further on) against `ntok` quantized inputs (the first's xq int8
    [K], xs fp32 and xc int32 [`scale_words(K)`], rows of contiguous arrays; input t is `step`
    * t rows further on), into out fp32 [nrows * ntok] (row-major), times `DOT_SCALE`.
    K % 64 == 0."""

    @intrinsic
    def dots(typingctx, codes, row_bytes, scales, row_scales, xq, xs, xc, step, out):
        sig = types.void(codes, types.int64, scales, types.int64, xq, xs, xc, types.int64, out)

        def codegen(context, builder, signature, args):
            i8p, f32p = _I8.as_pointer(), _F32.as_pointer()

            def array(k):
                return context.make_array(signature.args[k])(context, builder, args[k])

            def data(k, ptr_type):
                return builder.bitcast(array(k).data, ptr_type)

            def length(k):
                return builder.extract_value(array(k).shape, 0)

            chunks = builder.udiv(length(0), ir.Constant(_I64, 32))
            builder.call(_dot_function(builder.module, nrows, ntok),
                         [data(0, i8p), args[1], data(2, i8p), args[3], data(4, i8p),
                          builder.mul(args[7], length(4)), data(5, f32p),
                          data(6, _I32.as_pointer()), builder.mul(args[7], length(5)), chunks,
                          data(8, f32p)])
            return context.get_dummy_value()

        return sig, codegen

    return dots


_dot2 = _dots(2, 1)  # a hidden unit's gate and up rows
_dot4 = _dots(4, 1)  # four neighbouring down rows
_dot2x2 = _dots(2, 2)  # the same for two inputs: the pairs of an expert decode its codes once
_dot4x2 = _dots(4, 2)


@njit(nogil=True, cache=True)
def scale_words(k):
    """The length of an input's scales (`_quantize`): eight per pair of chunks (128 inputs)."""
    return (k + 127) // 128 * 8


@njit(nogil=True, cache=True, error_model="numpy")
def _quantize(x, q, s, c, first, end):
    """x fp32 [K] -> q int8 [K], s fp32 and c int32 [`scale_words(K)`], blocks `first` to
    `end` - 1 of 16 inputs: per block s = max|x| * (1 / 127), q = round(x * (127 / max|x|))
    and c = `OFFSET` * the sum of its q. q is stored per chunk of 64 inputs as its 32 even
    inputs then its 32 odd ones (the order the dot splits the code bytes in), s and c per pair
    of chunks in the order the dot sums their blocks (`_GROUP_ORDER`; an odd last chunk's pair
    leaves its second chunk's four words alone: zeros where the caller made them so). The
    same bits as the torch reference, also where numba compiles it with a fast-math caller's
    flags (`gate_up_item`), which may turn a division by a constant into a multiply."""
    for blk in range(first, end):
        amax = np.float32(0.0)
        for i in range(blk * 16, blk * 16 + 16):
            amax = max(amax, abs(x[i]))
        slot = blk // 8 * 8 + _SCALE_SLOT[blk % 8]
        s[slot] = amax * np.float32(1.0 / 127.0)
        inv = np.float32(127.0) / amax if amax > 0 else np.float32(0.0)
        base = (blk // 4) * 64 + (blk % 4) * 8
        total = 0
        for j in range(8):
            even = np.int8(np.round(x[blk * 16 + 2 * j] * inv))
            odd = np.int8(np.round(x[blk * 16 + 2 * j + 1] * inv))
            q[base + j], q[base + 32 + j] = even, odd
            total += np.int32(even) + np.int32(odd)
        c[slot] = OFFSET * total


@njit(nogil=True, cache=True)
def group_pairs(flat):
    """The pairs of flat rows [N * k] that have a row (>= 0), grouped by row (ascending;
    stable within a row): (pairs, starts, groups), group u = pairs[starts[u]:starts[u + 1]]."""
    order = np.argsort(flat, kind="mergesort")
    first = 0
    while first < order.shape[0] and flat[order[first]] < 0:
        first += 1
    pairs = order[first:]
    npairs = pairs.shape[0]
    starts = np.zeros(npairs + 1, np.int64)
    groups = 0
    for p in range(npairs):
        if p == 0 or flat[pairs[p]] != flat[pairs[p - 1]]:
            starts[groups] = p
            groups += 1
    starts[groups] = npairs
    return pairs, starts, groups


def _silu_mul_function(module: ir.Module) -> ir.Function:
    """`void silu_mul(float *gate, float *up, i64 n)`: gate[i] = silu(gate[i]) * up[i] for i <
    n (n % 8 == 0), eight at a time: exp(-g) as Cephes' expf (2^k times a polynomial of the
    remainder; the product within 1e-6 of fp64 math), -g clamped to [-87, 88] (2^k stays
    normal) and silu(g) 0 for -g > 88, as fp32 math gives it."""
    name = "tinyserve_silu_mul"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    f32p = _F32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(ir.VoidType(), [f32p, f32p, _I64]), name)
    fn.linkage = "internal"
    gate, up, n = fn.args
    fma = _declare(module, "llvm.fma.v8f32", _V8F32, _V8F32, _V8F32, _V8F32)
    rint = _declare(module, "llvm.rint.v8f32", _V8F32, _V8F32)
    entry, loop, done = (fn.append_basic_block(k) for k in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.cbranch(b.icmp_unsigned("!=", n, ir.Constant(_I64, 0)), loop, done)
    b.position_at_end(loop)
    i = b.phi(_I64)
    g_ptr = b.bitcast(b.gep(gate, [i]), _V8F32.as_pointer())
    g = b.load(g_ptr, align=4)
    u = b.load(b.bitcast(b.gep(up, [i]), _V8F32.as_pointer()), align=4)

    def c(v: float) -> ir.Constant:
        return _splat(_V8F32, v)

    x = b.fsub(c(0.0), g)
    vanish = b.fcmp_ordered(">", x, c(88.0))
    x = b.select(b.fcmp_ordered("<", x, c(-87.0)), c(-87.0), b.select(vanish, c(88.0), x))
    k = b.call(rint, [b.fmul(x, c(1.4426950408889634))])
    r = b.call(fma, [k, c(-0.693359375), x])
    r = b.call(fma, [k, c(2.12194440e-4), r])
    p = c(1.9875691500e-4)
    for coef in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                 5.0000001201e-1):
        p = b.call(fma, [p, r, c(coef)])
    e_r = b.fadd(b.call(fma, [b.fmul(p, r), r, r]), c(1.0))  # p r^2 + r + 1
    two_k = b.bitcast(b.shl(b.add(b.fptosi(k, _V8I32), _splat(_V8I32, 127)),
                            _splat(_V8I32, 23)), _V8F32)
    e = b.fmul(e_r, two_k)
    b.store(b.select(vanish, c(0.0), b.fdiv(b.fmul(g, u), b.fadd(c(1.0), e))), g_ptr, align=4)
    i_next = b.add(i, ir.Constant(_I64, 8))
    i.add_incoming(ir.Constant(_I64, 0), entry)
    i.add_incoming(i_next, loop)
    b.cbranch(b.icmp_unsigned("<", i_next, n), loop, done)
    b.position_at_end(done)
    b.ret_void()
    return fn


@intrinsic
def _silu_mul(typingctx, gate, up):
    """gate[i] = silu(gate[i]) * up[i], in place: contiguous fp32 [n], n % 8 == 0."""
    sig = types.void(gate, up)

    def codegen(context, builder, signature, args):
        f32p = _F32.as_pointer()
        g, u = (context.make_array(t)(context, builder, a)
                for t, a in zip(signature.args, args, strict=True))
        builder.call(_silu_mul_function(builder.module),
                     [builder.bitcast(g.data, f32p), builder.bitcast(u.data, f32p),
                      builder.extract_value(g.shape, 0)])
        return context.get_dummy_value()

    return sig, codegen


@njit(fastmath=True, nogil=True, cache=True, error_model="numpy")
def gate_up_item(item, flat, pairs, starts, topk, w13, s13, g13, xq, xs, xc, hid, hq, hs, hc):
    """Work item `item` of the first region: expert group item // (F / RB), its block of RB
    hidden units: their gate and up rows (for two of the group's pairs at a time), then
    silu(gate) * up into hid, rounded as x is into hq / hs (whole scale blocks: RB % 16 ==
    0)."""
    f = hid.shape[1]
    nb1 = f // RB
    u = item // nb1
    r = flat[pairs[starts[u]]]
    first = item % nb1 * RB
    g_gate, g_up = g13[r, 0] * _UNSCALE, g13[r, 1] * _UNSCALE
    up_bytes, up_scales = f * w13.shape[2], f * s13.shape[2]
    lo, hi = starts[u], starts[u + 1]
    dot = np.empty(4, np.float32)
    ups = np.empty((hi - lo, RB), np.float32)  # (the gates go to hid)
    for o in range(first, first + RB):
        for p in range(lo, hi, 2):
            t = pairs[p] // topk
            if p + 1 < hi:
                _dot2x2(w13[r, o], up_bytes, s13[r, o], up_scales, xq[t], xs[t], xc[t],
                        pairs[p + 1] // topk - t, dot)
                hid[p, o], ups[p - lo, o - first] = dot[0] * g_gate, dot[2] * g_up
                hid[p + 1, o], ups[p + 1 - lo, o - first] = dot[1] * g_gate, dot[3] * g_up
            else:
                _dot2(w13[r, o], up_bytes, s13[r, o], up_scales, xq[t], xs[t], xc[t], 0, dot)
                hid[p, o], ups[p - lo, o - first] = dot[0] * g_gate, dot[1] * g_up
    for p in range(lo, hi):
        _silu_mul(hid[p, first:first + RB], ups[p - lo])
        _quantize(hid[p], hq[p], hs[p], hc[p], first // 16, (first + RB) // 16)


@njit(fastmath=True, nogil=True, cache=True, error_model="numpy")
def down_item(item, flat, pairs, starts, groups, topk, wts, w2, s2, g2, hq, hs, hc, out, acc):
    """Work item `item` of the second region: its block of RB down rows, one expert's rows
    after another (each a contiguous stretch of its matrix), four rows and two of the
    expert's pairs per pass, every output summed over the pairs in a fixed order (`acc`:
    [RB, N] scratch)."""
    n = out.shape[0]
    first = item * RB
    flat_w = wts.reshape(-1)
    row_bytes, row_scales = w2.shape[2], s2.shape[2]
    dot = np.empty(8, np.float32)
    acc[:, :] = 0.0
    for u in range(groups):
        r = flat[pairs[starts[u]]]
        lo, hi = starts[u], starts[u + 1]
        g = g2[r] * _UNSCALE
        for o in range(0, RB, 4):
            for p in range(lo, hi, 2):
                q = pairs[p]
                if p + 1 < hi:  # the pairs' hidden rows are neighbours in hq / hs
                    _dot4x2(w2[r, first + o], row_bytes, s2[r, first + o], row_scales,
                            hq[p], hs[p], hc[p], 1, dot)
                    q1 = pairs[p + 1]
                    for j in range(4):
                        acc[o + j, q // topk] += flat_w[q] * g * dot[2 * j]
                        acc[o + j, q1 // topk] += flat_w[q1] * g * dot[2 * j + 1]
                else:
                    _dot4(w2[r, first + o], row_bytes, s2[r, first + o], row_scales,
                          hq[p], hs[p], hc[p], 0, dot)
                    for j in range(4):
                        acc[o + j, q // topk] += flat_w[q] * g * dot[j]
    for t in range(n):
        for o in range(RB):
            out[t, first + o] = acc[o, t]


# Work items are claimed from shares: thread t starts on its own contiguous share of a region's
# items (it streams through neighbouring rows), then takes what is left of the others'. A
# share is int64 [8] (a cache line): its next item and its end, each tagged with the region's
# number in the high 32 bits, so a claim succeeds only for an item of the region that is
# running. A call waits for its items, never for its threads: a thread the OS preempts or
# wakes late (the engine's own threads share the cores) holds up at most the one item it
# claimed, and one that arrives after the region finds nothing to claim.
_LOW = (1 << 32) - 1


@njit(nogil=True, cache=True)
def _open_shares(shares, tag, items, threads):
    """Shares [threads, 8] of region `tag`'s `items` items (each end written before its next:
    a claim that reads the new next reads the new end)."""
    per = (items + threads - 1) // threads
    base = shares.ctypes.data
    for s in range(threads):
        end = min(items, (s + 1) * per)
        shares[s, 1] = (tag << 32) | end
        _store_release_i64(base + 64 * s, (tag << 32) | min(s * per, end))


@njit(nogil=True, cache=True)
def _claim(shares_address, share, tag):
    """The next item of share `share` of region `tag` (claimed atomically), or -1 once it has
    none or the region is no longer `tag`."""
    next_address = shares_address + 64 * share
    v = _load_acquire_i64(next_address)
    while True:
        end = _load_acquire_i64(next_address + 8)
        if v >> 32 != tag or end >> 32 != tag or (v & _LOW) >= (end & _LOW):
            return -1
        seen = _cas_i64(next_address, v, v + 1)
        if seen == v:
            return v & _LOW
        v = seen


@njit(fastmath=True, nogil=True, cache=True, error_model="numpy")
def region(r, tid, threads, tag, shares_address, item, groups, flat, pairs, starts, wts, w13,
           s13, g13, w2, s2, g2, xq, xs, xc, hid, hq, hs, hc, out):
    """Thread `tid`'s part of region `r` (1: gate_up items, 2: down items) of region number
    `tag`: `item` (-1: none) claimed from its own share, then every item it can claim from
    its share and the others'. Returns the number of items it ran."""
    topk = wts.shape[1]
    acc = np.empty((RB if r == 2 else 0, out.shape[0]), np.float32)
    count = 0
    for v in range(threads):
        share = (tid + v) % threads
        if item < 0:
            item = _claim(shares_address, share, tag)
        while item >= 0:
            if r == 1:
                gate_up_item(item, flat, pairs, starts, topk, w13, s13, g13, xq, xs, xc, hid,
                             hq, hs, hc)
            else:
                down_item(item, flat, pairs, starts, groups, topk, wts, w2, s2, g2, hq, hs, hc,
                          out, acc)
            count += 1
            item = _claim(shares_address, share, tag)
    return count


@njit(nogil=True, cache=True)
def _items(r, groups, f, h):
    return groups * (f // RB) if r == 1 else h // RB


@njit(nogil=True, cache=True, error_model="numpy")
def _prepare(x, rows, f):
    """A call's shared state: (flat rows, pairs, starts, groups, xq, xs, xc, hid, hq, hs,
    hc)."""
    n, h = x.shape
    flat = rows.reshape(-1)
    pairs, starts, groups = group_pairs(flat)
    xq = np.empty((n, h), np.int8)
    xs = np.zeros((n, scale_words(h)), np.float32)
    xc = np.zeros((n, scale_words(h)), np.int32)
    for t in range(n):
        _quantize(x[t], xq[t], xs[t], xc[t], 0, h // 16)
    npairs = pairs.shape[0]
    return (flat, pairs, starts, groups, xq, xs, xc, np.empty((npairs, f), np.float32),
            np.empty((npairs, f), np.int8), np.zeros((npairs, scale_words(f)), np.float32),
            np.zeros((npairs, scale_words(f)), np.int32))


# A pool of helper threads (kernels.moe.cpu.HelperPool): numba's parallel regions each take the
# GIL to start, so a Python thread running bytecode would hold every call up (a switch
# interval a region). The pool's control block, int64 words: the region word (an int32: the
# region's number * 256 + its threads; number = tag, mod 2^22), the address of the job (int64
# [JW]: the region, the call's shapes and its arrays' addresses, written before the word), the
# items helpers finished in the region, STOP, the idle spin, doze and usleep of every thread
# of the pool (`serve`'s docstring), the number of helpers and the address of the shares
# (int64 [helpers + 1, 8]). The job and the shares belong to the pool and outlive every call.
PW = 9
P_REGION, P_JOB, P_DONE, P_STOP, P_SPIN, P_DOZE, P_USLEEP, P_HELPERS, P_SHARES = range(PW)
JW = 27


@njit(nogil=True, cache=True, error_model="numpy")
def _set_job(j, r, groups, flat, pairs, starts, wts, w13, s13, g13, w2, s2, g2, xq, xs, xc,
             hid, hq, hs, hc, out):
    n, h = out.shape
    j[0], j[1], j[2], j[3], j[4] = r, n, wts.shape[1], w13.shape[0], h
    j[5], j[6], j[7] = hid.shape[1], groups, pairs.shape[0]
    arrays = (flat.ctypes.data, pairs.ctypes.data, starts.ctypes.data, wts.ctypes.data,
              w13.ctypes.data, s13.ctypes.data, g13.ctypes.data, w2.ctypes.data,
              s2.ctypes.data, g2.ctypes.data, xq.ctypes.data, xs.ctypes.data, xc.ctypes.data,
              hid.ctypes.data, hq.ctypes.data, hs.ctypes.data, hc.ctypes.data, out.ctypes.data)
    for i in range(len(arrays)):
        j[8 + i] = arrays[i]


@njit(nogil=True, cache=True, error_model="numpy")
def _work(pool_address, tid, tag, threads):
    """Thread `tid`'s part of region `tag` of the pool's job: nothing unless it claims an
    item while the region runs (the job is the region's until its last item is done)."""
    pool = carray(_ptr_i64(pool_address), (PW,))
    shares_address = pool[P_SHARES]
    item, v = -1, 0
    while item < 0 and v < threads:
        item = _claim(shares_address, (tid + v) % threads, tag)
        v += 1
    if item < 0:
        return
    j = carray(_ptr_i64(pool[P_JOB]), (JW,))
    r, n, topk, nrows, h, f, groups, npairs = j[0], j[1], j[2], j[3], j[4], j[5], j[6], j[7]
    count = region(r, (tid + v - 1) % threads, threads, tag, shares_address, item, groups,
                   carray(_ptr_i64(j[8]), (n * topk,)), carray(_ptr_i64(j[9]), (npairs,)),
                   carray(_ptr_i64(j[10]), (npairs + 1,)), carray(_ptr_f32(j[11]), (n, topk)),
                   carray(_ptr_u8(j[12]), (nrows, 2 * f, h // 2)),
                   carray(_ptr_u8(j[13]), (nrows, 2 * f, h // 16)),
                   carray(_ptr_f32(j[14]), (nrows, 2)),
                   carray(_ptr_u8(j[15]), (nrows, h, f // 2)),
                   carray(_ptr_u8(j[16]), (nrows, h, f // 16)),
                   carray(_ptr_f32(j[17]), (nrows,)), carray(_ptr_i8(j[18]), (n, h)),
                   carray(_ptr_f32(j[19]), (n, scale_words(h))),
                   carray(_ptr_i32(j[20]), (n, scale_words(h))),
                   carray(_ptr_f32(j[21]), (npairs, f)), carray(_ptr_i8(j[22]), (npairs, f)),
                   carray(_ptr_f32(j[23]), (npairs, scale_words(f))),
                   carray(_ptr_i32(j[24]), (npairs, scale_words(f))),
                   carray(_ptr_f32(j[25]), (n, h)))
    _add_release(pool_address + 8 * P_DONE, count)


@njit(nogil=True, cache=True, error_model="numpy")
def moe_pooled(x, rows, wts, w13, s13, g13, w2, s2, g2, out, threads, pool_address):
    """Every pair's expert (module docstring of kernels.moe.cpu) on the calling thread and the
    helpers of the pool at `pool_address` (no GIL), on at most `threads` of them; returns the
    number of distinct experts computed. Each region is the caller's to finish: helpers take
    items as they come, and it returns once every item is done."""
    pool = carray(_ptr_i64(pool_address), (PW,))
    threads = min(threads, pool[P_HELPERS] + 1)
    f, h = w2.shape[2] * 2, out.shape[1]
    flat, pairs, starts, groups, xq, xs, xc, hid, hq, hs, hc = _prepare(x, rows, f)
    if groups == 0:
        out[:] = 0.0
        return 0
    shares = carray(_ptr_i64(pool[P_SHARES]), (threads, 8))
    job = carray(_ptr_i64(pool[P_JOB]), (JW,))
    for r in (1, 2):
        items = _items(r, groups, f, h)
        tag = ((_load_acquire_i32(pool_address) >> 8) + 1) % (1 << 22)
        _set_job(job, r, groups, flat, pairs, starts, wts, w13, s13, g13, w2, s2, g2, xq, xs,
                 xc, hid, hq, hs, hc, out)
        _open_shares(shares, tag, items, threads)
        pool[P_DONE] = 0
        _store_release_i32(pool_address, tag * 256 + threads)
        mine = region(r, 0, threads, tag, pool[P_SHARES], -1, groups, flat, pairs, starts, wts,
                      w13, s13, g13, w2, s2, g2, xq, xs, xc, hid, hq, hs, hc, out)
        while _load_acquire_i64(pool_address + 8 * P_DONE) + mine < items:
            _pause()
    return groups


@njit(nogil=True, cache=True)
def _idle(pool, last):
    """Wait a little, by how long the thread has been idle (`serve`'s docstring)."""
    idle = _tsc() - last
    if idle < pool[P_SPIN]:
        _pause()
    else:
        _call_i32(pool[P_USLEEP], 50 if idle < pool[P_SPIN] + pool[P_DOZE] else 1000)


@cfunc(types.void(types.voidptr), nopython=True, cache=True)
def helper(control):
    """`void helper(int64 *control)`: helper thread control[1] of the pool at control[0]. It
    joins every region whose threads exceed its number, idles as `serve` does between them,
    returns on STOP."""
    c = carray(_ptr_i64(_addr(control)), (2,))
    pool_address, tid = c[0], c[1]
    pool = carray(_ptr_i64(pool_address), (PW,))
    seen = 0  # the word before any region: a helper that starts late joins the first one
    last = _tsc()
    while True:
        word = _load_acquire_i32(pool_address)
        if word != seen:
            seen = word
            if tid < word % 256:  # (a helper the calls leave out goes idle)
                _work(pool_address, tid, word >> 8, word % 256)
                last = _tsc()
        elif _load_acquire_i32(pool_address + 8 * P_STOP) != 0:
            return
        else:
            _idle(pool, last)




@njit(nogil=True, cache=True)
def _run(address, pool_address):
    """One call described by the descriptor at `address` (kernels.moe.cpu.host_descriptor),
    on the pool at `pool_address`."""
    d = carray(_ptr_i64(address), (DW,))
    n, topk, base = d[2], d[3], d[4]
    nrows, h, f = d[11], d[12], d[13]
    width = h + 2 * topk
    stage_f = carray(_ptr_f32(d[0]), (n, width))
    stage_i = carray(_ptr_i32(d[0]), (n, width))
    out = carray(_ptr_f32(d[1]), (n, h))
    w13 = carray(_ptr_u8(d[5]), (nrows, 2 * f, h // 2))
    s13 = carray(_ptr_u8(d[6]), (nrows, 2 * f, h // 16))
    g13 = carray(_ptr_f32(d[7]), (nrows, 2))
    w2 = carray(_ptr_u8(d[8]), (nrows, h, f // 2))
    s2 = carray(_ptr_u8(d[9]), (nrows, h, f // 16))
    g2 = carray(_ptr_f32(d[10]), (nrows,))
    x = np.empty((n, h), np.float32)
    rows = np.empty((n, topk), np.int64)
    wts = np.empty((n, topk), np.float32)
    for t in range(n):
        for i in range(h):
            x[t, i] = stage_f[t, i]
        for j in range(topk):
            r = stage_i[t, h + j]
            rows[t, j] = r + base if r >= 0 else -1
            wts[t, j] = stage_f[t, h + topk + j]
    d[14] += moe_pooled(x, rows, wts, w13, s13, g13, w2, s2, g2, out, d[16], pool_address)
    d[15] += 1


@cfunc(types.void(types.voidptr), nopython=True, cache=True)
def serve(control):
    """`void serve(void *control)`: the worker loop of kernels.moe.cpu.HostWorker. Waits for
    a request (flag GO = i + 1), runs descriptor table[i] on the pool, then answers (DONE =
    i + 1); spins until the pool's SPIN time-stamp-counter ticks passed without a request,
    then sleeps 50 us between polls, and 1 ms once DOZE more ticks passed (an idle server
    costs next to nothing); returns on STOP."""
    c = carray(_ptr_i64(_addr(control)), (4,))  # flags, table, its size, the pool
    go, done, stop = c[0], c[0] + 4, c[0] + 8
    table = carray(_ptr_i64(c[1]), (c[2],))
    pool = carray(_ptr_i64(c[3]), (PW,))
    last = _tsc()
    while True:
        i = _load_acquire_i32(go)
        if i > 0:
            _store_release_i32(go, 0)
            _run(table[i - 1], c[3])
            _store_release_i32(done, i)
            last = _tsc()
        elif _load_acquire_i32(stop) != 0:
            return
        else:
            _idle(pool, last)


def build(row_block: int, desc_words: int, pool_words: int) -> SimpleNamespace:
    """The compiled kernels: `moe_pooled`, the worker and helper loops' addresses, the job's
    size, the host read probe and the time-stamp counter."""
    if (row_block, desc_words, pool_words) != (RB, DW, PW):
        raise ValueError("kernels.moe.cpu and its numba code disagree on their constants")
    return SimpleNamespace(moe_pooled=moe_pooled, serve_address=serve.address,
                           helper_address=helper.address, job_words=JW, read_sum=read_sum,
                           tsc=tsc)


@njit(parallel=True, nogil=True, cache=True, error_model="numpy")
def read_sum(words):
    """Sum of uint64 words [n] read by every thread (a host read-bandwidth probe)."""
    chunks = 256
    per = (words.shape[0] + chunks - 1) // chunks
    part = np.zeros(chunks, np.uint64)
    for c in prange(chunks):
        chunk = words[c * per:(c + 1) * per]  # indexed from 0: the loop vectorizes
        acc = np.uint64(0)
        for i in range(chunk.shape[0]):
            acc += chunk[i]
        part[c] = acc
    return part.sum()

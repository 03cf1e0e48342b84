"""LLVM IR for the numba code of the CPU expert kernel (`cpu_numba.py`): pointers from
addresses, atomics and the spin-wait hint for its thread pool, and the block dot in AVX2."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

# code bytes the dot prefetches ahead of its loads: rows are contiguous, so this runs into the
# next rows of the work item and keeps the memory reads in flight while the core computes
PREFETCH = 2048


@intrinsic
def addr(typingctx, ptr):
    sig = types.int64(types.voidptr)

    def codegen(context, builder, signature, args):
        return builder.ptrtoint(args[0], ir.IntType(64))

    return sig, codegen


def typed_ptr(dtype):
    @intrinsic
    def ptr(typingctx, addr):
        sig = types.CPointer(dtype)(types.int64)

        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return sig, codegen

    return ptr


@intrinsic
def call_i32(typingctx, addr, value):
    """`int f(int)` at address `addr` called with `value` (libc's usleep, reached through an
    address passed in: a cached function may not hold a ctypes object)."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        fn = builder.inttoptr(args[0], ir.FunctionType(i32, [i32]).as_pointer())
        return builder.sext(builder.call(fn, [builder.trunc(args[1], i32)]), ir.IntType(64))

    return sig, codegen


def load_acquire(bits: int):
    @intrinsic
    def load(typingctx, addr):
        """The int at address `addr`, read with acquire ordering (never hoisted out of a
        loop)."""
        sig = types.int64(types.int64)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            value = builder.load_atomic(ptr, "acquire", bits // 8)
            return value if bits == 64 else builder.sext(value, ir.IntType(64))

        return sig, codegen

    return load


def store_release(bits: int):
    @intrinsic
    def store(typingctx, addr, value):
        sig = types.void(types.int64, types.int64)

        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(bits).as_pointer())
            value = args[1] if bits == 64 else builder.trunc(args[1], ir.IntType(bits))
            builder.store_atomic(value, ptr, "release", bits // 8)
            return context.get_dummy_value()

        return sig, codegen

    return store


@intrinsic
def fetch_add(typingctx, addr, value):
    """Atomically add `value` to the int64 at `addr`; returns the value before."""
    sig = types.int64(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
        return builder.atomic_rmw("add", ptr, args[1], "acq_rel")

    return sig, codegen


load_acquire_i32, load_acquire_i64 = load_acquire(32), load_acquire(64)
store_release_i32, store_release_i64 = store_release(32), store_release(64)


@intrinsic
def pause(typingctx):
    """The spin-wait hint (x86 `pause`)."""
    sig = types.void()

    def codegen(context, builder, signature, args):
        builder.call(declare(builder.module, "llvm.x86.sse2.pause", ir.VoidType()), [])
        return context.get_dummy_value()

    return sig, codegen


ptr_f32 = typed_ptr(types.float32)
ptr_i32 = typed_ptr(types.int32)
ptr_i64 = typed_ptr(types.int64)
ptr_u8 = typed_ptr(types.uint8)
ptr_i8 = typed_ptr(types.int8)


# The block dot, written in LLVM IR with AVX2 instructions (every x86-64 CPU since 2013-2015:
# Haswell, Zen): 32 code bytes (64 inputs, four scale blocks) per iteration.
_I8, _I16, _I32, _I64, _F32 = (ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64),
                               ir.FloatType())
_V32I8, _V16I16, _V8I32, _V4F32, _V8F32 = (ir.VectorType(_I8, 32), ir.VectorType(_I16, 16),
                                           ir.VectorType(_I32, 8), ir.VectorType(_F32, 4),
                                           ir.VectorType(_F32, 8))
# twice the E2M1 value of each code (integers; the sign is bit 3)
_E2M1_X2 = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def declare(module: ir.Module, name: str, ret: ir.Type, *args: ir.Type) -> ir.Function:
    fn = module.globals.get(name)
    return fn if fn is not None else ir.Function(module, ir.FunctionType(ret, args), name)


def splat(ty: ir.VectorType, value: int | float) -> ir.Constant:
    return ir.Constant(ty, [ir.Constant(ty.element, value)] * ty.count)


def dot_function(module: ir.Module) -> ir.Function:
    """`float dot(i8 *codes, i8 *scales, float *e4, i8 *xq, float *xs, i64 chunks)`: the sum
    over blocks of 16 inputs of e4[scales[b]] * xs[b] * (sum of 2 * E2M1(code) * xq) (see
    `_quantize` for xq's layout); `chunks` >= 1 iterations of 32 code bytes."""
    name = "tinyserve_nvfp4_i8_dot"
    fn = module.globals.get(name)
    if fn is not None:
        return fn
    i8p, f32p = _I8.as_pointer(), _F32.as_pointer()
    fn = ir.Function(module, ir.FunctionType(_F32, [i8p, i8p, f32p, i8p, f32p, _I64]), name)
    fn.linkage = "internal"
    codes, scales, e4, xq, xs, chunks = fn.args
    pshufb = declare(module, "llvm.x86.avx2.pshuf.b", _V32I8, _V32I8, _V32I8)
    psign = declare(module, "llvm.x86.avx2.psign.b", _V32I8, _V32I8, _V32I8)
    maddubs = declare(module, "llvm.x86.avx2.pmadd.ub.sw", _V16I16, _V32I8, _V32I8)
    maddwd = declare(module, "llvm.x86.avx2.pmadd.wd", _V8I32, _V16I16, _V16I16)
    entry, loop, done = (fn.append_basic_block(n) for n in ("entry", "loop", "done"))
    b = ir.IRBuilder(entry)
    b.branch(loop)
    b.position_at_end(loop)
    i = b.phi(_I64)
    acc = b.phi(_V8F32)

    def const(v: int) -> ir.Constant:
        return ir.Constant(_I64, v)

    def load(ptr: ir.Value, offset: ir.Value, ty: ir.VectorType) -> ir.Value:
        return b.load(b.bitcast(b.gep(ptr, [offset]), ty.as_pointer()), align=1)

    prefetch = declare(module, "llvm.prefetch.p0", ir.VoidType(), i8p, _I32, _I32, _I32)
    b.call(prefetch, [b.gep(codes, [b.add(b.mul(i, const(32)), const(PREFETCH))]),
                      *(ir.Constant(_I32, v) for v in (0, 3, 1))])
    c = load(codes, b.mul(i, const(32)), _V32I8)
    table = ir.Constant(_V32I8, [ir.Constant(_I8, v & 0xFF) for v in _E2M1_X2 * 2])
    w_even = b.call(pshufb, [table, b.and_(c, splat(_V32I8, 15))])
    w_odd = b.call(pshufb, [table, b.lshr(c, splat(_V32I8, 4))])
    x_even = load(xq, b.mul(i, const(64)), _V32I8)
    x_odd = load(xq, b.add(b.mul(i, const(64)), const(32)), _V32I8)
    # |w| (unsigned) times x with w's sign, pairs summed to int16, then quads to int32: lanes
    # 2b and 2b + 1 hold scale block b of the chunk
    pairs = b.add(b.call(maddubs, [b.call(psign, [w_even, w_even]),
                                   b.call(psign, [x_even, w_even])]),
                  b.call(maddubs, [b.call(psign, [w_odd, w_odd]),
                                   b.call(psign, [x_odd, w_odd])]))
    quads = b.sitofp(b.call(maddwd, [pairs, splat(_V16I16, 1)]), _V8F32)
    w_scale = ir.Constant(_V4F32, ir.Undefined)
    for j in range(4):
        code = b.zext(b.load(b.gep(scales, [b.add(b.mul(i, const(4)), const(j))])), _I64)
        w_scale = b.insert_element(w_scale, b.load(b.gep(e4, [code])), ir.Constant(_I32, j))
    scale = b.fmul(w_scale, load(xs, b.mul(i, const(4)), _V4F32))
    pick = ir.Constant(ir.VectorType(_I32, 8), [ir.Constant(_I32, j // 2) for j in range(8)])
    scale = b.shuffle_vector(scale, scale, pick)
    acc_next = b.fadd(acc, b.fmul(quads, scale))
    i_next = b.add(i, const(1))
    i.add_incoming(const(0), entry)
    i.add_incoming(i_next, loop)
    acc.add_incoming(splat(_V8F32, 0.0), entry)
    acc.add_incoming(acc_next, loop)
    b.cbranch(b.icmp_unsigned("<", i_next, chunks), loop, done)
    b.position_at_end(done)
    lane = [b.extract_element(acc_next, ir.Constant(_I32, j)) for j in range(8)]
    while len(lane) > 1:
        lane = [b.fadd(lane[j], lane[j + 1]) for j in range(0, len(lane), 2)]
    b.ret(lane[0])
    return fn


@intrinsic
def dot(typingctx, codes, scales, e4, xq, xs):
    """One weight row (codes uint8 [K/2], scales uint8 [K/16]) against one quantized input
    (xq int8 [K], xs fp32 [K/16]); twice the dot (the table holds 2 * E2M1), before the row's
    global scale. K % 64 == 0."""
    sig = types.float32(codes, scales, e4, xq, xs)

    def codegen(context, builder, signature, args):
        i8p, f32p = _I8.as_pointer(), _F32.as_pointer()
        ptrs = [builder.bitcast(context.make_array(t)(context, builder, v).data, p)
                for t, v, p in zip(signature.args, args, (i8p, i8p, f32p, i8p, f32p),
                                   strict=True)]
        codes_array = context.make_array(signature.args[0])(context, builder, args[0])
        chunks = builder.udiv(builder.extract_value(codes_array.shape, 0), ir.Constant(_I64, 32))
        return builder.call(dot_function(builder.module), [*ptrs, chunks])

    return sig, codegen

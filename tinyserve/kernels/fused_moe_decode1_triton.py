"""One-launch deterministic NVFP4 MoE decode ("fused1" path of `kernels/fused_moe.py`).

The two programs of the two-launch decode (`fused_moe_decode_triton`) in one 1-D grid:
program ids [0, G) are the gate_up programs (G = N * KP * F / BLOCK_F; pair q = pid mod
N * KP fastest, as the two-launch grid dispatches them), [G, G + D) the down programs
(D = N * cdiv(H, BLOCK_H); token t = (pid - G) mod N fastest). Same helpers, same tiles,
same arithmetic: the same bits as the two-launch path run with `down_warps = num_warps`.

Meeting point, per token t, two int32 counters in a workspace that is zero between
launches (`arrive[t]`, `done[t]`):

- a gate_up program stores its h chunk, `debug_barrier` (every thread's stores before the
  signal), then one gpu-scope release add of 1 to arrive[t];
- a down program first issues its weight loads (`down_loads`: codes and scales of its rows
  for all pairs, the pair factors; none depends on h), then spins until arrive[t] reaches
  KP * F / BLOCK_F (every gate_up program of its token) with gpu-scope acquire loads
  (SPIN_ASM: `ld.acquire.gpu` by every thread, no read-modify-write on the hot address;
  else a scalar `atomic_add(0, sem="acquire")`), then reads h and finishes (`down_finish`:
  fixed-order sums, one writer per output element);
- after that, `debug_barrier` and one acq_rel add of 1 to done[t]; the program that sees
  done[t] == D_t - 1 is the token's last: every down program of t has left its spin, so it
  sets arrive[t] and done[t] back to 0. The next launch (stream-ordered after this one, in
  a graph or eagerly) finds zeros: no memset launch, graph-safe.

Forward progress assumes the hardware dispatches CTAs in increasing linear block index
(what CUDA does in practice, not a documented guarantee): a down program (higher id) is
resident only once every gate_up program has been dispatched, and gate_up programs never
wait, so they all finish. A spin is bounded by MAX_SPIN polls (~1 s) so that a broken
assumption gives wrong output (the tests see it) instead of a hung GPU. One workspace per
device: two launches must not run concurrently on different streams. Under
TRITON_INTERPRET=1 programs run one after the other in id order (every gate_up program
before any down program), which exercises the counters and reset, not the concurrency.

This module imports triton at the top (the launcher imports it lazily).
"""

from __future__ import annotations

import triton
import triton.language as tl

from tinyserve.kernels.fused_moe_decode_triton import down_finish, down_loads, gate_up_program


@triton.jit
def _load_acquire(ptr, SPIN_ASM: tl.constexpr):
    # the int32 at ptr, gpu-scope acquire (later loads of this thread see what the releases
    # it reads from ordered before them)
    if SPIN_ASM:
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l",
                                         [ptr], dtype=tl.int32, is_pure=False, pack=1)
    else:
        return tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")


@triton.jit
def _wait_for(ptr, target, SPIN_ASM: tl.constexpr, MAX_SPIN: tl.constexpr):
    # spin until *ptr >= target (at most MAX_SPIN polls)
    c = _load_acquire(ptr, SPIN_ASM)
    i = 0
    while (c < target) & (i < MAX_SPIN):
        c = _load_acquire(ptr, SPIN_ASM)
        i += 1


@triton.jit
def moe_fused1_kernel(x_ptr, ids_ptr, wt_ptr, logit_ptr, w13_ptr, s13_ptr, g13_ptr,
                      sw13_ptr, ss13_ptr, sg13_ptr, w2_ptr, s2_ptr, g2_ptr,
                      sw2_ptr, ss2_ptr, sg2_ptr, h_ptr, out_ptr, arrive_ptr, done_ptr,
                      stride_xm, stride_logit, N,
                      H: tl.constexpr, F: tl.constexpr, TOPK: tl.constexpr,
                      KPAD: tl.constexpr, FBP: tl.constexpr, HAS_SHARED: tl.constexpr,
                      BLOCK_F: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_H: tl.constexpr,
                      IS_H2: tl.constexpr, USE_ASM: tl.constexpr, SPIN_ASM: tl.constexpr,
                      MAX_SPIN: tl.constexpr):
    KP: tl.constexpr = TOPK + HAS_SHARED
    CHUNKS: tl.constexpr = F // BLOCK_F  # gate_up programs per pair
    ROW_BLOCKS: tl.constexpr = (H + BLOCK_H - 1) // BLOCK_H  # down programs per token
    pid = tl.program_id(0)
    num_gate_up = N * KP * CHUNKS
    if pid < num_gate_up:
        q = pid % (N * KP)
        gate_up_program(q, pid // (N * KP), x_ptr, ids_ptr, w13_ptr, s13_ptr, g13_ptr,
                        sw13_ptr, ss13_ptr, sg13_ptr, h_ptr, stride_xm, H, F, TOPK,
                        HAS_SHARED, BLOCK_F, BLOCK_B, IS_H2, USE_ASM)
        tl.debug_barrier()  # NOTE: every thread's h stores precede the release
        tl.atomic_add(arrive_ptr + q // KP, 1, sem="release", scope="gpu")
    else:
        d = pid - num_gate_up
        t = (d % N).to(tl.int64)
        rb = d // N
        v, raw, v_s, raw_s, factor = down_loads(t, rb, ids_ptr, wt_ptr, w2_ptr, s2_ptr,
                                                g2_ptr, sw2_ptr, ss2_ptr, H, F, TOPK, KPAD,
                                                FBP, HAS_SHARED, BLOCK_H)
        _wait_for(arrive_ptr + t, KP * CHUNKS, SPIN_ASM, MAX_SPIN)
        down_finish(t, rb, v, raw, v_s, raw_s, factor, h_ptr, logit_ptr, sg2_ptr, out_ptr,
                    stride_logit, H, F, TOPK, KPAD, FBP, HAS_SHARED, BLOCK_H)
        tl.debug_barrier()  # NOTE: every thread has left the spin before `done` counts it
        n_done = tl.atomic_add(done_ptr + t, 1, sem="acq_rel", scope="gpu")
        if n_done == ROW_BLOCKS - 1:  # the token's last down program: reset its counters
            tl.atomic_xchg(arrive_ptr + t, 0, sem="relaxed", scope="gpu")
            tl.atomic_xchg(done_ptr + t, 0, sem="relaxed", scope="gpu")

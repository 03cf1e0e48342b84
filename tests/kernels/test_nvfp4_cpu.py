"""The CPU NVFP4 expert kernel (numba) against its torch reference, and its native worker."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tinyserve.kernels.moe import cpu as nc
from tinyserve.kernels.moe.fused import slot_weights, write_slot
from tinyserve.kernels.nvfp4.ref import quantize_nvfp4
from tinyserve.offload.store import HostExpertStore

pytestmark = pytest.mark.skipif(not nc.available(), reason="numba is not installed")


def _store(L: int, E: int, H: int, F: int, seed: int) -> HostExpertStore:
    store = HostExpertStore(L, E, H, F, pin=False)
    g = torch.Generator().manual_seed(seed)
    for r in range(L * E):
        write_slot(store.slots, r, *(quantize_nvfp4(torch.randn(*s, generator=g) * 0.1)
                                     for s in ((F, H), (F, H), (H, F))))
    return store


def _rows(n: int, k: int, rows: int, cpu_share: float, g: torch.Generator) -> torch.Tensor:
    """[n, k] distinct rows per token; about `cpu_share` of the pairs kept, the rest -1."""
    ids = torch.stack([torch.randperm(rows, generator=g)[:k] for _ in range(n)])
    keep = torch.rand(n, k, generator=g) < cpu_share
    return torch.where(keep, ids, -1)


def _tie_slack(x: torch.Tensor, rows: torch.Tensor, w: torch.Tensor, slots) -> torch.Tensor:
    """[N, H]: what the hidden values within 1e-3 of a code of an int8 rounding tie (the
    reference's math) move each output by one code step, summed over them: where the
    kernel's fp32 order may round such a value the other way."""
    xf = nc.quantize_blocks_ref(x.float())
    f = slots.intermediate_size
    slack = torch.zeros(xf.shape)
    for t, j in (rows >= 0).nonzero().tolist():
        w13, w2 = slot_weights(slots, int(rows[t, j]))
        gu = xf[t] @ w13.T
        hid = (torch.nn.functional.silu(gu[:f]) * gu[f:]).reshape(-1, 16)
        step = hid.abs().amax(-1, keepdim=True) / 127  # one code of each block
        code = hid / step.clamp(min=1e-30)
        tie = (code - code.floor() - 0.5).abs() < 1e-3
        slack[t] += float(w[t, j]) * (w2.abs() @ (tie * step).reshape(-1))
    return slack


@pytest.mark.parametrize("n,k,share,H,F", [(1, 8, 1.0, 128, 64), (1, 8, 0.5, 256, 192),
                                           (3, 4, 0.6, 128, 64), (8, 8, 0.8, 64, 64),
                                           (2, 2, 0.0, 128, 64), (1, 8, 1.0, 2048, 512)],
                         ids=["1tok-all", "1tok-half", "3tok", "8tok-shared", "none",
                              "1tok-35b-a3b-layer"])
def test_moe_cpu_matches_reference(n: int, k: int, share: float, H: int, F: int) -> None:
    L, E = 2, 6
    store = _store(L, E, H, F, seed=n * 10 + k)
    g = torch.Generator().manual_seed(n + k)
    rows = _rows(n, k, L * E, share, g)
    if n == 8:  # several tokens on the same experts
        rows = torch.where(rows >= 0, rows % 3, -1)
    x = torch.randn(n, H, generator=g).to(torch.bfloat16)
    w = torch.rand(n, k, generator=g)
    out = torch.full((n, H), float("nan"))
    got = nc.moe_cpu(x, rows, w, store.slots, out=out)
    ref = nc.moe_cpu_ref(x, rows, w, store.slots)
    assert got.data_ptr() == out.data_ptr()
    assert torch.isfinite(got).all()
    scale = ref.abs().max().clamp(min=1e-6)
    # inputs rounded as the kernel rounds them: fp32 summation order apart, and a hidden value
    # within fp32 noise of an int8 rounding tie may take the other code; the unquantized math
    # within 3 %
    assert ((got - ref).abs() <= 2e-4 * scale + _tie_slack(x, rows, w, store.slots)).all()
    exact = nc.moe_cpu_ref(x, rows, w, store.slots, quantize_inputs=False)
    assert (got - exact).abs().max() / scale < 3e-2
    assert torch.equal(got, nc.moe_cpu(x, rows, w, store.slots))  # the same bits again
    assert torch.equal(got, nc.moe_cpu(x, rows, w, store.slots, threads=1))  # on any count


def _natural_scales(scales: torch.Tensor, k: int) -> torch.Tensor:
    """[N, K/16] of the kernel's per-block words [N, scale_words(K)] (its input scales or code
    sums): each pair of chunks' eight in block order, after checking that an odd last chunk
    leaves its pair's other four 0."""
    from tinyserve.kernels.moe import cpu_numba as K

    n = scales.shape[0]
    assert scales.shape[1] == K.scale_words(k)
    blocks = scales.view(n, -1, 8)[:, :, torch.from_numpy(K._SCALE_SLOT)].reshape(n, -1)
    assert not blocks[:, k // 16:].any()
    return blocks[:, :k // 16]


@pytest.mark.parametrize("k", [256, 192], ids=["pairs", "odd-chunk"])
def test_reference_rounds_inputs_as_the_kernel(k: int) -> None:
    """Every int8 code and scale of the reference is the kernel's, on the inputs' call (a
    call's setup, `_prepare`) and the hidden activations', at exact ties too: bf16 inputs hit
    them (x = amax / 2 scales to 63.5)."""
    nc._kernels()
    from tinyserve.kernels.moe import cpu_numba as K

    g = torch.Generator().manual_seed(7)
    nb = k // 16
    x = torch.randn(4, k, generator=g).to(torch.bfloat16).float()
    blocks = x.view(4, nb, 16)
    blocks[:, :, 1] = blocks[:, :, 0] / 2  # ties, whichever input is the block's largest
    blocks[:, :, 2] = -blocks[:, :, 3] * 0.75
    blocks[0, 0] = 0.0
    rows = torch.zeros(4, 1, dtype=torch.int64)
    want = nc.quantize_blocks_ref(x).view(4, nb, 16)
    q, scales, sums = (torch.from_numpy(a)
                       for a in K._prepare(x.numpy(), rows.numpy(), 64)[4:7])

    def check(q: torch.Tensor, scales: torch.Tensor, sums: torch.Tensor) -> None:
        # each chunk of 64 inputs stored as its 32 even inputs, then its 32 odd ones
        codes = q.reshape(4, -1, 2, 32).transpose(2, 3).reshape(4, nb, 16)
        assert torch.equal(codes.float() * _natural_scales(scales, k)[..., None], want)
        assert torch.equal(_natural_scales(sums, k), K.OFFSET * codes.int().sum(-1))

    check(q, scales, sums)
    # the hidden activations' call (numba may hold it compiled with gate_up_item's fast-math)
    q, scales = torch.empty(4, k, dtype=torch.int8), torch.zeros(4, K.scale_words(k))
    sums = torch.zeros(4, K.scale_words(k), dtype=torch.int32)
    for t in range(4):
        K._quantize(x[t].numpy(), q[t].numpy(), scales[t].numpy(), sums[t].numpy(), 0, nb)
    check(q, scales, sums)


def _dot_driver(nrows: int, ntok: int):
    """A numba loop running the block dot of `nrows` rows x `ntok` inputs over every row of
    codes uint8 [R, K/2] / scales uint8 [R, K/16], against inputs xq int8 [2, K] / xs fp32 /
    xc int32 [2, scale_words(K)], into out fp32 [R, ntok]."""
    from numba import njit

    from tinyserve.kernels.moe import cpu_numba as K

    dot = {(2, 1): K._dot2, (4, 1): K._dot4, (2, 2): K._dot2x2, (4, 2): K._dot4x2}[nrows, ntok]

    @njit
    def run(codes, scales, xq, xs, xc, out):
        buf = np.empty(8, np.float32)
        for r in range(0, codes.shape[0], nrows):
            dot(codes[r], codes.shape[1], scales[r], scales.shape[1], xq[0], xs[0], xc[0], 1,
                buf)
            for m in range(nrows * ntok):
                out[r + m // ntok, m % ntok] = buf[m]

    return run


@pytest.mark.parametrize("k", [64, 192, 256], ids=["one-chunk", "odd-chunks", "pairs"])
@pytest.mark.parametrize("nrows,ntok", [(2, 1), (4, 1), (2, 2), (4, 2)])
def test_block_dot_reads_every_scale_code(k: int, nrows: int, ntok: int) -> None:
    """Each block dot against the dequantized math, on 256 rows whose block scales are each
    one E4M3 code, every code (subnormals and negatives; 0x7F / 0xFF read as +-480, as the
    GPU kernels read them), the largest products included: a lone chunk, pairs with an odd
    last one, and pairs."""
    nc._kernels()
    from tinyserve.kernels.moe import cpu_numba as K
    from tinyserve.kernels.nvfp4.ref import E2M1_VALUES, e4m3_to_float, unpack_e2m1

    g = torch.Generator().manual_seed(k + 10 * nrows + ntok)
    codes = torch.randint(0, 256, (256, k // 2), dtype=torch.uint8, generator=g)
    scale_codes = torch.arange(256, dtype=torch.uint8)
    scales = scale_codes[:, None].expand(256, k // 16).contiguous()
    codes[:4], codes[4:8] = 0x77, 0xFF  # every code +6, then -6: the int16 sums' largest
    x = torch.randn(2, k, generator=g)
    x[:, :32], x[:, 32:64] = 1.0, -1.0  # (inputs of +-127)
    xq, xs = torch.empty(2, k, dtype=torch.int8), torch.zeros(2, K.scale_words(k))
    xc = torch.zeros(2, K.scale_words(k), dtype=torch.int32)
    for t in range(2):
        K._quantize(x[t].numpy(), xq[t].numpy(), xs[t].numpy(), xc[t].numpy(), 0, k // 16)
    out = torch.full((256, ntok), float("nan"))
    _dot_driver(nrows, ntok)(*(a.numpy() for a in (codes, scales, xq, xs, xc, out)))
    e4 = e4m3_to_float(scale_codes)
    e4[0x7F], e4[0xFF] = 480.0, -480.0
    w = torch.tensor(E2M1_VALUES)[unpack_e2m1(codes).long()] * e4[:, None]
    xr = nc.quantize_blocks_ref(x[:ntok])
    want, bound = w @ xr.T, w.abs() @ xr.abs().T
    assert ((out / K.DOT_SCALE - want).abs() <= 4e-6 * bound).all()


def test_silu_mul_matches_torch() -> None:
    """The kernel's vector silu(gate) * up against torch's in fp64: gates across fp32's range
    (the exp clamp's edges, zeros, huge values) on fresh random ups."""
    nc._kernels()
    from numba import njit

    from tinyserve.kernels.moe import cpu_numba as K

    @njit
    def run(gate, up):
        K._silu_mul(gate, up)

    g = torch.Generator().manual_seed(3)
    edges = torch.tensor([0.0, -0.0, 87.0, -87.0, 88.0, -88.0, 89.0, -89.0, 1e30, -1e30, 1e-30,
                          -1e-30, 20.0, -20.0, 0.5, -0.5])
    gate = torch.cat([edges, torch.randn(2000, generator=g) * 8, torch.randn(48, generator=g)])
    up = torch.randn(gate.numel(), generator=g)
    got = gate.clone()
    run(got.numpy(), up.numpy())
    want = (torch.nn.functional.silu(gate.double()) * up.double()).float()
    assert ((got - want).abs() <= 1e-6 * want.abs() + 1e-36).all()


def test_host_worker_matches_moe_cpu() -> None:
    L, E, H, F, n, k = 3, 4, 128, 64, 2, 3
    store = _store(L, E, H, F, seed=7)
    g = torch.Generator().manual_seed(1)
    layer = 2
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(n)])
    rel = torch.where(torch.rand(n, k, generator=g) < 0.7, ids, -1).to(torch.int32)
    x = torch.randn(n, H, generator=g)
    w = torch.rand(n, k, generator=g)
    stage = torch.cat([x, rel.view(torch.float32), w], dim=1).contiguous()
    out = torch.full((n, H), float("nan"))
    rows = torch.where(rel >= 0, rel.long() + layer * E, -1)
    want = nc.moe_cpu(x, rows, w, store.slots)
    worker = nc.HostWorker(spin=1e-3, doze=0.05)  # asleep after 1 ms: 50 us, then 1 ms polls
    empty = nc.host_descriptor(store.slots, torch.zeros(n, H + 2 * k), torch.zeros(n, H),
                               k, 0, 1)
    empty[nc.D_STAGE] = 0  # never requested: a bad pointer the worker must not touch
    desc = nc.host_descriptor(store.slots, stage, out, k, layer * E, nc.max_threads())
    assert (worker.add(empty), worker.add(desc)) == (1, 2)
    for threads in (nc.max_threads(), 1):
        desc[nc.D_THREADS] = threads
        out.fill_(float("nan"))
        time.sleep(0.2)  # the second request finds the worker on its slow polls
        worker.call(2)
        # the worker's loop holds its own compiled copy of the kernel: fastmath sums may
        # round apart
        assert (out - want).abs().max() <= 1e-6 * want.abs().max()
    assert int(desc[nc.D_COUNT]) == 2 * len(set(rows[rows >= 0].tolist()))
    assert int(desc[nc.D_CALLS]) == 2 and int(empty[nc.D_CALLS]) == 0
    assert int(worker.flags[worker.GO]) == 0
    worker.close()
    assert not worker._stop.alive


def test_host_worker_needs_no_gil() -> None:
    """A call on every thread completes while the requesting thread holds the GIL (a thread
    that waits on the answer in native code; numba's parallel regions would wait for the GIL
    to start, for ever)."""
    from numba import njit

    from tinyserve.kernels.moe import cpu_numba as K

    @njit  # the GIL held throughout
    def request(flags, number, ticks):
        start = K._tsc()
        K._store_release_i32(flags, number)
        while K._load_acquire_i32(flags + 4) != number:
            if K._tsc() - start > ticks:
                return False
        return True

    L, E, H, F, k = 1, 4, 128, 64, 2
    store = _store(L, E, H, F, seed=3)
    x = torch.randn(1, H)
    rows = torch.tensor([[2, 0]], dtype=torch.int32)
    w = torch.rand(1, k)
    stage = torch.cat([x, rows.view(torch.float32), w], dim=1).contiguous()
    out = torch.full((1, H), float("nan"))
    worker = nc.HostWorker()
    number = worker.add(nc.host_descriptor(store.slots, stage, out, k, 0, nc.max_threads()))
    assert request(worker.flags.data_ptr(), number, int(10 * nc._tsc_hz()))
    want = nc.moe_cpu(x, rows.long(), w, store.slots)
    assert (out - want).abs().max() <= 1e-6 * want.abs().max()
    worker.close()


def test_pooled_call_waits_for_items_not_helpers() -> None:
    """A pool call finishes on the calling thread alone when its helpers never run (threads
    the OS has not scheduled), with the same result; a helper that wakes after the regions
    claims nothing of the finished call."""
    from tinyserve.kernels.moe import cpu_numba as K

    L, E, H, F, n, k = 2, 6, 128, 128, 3, 4
    store = _store(L, E, H, F, seed=11)
    g = torch.Generator().manual_seed(5)
    rows = _rows(n, k, L * E, 0.8, g)
    x, w = torch.randn(n, H, generator=g), torch.rand(n, k, generator=g)
    want = nc.moe_cpu(x, rows, w, store.slots)
    pool = torch.zeros(nc.POOL_WORDS, dtype=torch.int64)
    job = torch.zeros(K.JW, dtype=torch.int64)
    shares = torch.zeros(4, 8, dtype=torch.int64)
    pool[nc.P_HELPERS], pool[nc.P_JOB], pool[nc.P_SHARES] = 3, job.data_ptr(), shares.data_ptr()
    out = torch.full((n, H), float("nan"))
    slots = (t.numpy() for t in store.slots.buffers)
    groups = K.moe_pooled(x.numpy(), rows.numpy(), w.numpy(), *slots, out.numpy(), 4,
                          pool.data_ptr())
    assert groups == len(set(rows[rows >= 0].tolist()))
    assert (out - want).abs().max() <= 1e-6 * want.abs().max()
    word = int(pool[nc.P_REGION])
    assert word % 256 == 4 and int(pool[nc.P_DONE]) == 0  # the caller ran every item
    K._work(pool.data_ptr(), 1, word >> 8, 4)  # a helper waking now
    assert int(pool[nc.P_DONE]) == 0


def test_moe_cpu_from_several_threads_at_once() -> None:
    """Python threads calling `moe_cpu` together share its helper pool one call at a time:
    every result is the one the call gives alone."""
    import threading

    L, E, H, F, k = 2, 8, 128, 64, 4
    store = _store(L, E, H, F, seed=4)
    g = torch.Generator().manual_seed(9)
    calls = [(torch.randn(2, H, generator=g), _rows(2, k, L * E, 0.9, g),
              torch.rand(2, k, generator=g)) for _ in range(12)]
    want = [nc.moe_cpu(x, r, w, store.slots) for x, r, w in calls]
    got: dict[int, torch.Tensor] = {}

    def run(first: int) -> None:
        for _ in range(50):
            for i in range(first, len(calls), 3):
                got[i] = nc.moe_cpu(*calls[i], store.slots)

    threads = [threading.Thread(target=run, args=(t,), daemon=True) for t in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "a moe_cpu call never returned"
    for i, w in enumerate(want):
        assert torch.equal(got[i], w)


def test_moe_cpu_refuses_what_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="multiples of 64"):
        nc.check_slots(_store(1, 2, 64, 32, seed=0).slots)
    store = _store(1, 2, 64, 64, seed=0)
    x, rows, w = torch.randn(1, 64), torch.tensor([[0, 1]]), torch.rand(1, 2)
    with pytest.raises(ValueError, match="do not match"):
        nc.moe_cpu(torch.randn(1, 32), rows, w, store.slots)
    with pytest.raises(ValueError, match="store rows 0..1"):
        nc.moe_cpu(x, torch.tensor([[0, 2]]), w, store.slots)
    with pytest.raises(ValueError, match="store rows"):
        nc.moe_cpu(x, torch.tensor([[-2, 1]]), w, store.slots)
    with pytest.raises(ValueError, match="threads must be"):
        nc.moe_cpu(x, rows, w, store.slots, threads=0)
    with pytest.raises(ValueError, match="out must be"):
        nc.moe_cpu(x, rows, w, store.slots, out=torch.empty(1, 64, dtype=torch.bfloat16))
    dense = HostExpertStore(1, 2, 64, 64, fp4=False, pin=False)
    with pytest.raises(ValueError, match="NVFP4"):
        nc.moe_cpu(x, rows, w, dense.slots)


@pytest.mark.parametrize("nbytes", [8, 4096 + 24, 1 << 20])
def test_read_host_is_the_sum_of_every_word(nbytes: int) -> None:
    """The host read probe reads every 8-byte word once (chunks of any remainder included):
    its checksum is the words' sum modulo 2**64; a trailing partial word is not read."""
    g = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes + 5,), dtype=torch.uint8, generator=g)
    words = buf[:nbytes].view(torch.int64).numpy().view("uint64")
    assert nc.read_host(buf) == int(words.sum(dtype="uint64"))


@pytest.mark.slow
def test_kernel_built_for_a_cpu_without_avx512_matches_reference(tmp_path) -> None:
    """numba compiles for the CPU it runs on: built for Haswell (AVX2, FMA and F16C; no
    AVX-512 or GFNI, as the Intel CPUs of most laptops), the kernel passes its reference
    tests (compiled afresh, in a process of its own)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": "+avx2",
           "NUMBA_CACHE_DIR": str(tmp_path)}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                          "not slow", "-k", "moe_cpu_matches or block_dot or rounds_inputs or silu",
                          __file__], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]

"""GDN kernels (`kernels/gdn/ops.py`) against the torch references of `kernels/gdn/ref.py`.

Every case uses fresh random inputs, NaN-poisoned outputs, NaN-poisoned unused pool slots (their
bytes must stay untouched) and NaN in the slots of sequences that start from a zero state (they
must not be read). The Triton cases run on CUDA (`requires_cuda`, full Qwen3.5-35B-A3B shapes)
and on CPU under TRITON_INTERPRET=1 at small sizes, in a child process so the interpreter
setting never leaks into other tests.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass

import pytest
import torch

from tests.kernels.sm90_build import rerun_without_interpreter
from tinyserve.kernels import gdn
from tinyserve.kernels.gdn import chunk as _gdn_chunk
from tinyserve.kernels.gdn import config as _gdn_config
from tinyserve.kernels.gdn import ref as gdn_ref

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
interp_only = pytest.mark.skipif(not INTERP, reason="runs in the TRITON_INTERPRET=1 child")


@dataclass(frozen=True)
class Shape:
    Hk: int
    Hv: int
    dk: int
    dv: int
    C: int = 48  # conv channels
    K: int = 4


SMALL = Shape(Hk=2, Hv=4, dk=32, dv=32)
FULL = Shape(Hk=16, Hv=32, dk=128, dv=128, C=8192)
NUM_SLOTS = 12


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (an element was not written?)"
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def _poisoned_pool(shape: tuple, dtype: torch.dtype, device: str, live: list[int],
                   scale: float = 0.1) -> torch.Tensor:
    pool = torch.full(shape, float("nan"), dtype=dtype, device=device)
    for s in live:
        pool[s] = torch.randn(shape[1:], device=device).to(dtype) * scale
    return pool


def _assert_untouched(before: torch.Tensor, after: torch.Tensor, used: list[int]) -> None:
    others = [s for s in range(before.shape[0]) if s not in used]
    b = before[others].contiguous().view(torch.uint8)
    a = after[others].contiguous().view(torch.uint8)
    assert torch.equal(a, b), "a kernel wrote a pool slot it was not given"


def _cu(lens: list[int], device: str) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def _gdn_inputs(sh: Shape, T: int, device: str, dtype: torch.dtype):
    q = torch.randn(T, sh.Hk, sh.dk, device=device).to(dtype)
    k = torch.randn(T, sh.Hk, sh.dk, device=device).to(dtype)
    v = torch.randn(T, sh.Hv, sh.dv, device=device).to(dtype)
    a = torch.randn(T, sh.Hv, device=device).to(dtype)
    b = torch.randn(T, sh.Hv, device=device).to(dtype)
    A_log = (torch.rand(sh.Hv, device=device) * 2 - 1).float()
    dt_bias = torch.randn(sh.Hv, device=device).float()
    return q, k, v, a, b, A_log, dt_bias


def _gdn_expected(q, k, v, a, b, A_log, dt_bias, pool, slots, lens, init):
    """Spec §2.6 written out here (gates, l2norm, head grouping) + the per-sequence reference."""
    pool = pool.clone()
    G = v.shape[1] // q.shape[1]
    qf, kf = q.float(), k.float()
    qn = qf * torch.rsqrt((qf * qf).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    kn = kf * torch.rsqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    qn, kn = qn.repeat_interleave(G, 1), kn.repeat_interleave(G, 1)
    g = -A_log.exp() * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = b.float().sigmoid()
    out, lo = [], 0
    for s, n, has in zip(slots, lens, init, strict=True):
        st = pool[s] if has else torch.zeros_like(pool[s])
        if n == 0:
            pool[s] = st
            continue
        o, pool[s] = gdn_ref.chunk_gated_delta_rule_ref(
            qn[lo:lo + n], kn[lo:lo + n], v[lo:lo + n].float(), g[lo:lo + n],
            beta[lo:lo + n], st)
        out.append(o)
        lo += n
    return torch.cat(out), pool


def check_gdn_prefill(sh: Shape, lens: list[int], init: list[bool], device: str,
                      dtype: torch.dtype, method: str, tol: float, chunk_size: int = 64,
                      precision: str = "ieee", chunk_config=None) -> None:
    T = sum(lens)
    slots = torch.randperm(NUM_SLOTS)[:len(lens)].tolist()
    live = [s for s, h in zip(slots, init, strict=True) if h]
    pool = _poisoned_pool((NUM_SLOTS, sh.Hv, sh.dk, sh.dv), torch.float32, device, live)
    before = pool.clone()
    inputs = _gdn_inputs(sh, T, device, dtype)
    want_o, want_pool = _gdn_expected(*inputs, pool, slots, lens, init)
    out = torch.full((T, sh.Hv, sh.dv), float("nan"), dtype=dtype, device=device)
    gdn.gdn_prefill(*inputs, pool, torch.tensor(slots, device=device), _cu(lens, device),
                    torch.tensor(init, device=device), out=out, backend="triton",
                    method=method, chunk_size=chunk_size, dot_precision=precision,
                    fallback=False, chunk_config=chunk_config)
    out_tol = max(tol, 1e-2 if dtype == torch.bfloat16 else tol)
    assert _rel(out, want_o) < out_tol
    assert _rel(pool[slots], want_pool[slots]) < tol
    _assert_untouched(before, pool, slots)


def check_gdn_decode(sh: Shape, B: int, steps: int, device: str, dtype: torch.dtype,
                     tol: float) -> None:
    slots = torch.randperm(NUM_SLOTS)[:B].tolist()
    pool = _poisoned_pool((NUM_SLOTS, sh.Hv, sh.dk, sh.dv), torch.float32, device, slots)
    before = pool.clone()
    seqs = [_gdn_inputs(sh, steps, device, dtype) for _ in range(B)]
    A_log, dt_bias = seqs[0][5], seqs[0][6]
    slot_t = torch.tensor(slots, device=device)
    outs = []
    for t in range(steps):
        q, k, v, a, b = (torch.stack([s[i][t] for s in seqs]) for i in range(5))
        out = torch.full((B, sh.Hv, sh.dv), float("nan"), dtype=dtype, device=device)
        gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slot_t, out=out, backend="triton")
        outs.append(out)
    got = torch.stack(outs, 1)  # [B, steps, Hv, dv]
    for i, s in enumerate(seqs):
        want_o, want_pool = _gdn_expected(*s[:5], A_log, dt_bias, before, [slots[i]],
                                          [steps], [True])
        assert _rel(got[i], want_o) < max(tol, 1e-2 if dtype == torch.bfloat16 else tol)
        assert _rel(pool[slots[i]], want_pool[slots[i]]) < tol
    _assert_untouched(before, pool, slots)


def check_conv(sh: Shape, lens: list[int], init: list[bool], device: str,
               dtype: torch.dtype) -> None:
    C, K = sh.C, sh.K
    T = sum(lens)
    slots = torch.randperm(NUM_SLOTS)[:len(lens)].tolist()
    live = [s for s, h in zip(slots, init, strict=True) if h]
    pool = _poisoned_pool((NUM_SLOTS, C, K - 1), dtype, device, live, scale=1.0)
    before = pool.clone()
    x = torch.randn(T, C, device=device).to(dtype)
    w = torch.randn(C, K, device=device).to(dtype)
    want_pool = pool.clone()
    want, lo = [], 0
    for s, n, h in zip(slots, lens, init, strict=True):
        st = pool[s] if h else torch.zeros_like(pool[s])
        y, want_pool[s] = gdn_ref.causal_conv1d_ref(x[lo:lo + n], w, st)
        want.append(y)
        lo += n
    want = torch.cat(want)
    out = torch.full((T, C), float("nan"), dtype=dtype, device=device)
    slot_t = torch.tensor(slots, device=device)
    if all(n == 1 for n in lens) and all(init):
        gdn.causal_conv1d_update(x, w, pool, slot_t, out=out, backend="triton")
    else:
        gdn.causal_conv1d_prefill(x, w, pool, slot_t, _cu(lens, device),
                                  torch.tensor(init, device=device), out=out, backend="triton")
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    assert _rel(out, want) < tol
    assert torch.equal(pool[slots], want_pool[slots]), "conv state differs"
    _assert_untouched(before, pool, slots)


# --------------------------------------------------------------------------------------------
# CPU (CI): the torch backend, and the Triton kernels under the interpreter (child process)

MIXED = ([70, 1, 3, 17, 1], [True, True, False, True, False])


def test_torch_backend_decode_matches_prefill() -> None:
    sh = SMALL
    T = 9
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(sh, T, "cpu", torch.float32)
    pool = torch.zeros(3, sh.Hv, sh.dk, sh.dv)
    o_pre = gdn.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([2]),
                            _cu([T], "cpu"), torch.tensor([False]), backend="torch")
    pool2 = torch.full_like(pool, float("nan"))
    gdn.gdn_prefill(q[:1], k[:1], v[:1], a[:1], b[:1], A_log, dt_bias, pool2, torch.tensor([0]),
                    _cu([1], "cpu"), torch.tensor([False]), backend="torch", method="recurrent")
    outs = [gdn.gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log,
                           dt_bias, pool2, torch.tensor([0]), backend="torch")
            for t in range(1, T)]
    assert _rel(torch.cat(outs), o_pre[1:]) < 1e-5
    assert _rel(pool2[0], pool[2]) < 1e-5


def test_torch_backend_conv_split_matches_whole() -> None:
    C, K = 16, 4
    x, w = torch.randn(7, C), torch.randn(C, K)
    pool = torch.zeros(2, C, K - 1)
    y = gdn.causal_conv1d_prefill(x, w, pool, torch.tensor([1]), _cu([7], "cpu"),
                                  torch.tensor([False]), backend="torch")
    pool2 = torch.zeros(2, C, K - 1)
    y2 = gdn.causal_conv1d_prefill(x[:2], w, pool2, torch.tensor([0]), _cu([2], "cpu"),
                                   torch.tensor([False]), backend="torch")
    ys = [y2] + [gdn.causal_conv1d_update(x[t:t + 1], w, pool2, torch.tensor([0]),
                                          backend="torch") for t in range(2, 7)]
    torch.testing.assert_close(torch.cat(ys), y)
    torch.testing.assert_close(pool2[0], pool[1])


def test_chunk_config_choice_fits_shared_memory() -> None:
    C = _gdn_config.ChunkConfig
    cfgs = _gdn_config.chunk_configs(128, 64, 128)
    assert cfgs[0] == C(64, 16, 4) and cfgs[-1] == C(32, 16, 4)
    # measured sm_90 builds (num_stages=1): BV=16 80 KiB, BV=32 96 KiB; the bound covers them
    assert _gdn_config.chunk_smem_bytes(C(64, 16, 4), 128) >= 80 * 1024
    assert _gdn_config.chunk_smem_bytes(C(64, 32, 8), 128) >= 96 * 1024
    for c in cfgs[:-1]:
        assert _gdn_config.chunk_smem_bytes(c, 128) <= _gdn_config.SM90_SMEM_BYTES
    # the round-1 failure: 3 pipeline stages do not fit, so they are never chosen
    assert _gdn_config.chunk_smem_bytes(C(64, 32, 8, 3), 128) > _gdn_config.SM90_SMEM_BYTES
    # a pinned dv tile that cannot fit leaves only the smallest fallback
    assert _gdn_config.chunk_configs(128, 64, 128, block_v=64) == [C(32, 16, 4)]
    assert _gdn_config.chunk_configs(128, 64, 128, block_v=32)[0] == C(64, 32, 4)
    # a small device limit: only the fallback; odd dv clamps the tile to a power of two >= 16
    assert _gdn_config.chunk_configs(128, 64, 128, smem_limit=100_000) == [C(32, 16, 4)]
    assert [c.block_v for c in _gdn_config.chunk_configs(20, 16, 32)] == [16, 32]


def test_chunk_launch_moves_down_on_out_of_resources(monkeypatch: pytest.MonkeyPatch) -> None:
    class OutOfResources(Exception):
        pass

    tried = []

    def fake_run(*args) -> None:
        cfg = args[12]
        tried.append(cfg)
        if cfg.chunk == 64:
            raise OutOfResources("shared memory")

    monkeypatch.setattr(_gdn_chunk, "run_chunk", fake_run)
    monkeypatch.setattr(_gdn_chunk, "_CHOSEN", {})
    q = torch.zeros(5, 2, 32)
    v = torch.zeros(5, 4, 32)
    args = (q, q, v) + (None,) * 8
    _gdn_chunk.launch_chunk(*args, torch.zeros(5, 4, 32), 64, None, "tf32x3")
    C = _gdn_config.ChunkConfig
    assert tried == [C(64, 16, 4), C(32, 16, 4)]  # the larger dv tile is skipped
    _gdn_chunk.launch_chunk(*args, torch.zeros(5, 4, 32), 64, None, "tf32x3")
    assert tried[-1] == C(32, 16, 4) and len(tried) == 3  # the choice is remembered
    monkeypatch.setattr(_gdn_chunk, "_CHOSEN", {})
    tried.clear()

    def always_oor(*args) -> None:
        tried.append(args[12])
        raise OutOfResources("shared memory")

    monkeypatch.setattr(_gdn_chunk, "run_chunk", always_oor)
    with pytest.raises(OutOfResources):  # the smallest config failing too is an error
        _gdn_chunk.launch_chunk(*args, torch.zeros(5, 4, 32), 64, None, "tf32x3")
    assert tried == [C(64, 16, 4), C(32, 16, 4)]

    def other_error(*args) -> None:
        tried.append(args[12])
        raise RuntimeError("not a resource error")

    monkeypatch.setattr(_gdn_chunk, "run_chunk", other_error)
    with pytest.raises(RuntimeError):
        _gdn_chunk.launch_chunk(*args, torch.zeros(5, 4, 32), 64, None, "tf32x3")
    assert tried[-1] == C(64, 16, 4)


@pytest.mark.skipif(INTERP, reason="this is the parent of the interpreter run")
def test_triton_kernels_under_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-k", "interp",
                        "-p", "no:cacheprovider"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


@interp_only
@pytest.mark.parametrize("method,chunk", [("chunk", 64), ("chunk", 16), ("recurrent", 64)],
                         ids=["chunk64", "chunk16", "recurrent"])
def test_interp_gdn_prefill_mixed(method: str, chunk: int) -> None:
    check_gdn_prefill(SMALL, *MIXED, "cpu", torch.float32, method, 1e-5, chunk)


@interp_only
def test_interp_gdn_prefill_empty_seq_and_tf32x3() -> None:
    # a zero-length sequence keeps its state; the precision flag reaches the kernels
    check_gdn_prefill(SMALL, [33, 0, 16], [True, True, False], "cpu", torch.float32, "chunk",
                      1e-5, 16, precision="tf32x3")


@interp_only
def test_interp_gdn_prefill_odd_dims() -> None:
    sh = Shape(Hk=1, Hv=3, dk=24, dv=20)  # masks on dk, dv; 3 value heads per key head
    check_gdn_prefill(sh, [19, 1], [False, True], "cpu", torch.float32, "chunk", 1e-5, 16)


@interp_only
@pytest.mark.parametrize("cfg", [_gdn_config.ChunkConfig(64, 32, 4, 1, 4, False),
                                 _gdn_config.ChunkConfig(32, 16, 4, 1, 4, True)],
                         ids=["rows_inverse_bv32", "blocked_chunk32"])
def test_interp_gdn_prefill_forced_config(cfg: _gdn_config.ChunkConfig) -> None:
    # the row-by-row inverse of the prep kernel, a 2-block chunk, a single dv tile
    check_gdn_prefill(SMALL, *MIXED, "cpu", torch.float32, "chunk", 1e-5, chunk_config=cfg)


@interp_only
def test_interp_gdn_decode() -> None:
    check_gdn_decode(SMALL, B=3, steps=4, device="cpu", dtype=torch.float32, tol=1e-5)


@interp_only
@pytest.mark.parametrize("lens,init", [MIXED, ([1, 1, 1], [True] * 3), ([2, 5], [True, True])],
                         ids=["mixed", "update", "short"])
def test_interp_conv(lens: list[int], init: list[bool]) -> None:
    check_conv(SMALL, lens, init, "cpu", torch.float32)


# --------------------------------------------------------------------------------------------
# CUDA: Qwen3.5-35B-A3B shapes

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["chunk", "recurrent"])
def test_cuda_gdn_prefill_1k_mixed(method: str, dtype: torch.dtype) -> None:
    # NOTE: the chunk kernel runs its default tf32x3 dots; "ieee" (FMA) dots compile slowly on
    # sm_90 (heavy spills) and are measured by bench/gdn.py instead.
    lens = [1000, 1, 300, 64, 1, 17, 129]
    init = [False, True, True, False, True, True, False]
    check_gdn_prefill(FULL, lens, init, "cuda", dtype, method, 1e-4, precision="tf32x3")


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cuda_gdn_decode_1k(dtype: torch.dtype) -> None:
    check_gdn_decode(FULL, B=4, steps=1000, device="cuda", dtype=dtype, tol=1e-4)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens,init", [([1000, 1, 2, 300, 1], [False, True, True, True, False]),
                                       ([1] * 8, [True] * 8)], ids=["mixed", "update"])
def test_cuda_conv(lens: list[int], init: list[bool], dtype: torch.dtype) -> None:
    check_conv(FULL, lens, init, "cuda", dtype)


@pytest.mark.requires_cuda
def test_cuda_auto_backend_is_triton_and_matches_torch() -> None:
    sh = FULL
    lens, init = [200, 1], [False, True]
    slots = torch.tensor([3, 5], device="cuda")
    inputs = _gdn_inputs(sh, sum(lens), "cuda", torch.bfloat16)
    p1 = _poisoned_pool((NUM_SLOTS, sh.Hv, sh.dk, sh.dv), torch.float32, "cuda", [5])
    p2 = p1.clone()
    o1 = gdn.gdn_prefill(*inputs, p1, slots, _cu(lens, "cuda"),
                         torch.tensor(init, device="cuda"))
    o2 = gdn.gdn_prefill(*inputs, p2, slots, _cu(lens, "cuda"),
                         torch.tensor(init, device="cuda"), backend="torch")
    assert _rel(o1, o2) < 1e-2
    assert _rel(p1[[3, 5]], p2[[3, 5]]) < 1e-4


# --------------------------------------------------------------------------------------------
# Ahead-of-time build for sm_90 on a machine without a GPU (slow; in .ci/run)

_PTR_TYPES = {"alog_ptr": "*fp32", "dtb_ptr": "*fp32", "ti_ptr": "*fp32", "att_ptr": "*fp32",
              "slots_ptr": "*i64",
              "cu_ptr": "*i32", "init_ptr": "*i32", "seq_ptr": "*i32", "cseq_ptr": "*i32",
              "cstart_ptr": "*i32", "scale": "fp32"}


@pytest.mark.slow
def test_kernels_build_for_sm90() -> None:
    """Under the interpreter (set by other kernel test modules on a CPU-only machine) the
    build runs in a child process with the compiler."""
    triton = pytest.importorskip("triton")
    if rerun_without_interpreter(__file__, "kernels_build_for_sm90", timeout=900):
        return
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tinyserve.kernels.gdn import triton as ks
    cases = [
        (ks.conv1d_update_kernel, dict(K=4, KP=4, BLOCK_C=256), 4),
        (ks.conv1d_varlen_kernel, dict(K=4, BLOCK_T=16, BLOCK_C=256), 4),
        (ks.conv1d_state_writeback_kernel, dict(K=4, KP=4, BLOCK_C=256), 4),
        (ks.gdn_recurrent_kernel, dict(IS_VARLEN=False, BK=128, BV=32), 4),
        (ks.gdn_recurrent_kernel, dict(IS_VARLEN=True, BK=128, BV=32), 4),
        (ks.gdn_chunk_prep_kernel, dict(BT=64, BK=128, PREC="tf32x3", NATIVE_QK=True, NLEVELS=2,
                                 BLOCKED=True), 4),
        (ks.gdn_chunk_prep_kernel, dict(BT=64, BK=128, PREC="tf32x3", NATIVE_QK=False, NLEVELS=2,
                                 BLOCKED=False), 4),
        (ks.gdn_chunk_kernel, dict(BT=64, BK=128, BV=16, PREC="tf32x3"), 4),
        (ks.gdn_chunk_kernel, dict(BT=64, BK=128, BV=32, PREC="tf32x3"), 8),
    ]
    for jf, constexprs, warps in cases:
        sig = {n: "constexpr" if n in constexprs
               else _PTR_TYPES.get(n, "*bf16" if n.endswith("_ptr") else "i32")
               for n in jf.arg_names}
        if "pool_ptr" in sig:
            sig["pool_ptr"] = "*bf16" if "conv1d" in jf.fn.__name__ else "*fp32"
        k = triton.compile(ASTSource(jf, sig, constexprs), target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "num_stages": 1})
        assert k.metadata.shared <= 227 * 1024, f"{jf.fn.__name__}: too much shared memory"
        if jf is ks.gdn_chunk_kernel:  # the launcher's bound covers the build
            cfg = _gdn_config.ChunkConfig(64, constexprs["BV"], warps)
            assert k.metadata.shared <= _gdn_config.chunk_smem_bytes(cfg, 128)


def test_triton_launchers_check_devices() -> None:
    # the Triton kernels read every tensor by pointer: one on another device must be refused
    # before a launch (checked ahead of the kernels, so no interpreter is needed)
    sh, B = SMALL, 2
    q, k, v, a, b, A_log, dt_bias = _gdn_inputs(sh, B, "cpu", torch.float32)
    pool = torch.zeros(NUM_SLOTS, sh.Hv, sh.dk, sh.dv)
    slots = torch.tensor([3, 5])
    meta = torch.device("meta")
    with pytest.raises(ValueError):
        gdn.gdn_decode(q, k, v, a, b, A_log.to(meta), dt_bias, pool, slots, backend="triton")
    with pytest.raises(ValueError):
        gdn.gdn_prefill(q, k, v, a, b, A_log, dt_bias, pool, slots.to(meta), _cu([1, 1], "cpu"),
                        torch.ones(B, dtype=torch.bool), backend="triton")
    x, w = torch.randn(B, sh.C), torch.randn(sh.C, sh.K)
    conv = torch.zeros(NUM_SLOTS, sh.C, sh.K - 1)
    with pytest.raises(ValueError):
        gdn.causal_conv1d_update(x, w.to(meta), conv, slots, backend="triton")
    with pytest.raises(ValueError):
        gdn.causal_conv1d_prefill(x, w, conv, slots, _cu([1, 1], "meta"),
                                  torch.ones(B, dtype=torch.bool), backend="triton")

"""The persistent NVFP4 gemv (`nvfp4_persist_triton.py`, M = 1..4, "h2" decode) vs the torch
reference (dequantize, fp32 matmul).

Without CUDA the kernel runs in the Triton interpreter on small shapes (an fp32 emulation of
the half2 FMAs: x is rounded to fp16 after its per-row power-of-two scale, products and sums
are fp32); the lm_head and qkvz shapes run on a GPU with the inline PTX. Outputs start as NaN.
Bounds: relative Frobenius error < 1e-2 (bf16 outputs) / 2e-3 (fp16 outputs; 5e-3 on a GPU,
where the block sums are fp16).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: must precede the first import of the kernel module (decoration reads it).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.sm90_build import (  # noqa: E402
    compile_sm90,
    rerun_without_interpreter,
    resource_usage,
    usage_field,
)
from tests.kernels.test_nvfp4 import _weight, rel_err  # noqa: E402
from tinyserve.kernels.nvfp4 import PERSISTENT_MAX_ROWS, GemvConfig, nvfp4_linear  # noqa: E402
from tinyserve.kernels.nvfp4_tiles import PERSISTENT_CANDIDATES  # noqa: E402

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu_shapes
DEV = "cuda" if torch.cuda.is_available() else "cpu"
BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3 if DEV == "cpu" else 5e-3}

# interpreter-sized tiles (num_sms is 1 without a GPU: `persistent` = the number of programs,
# so every program walks several row tiles)
CONFIGS = {
    "staged": GemvConfig(16, 16, 4, vec=4, num_stages=3, decode="h2", persistent=2),
    "prefetch": GemvConfig(8, 16, 4, vec=2, num_stages=1, prefetch=True, decode="h2",
                           persistent=3),
    "x_per_tile": GemvConfig(16, 64, 4, vec=4, num_stages=2, decode="h2", persistent=2,
                             hoist_x=False),
}
# (N, K, M, dtype): N never a multiple of the tile, K 256..2048, M 1..4 (3: a masked 4th row)
CASES = [(37, 256, 1, torch.float16), (37, 256, 4, torch.bfloat16),
         (50, 512, 2, torch.bfloat16), (50, 512, 3, torch.float16),
         (100, 1024, 1, torch.bfloat16), (100, 1024, 4, torch.float16),
         (45, 2048, 3, torch.bfloat16), (45, 2048, 1, torch.float16)]


def _check(n: int, k: int, m: int, dtype: torch.dtype, cfg: GemvConfig,
           row_scales: tuple[float, ...] = (1.0,)) -> None:
    w, wd = _weight(n, k)
    scales = torch.tensor([row_scales[i % len(row_scales)] for i in range(m)], device=DEV)
    x = (torch.randn(m, k, device=DEV) * scales[:, None]).to(dtype)
    y = nvfp4_linear(x, w, path="gemv", gemv_config=cfg)
    ref = x.float() @ wd.T
    assert y.shape == (m, n) and y.dtype == dtype and not torch.isnan(y).any()
    err = rel_err(y, ref)
    assert err < BOUND[dtype], (n, k, m, dtype, err)


@pytest.mark.parametrize("variant", list(CONFIGS))
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"N{c[0]}xK{c[1]}_M{c[2]}_{str(c[3])[6:]}")
def test_persistent_gemv(poison, case, variant):
    _check(*case, CONFIGS[variant])


def test_persistent_rows_scaled_apart(poison):
    # each row of x has its own power-of-two scale: rows 1e-3 .. 1e3 apart in one program
    w, wd = _weight(40, 512)
    for m in (2, 4):
        scales = torch.tensor([1e-3, 1.0, 30.0, 1e3][:m], device=DEV)
        x = (torch.randn(m, 512, device=DEV) * scales[:, None]).to(torch.float16)
        y = nvfp4_linear(x, w, path="gemv", gemv_config=CONFIGS["staged"]).float()
        ref = x.float() @ wd.T
        row_err = [rel_err(y[r], ref[r]) for r in range(m)]
        assert max(row_err) < 2e-3, (m, row_err)


def test_persistent_zero_rows_and_more_programs_than_tiles(poison):
    # a zero row of x gives exact zeros; 64 programs for 3 row tiles (grid capped at the tiles)
    w, _ = _weight(40, 256)
    x = torch.zeros(2, 256, device=DEV, dtype=torch.bfloat16)
    x[1] = torch.randn(256, device=DEV)
    cfg = GemvConfig(16, 16, 4, vec=2, decode="h2", persistent=64)
    y = nvfp4_linear(x, w, path="gemv", gemv_config=cfg)
    assert torch.equal(y[0], torch.zeros_like(y[0]))
    _check(40, 256, 2, torch.bfloat16, cfg)


def test_persistent_config_falls_back(poison):
    # fp32 x keeps fp32 products (the one-tile kernel, f32 decode); M = 5 takes that kernel too
    w, wd = _weight(40, 256)
    cfg = CONFIGS["staged"]
    x = torch.randn(1, 256, device=DEV) * 1.2345  # not representable in fp16
    assert rel_err(nvfp4_linear(x, w, path="gemv", gemv_config=cfg), x @ wd.T) < 1e-5
    x5 = torch.randn(5, 256, device=DEV).to(torch.float16)
    y5 = nvfp4_linear(x5, w, path="gemv", gemv_config=cfg)
    assert rel_err(y5, x5.float() @ wd.T) < 2e-3


def test_persistent_config_checks():
    with pytest.raises(ValueError):
        GemvConfig(16, 128, 4, persistent=4)  # the f32 decode has no persistent kernel
    with pytest.raises(ValueError):
        GemvConfig(16, 128, 4, decode="h2", persistent=-1)
    assert all(c.persistent > 0 and c.decode == "h2" for c in PERSISTENT_CANDIDATES)


def test_resident_programs(monkeypatch):
    # registers (allocated per warp in 256s), shared memory (+1 KB per program) and threads of
    # an sm_90 SM; 0 when the kernel or the device does not say
    from types import SimpleNamespace

    from tinyserve.kernels.launch import resident_programs

    props = SimpleNamespace(regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048,
                            shared_memory_per_multiprocessor=233472)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)

    def kernel(regs: int, smem: int, warps: int = 4) -> SimpleNamespace:
        meta = SimpleNamespace(num_warps=warps, shared=smem)
        return SimpleNamespace(_init_handles=lambda: None, n_regs=regs, metadata=meta)

    assert resident_programs(kernel(72, 36896), "cuda") == 6  # shared memory bound
    assert resident_programs(kernel(72, 18464), "cuda") == 7  # 9 x 256 registers per warp
    assert resident_programs(kernel(128, 512), "cuda") == 4
    assert resident_programs(kernel(32, 0, 8), "cuda") == 8  # threads
    assert resident_programs(object(), "cuda") == 0


# --- Qwen3.5-35B-A3B shapes on a GPU -----------------------------------------------------

GPU_SHAPES = {"lm_head": (248320, 2048), "qkvz": (8192, 2048), "odd": (1023, 1040)}
ROW_SCALES = (1.0, 1e-3, 1e3, 30.0)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", list(GPU_SHAPES))
def test_persistent_gemv_gpu(poison, name):
    # inline-PTX half2 FMAs, bf16 and fp16 x: every sweep candidate at M = 1 (lm_head, qkvz),
    # a Triton-staged and the register-prefetch candidate at M = 2..4 (13 kernel builds)
    n, k = GPU_SHAPES[name]
    staged, prefetch = PERSISTENT_CANDIDATES[0], PERSISTENT_CANDIDATES[-1]
    if name == "odd":  # N and K/16 not multiples of 16: a build of its own per variant
        cases = [(staged, 1), (staged, 3)]
    else:
        cases = [(cfg, 1) for cfg in PERSISTENT_CANDIDATES]
        cases += [(cfg, m) for cfg in (staged, prefetch) for m in (2, 3, 4)]
    for i, (cfg, m) in enumerate(cases):
        _check(n, k, m, (torch.bfloat16, torch.float16)[i % 2], cfg, ROW_SCALES)


@pytest.mark.requires_cuda
def test_persistent_gemv_gpu_graph(poison):
    # the grid cap (resident programs per SM) is computed before a capture; replays agree
    w, wd = _weight(8192, 2048)
    cfg = PERSISTENT_CANDIDATES[1]
    x = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)
    eager = nvfp4_linear(x, w, path="gemv", gemv_config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = nvfp4_linear(x, w, path="gemv", gemv_config=cfg)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, eager) and rel_err(y, x.float() @ wd.T) < 1e-2


# --- ahead-of-time build for sm_90 (no GPU needed) -----------------------------------------

_TYPES = {"x_ptr": "*bf16", "w_ptr": "*i64", "s_ptr": "*u8", "out_ptr": "*bf16",
          "factor": "fp32"}


@pytest.mark.slow
def test_persistent_candidates_build_for_sm90() -> None:
    """Every sweep candidate at M = 1, 2, 4 (K = 2048, the launcher's rows per tile) compiles
    for sm_90 with the runtime's divisibility attributes, fits in shared memory, spills
    nothing (the register prefetch at M > 1 excepted) and, with num_stages > 1, stages its
    tile loads with cp.async. Under the interpreter the check runs
    in a child process with the compiler."""
    if rerun_without_interpreter(__file__, "build_for_sm90", timeout=900, tail=3000):
        return
    from tinyserve.kernels import nvfp4_persist_triton as pt

    jf = pt.nvfp4_gemv_persistent_kernel
    seen = set()
    for cfg in PERSISTENT_CANDIDATES:
        for m in (1, 2, 4):
            consts = dict(BLOCK_M=m, BLOCK_N=min(cfg.block_n, PERSISTENT_MAX_ROWS // m),
                          BLOCK_B=max(128, cfg.block_b),
                          VEC=cfg.vec, PREFETCH=cfg.prefetch, HOIST_X=cfg.hoist_x,
                          NUM_STAGES=cfg.num_stages, USE_ASM=True)
            key = (tuple(consts.items()), cfg.num_warps)
            if key in seen:
                continue
            seen.add(key)
            sig = {a: "constexpr" if a in consts else _TYPES.get(a, "i32") for a in jf.arg_names}
            attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(jf.arg_names)
                     if a in ("x_ptr", "w_ptr", "s_ptr", "out_ptr", "N", "KB", "stride_xm")}
            k = compile_sm90(jf, sig, consts, attrs, num_warps=cfg.num_warps,
                             num_stages=cfg.num_stages)
            assert k.metadata.shared <= 227 * 1024
            # NOTE: num_stages > 1 must stage the tile loads through shared memory (cp.async)
            assert (cfg.num_stages > 1) == ("cp.async" in k.asm["ptx"]), (m, cfg)
            usage = resource_usage(k, "nvfp4_persist")
            if usage is None:
                continue
            regs, stack = usage_field(usage, "REG"), usage_field(usage, "STACK")
            print(f"\nM={m} {cfg}: regs {regs} stack {stack} shared {k.metadata.shared}")
            if not (m > 1 and cfg.prefetch):
                assert not stack, (m, cfg, usage)

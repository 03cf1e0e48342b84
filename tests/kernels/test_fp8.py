"""FP8 (W8A16) Triton linear vs the torch reference (dequantize, fp32 matmul).

Without CUDA the kernels run in the Triton interpreter on small shapes; the Qwen3.5-35B-A3B
projection shapes run on a GPU. Outputs and workspaces are poisoned with NaN so an unwritten
element fails. Bound (relative Frobenius error): the weights decode exactly and accumulate in
fp32, so the error is the final rounding to x.dtype: < 1e-2 for bf16 / fp16 activations
(measured ~4e-3), < 1e-5 for fp32 (interpreter; measured ~3e-7). The dequant path also rounds
e4m3 * scale to x.dtype: same bounds.
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("triton")

from tinyserve.core import FP8Weight
from tinyserve.kernels.fp8.linear import (
    PATHS,
    choose_path,
    default_native,
    fp8_dequantize,
    fp8_linear,
    gemv_tiles,
)
from tinyserve.kernels.nvfp4.ref import dequantize_fp8, quantize_fp8

pytestmark = pytest.mark.gpu_shapes
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# NOTE: the interpreter's tl.dot is wrong for bf16 inputs, so CPU runs use fp32 activations
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
BOUND = 1e-2 if DTYPE == torch.bfloat16 else 1e-5
NATIVE = [False, True] if DEV == "cpu" or torch.cuda.get_device_capability() >= (8, 9) \
    else [False]
EDGE = [0x00, 0x80, 0x01, 0x81, 0x07, 0x87, 0x08, 0x7E, 0xFE, 0x38, 0xB8]  # 0, -0, subnormals
# (smallest, largest), smallest normal, +-448, +-1


def rand_fp8(n: int, k: int, device: str, per_row: bool = False,
             gen: torch.Generator | None = None) -> FP8Weight:
    """Every non-NaN code (0x7F / 0xFF excluded), scale ~ 1/(16 sqrt(k))."""
    bits = torch.randint(0, 254, (n, k), dtype=torch.int32, generator=gen)
    bits = (bits + (bits >= 0x7F).int() + (bits >= 0xFE).int()).to(torch.uint8)
    shape = (n, 1) if per_row else ()
    scale = (torch.rand(shape, generator=gen) + 0.5) / (16 * k**0.5)
    return FP8Weight(bits.to(device), scale.to(device))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@functools.lru_cache(maxsize=2)
def _weight(n: int, k: int, per_row: bool) -> tuple[FP8Weight, torch.Tensor]:
    w = rand_fp8(n, k, DEV, per_row)
    return w, dequantize_fp8(w)


def check(m: int, n: int, k: int, path: str | None, dtype: torch.dtype, bound: float, *,
          per_row: bool = False, native: bool | None = False) -> None:
    w, wd = _weight(n, k, per_row)
    x = torch.randn(m, k, device=DEV).to(dtype)
    ref = x.float() @ wd.T
    y = fp8_linear(x, w, path=path, native=native)
    assert y.shape == (m, n) and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < bound, (path, rel_err(y, ref))


# --- interpreter-sized grid (also runs on a GPU) ------------------------------------------

SMALL = [(64, 256), (37, 200), (48, 2048), (33, 202)]  # (N, K): odd N, K off the blocks,
# K = 2048 (one program per K range), K % 4 != 0 (no gemv)
SMALL_M = [1, 3, 16, 17, 64]
SMALL_CASES = [(nk, m, path) for nk in SMALL for m in SMALL_M for path in PATHS
               if not (path == "gemv" and (nk[1] % 4 or m == 64 or (nk[1] > 1024 and m == 16)))]


@pytest.mark.parametrize("nk,m,path", SMALL_CASES,
                         ids=lambda v: f"N{v[0]}xK{v[1]}" if isinstance(v, tuple) else str(v))
def test_linear_small(poison, nk, m, path):
    check(m, *nk, path, DTYPE, BOUND)


@pytest.mark.parametrize("native", NATIVE, ids=["bits", "native"][:len(NATIVE)])
@pytest.mark.parametrize("path", PATHS)
def test_per_row_scale_and_decode(poison, path, native):
    check(3, 40, 256, path, DTYPE, BOUND, per_row=True, native=native)
    check(1, 40, 256, path, DTYPE, BOUND, native=native)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gemv_half_activations(poison, dtype):
    # bf16 x goes through the int64-word loads; fp16 through plain loads
    check(1, 40, 256, "gemv", dtype, 1e-2)
    check(2, 40, 256, "gemv", dtype, 1e-2)  # BLOCK_M 2
    check(5, 40, 256, "gemv", dtype, 1e-2)  # BLOCK_M 4, the second group partly masked


def test_gemv_split_k(poison):
    # one weight row: too few programs, so K splits in two (fp32 workspace, summed); on a GPU
    # K above GEMV_MAX_BLOCK_W words splits as well
    sms = 1 if DEV == "cpu" else torch.cuda.get_device_properties(0).multi_processor_count
    assert gemv_tiles(1, 1024, 1)[2] == 2
    assert gemv_tiles(2048, 8192, 132)[2] == 2
    for n, k in ((1, 1024), (40, 8192 if DEV == "cuda" else 1024)):
        if gemv_tiles(n, k, sms)[2] > 1:
            check(1, n, k, "gemv", DTYPE, BOUND)
            check(3, n, k, "gemv", DTYPE, BOUND, per_row=True)


def test_dot_split_k(poison):
    # few output tiles: the dot path splits K
    check(3, 16, 1024, "dot", DTYPE, BOUND)


@pytest.mark.parametrize("native", NATIVE, ids=["bits", "native"][:len(NATIVE)])
@pytest.mark.parametrize("path", PATHS)
def test_edge_codes(poison, path, native):
    # every non-NaN code in every byte position of a word, and the edge codes (zero, -0,
    # subnormals, smallest normal, +-448) in rows of their own; fp32 x: near-exact
    codes = [b for b in range(256) if b & 0x7F != 0x7F]  # 254
    bits = torch.tensor(codes, dtype=torch.uint8)
    rows = [bits.roll(s) for s in range(4)] + [torch.tensor(EDGE, dtype=torch.uint8)
                                              .repeat_interleave(4).repeat(6)[:254]]
    w = FP8Weight(torch.stack(rows + [torch.full((254,), e, dtype=torch.uint8)
                                      for e in EDGE])[:, :252].contiguous().to(DEV),
                  torch.tensor(0.75, device=DEV))
    x = torch.randn(2, 252, device=DEV)
    ref = x @ dequantize_fp8(w).T
    y = fp8_linear(x, w, path=path, native=native)
    err = (y - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, err
    # zero and -0 rows give exact zeros; subnormal-only rows are exact in fp32
    assert torch.equal(y[:, 5], torch.zeros_like(y[:, 5]))
    assert torch.equal(y[:, 6], torch.zeros_like(y[:, 6]))


@pytest.mark.parametrize("native", NATIVE, ids=["bits", "native"][:len(NATIVE)])
def test_dequantize_every_code_exact(poison, native):
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    w = FP8Weight(codes.repeat(3, 1).contiguous().to(DEV), torch.tensor(1.0, device=DEV))
    assert torch.equal(fp8_dequantize(w, torch.float32, native=native), dequantize_fp8(w))
    wr = FP8Weight(w.weight, torch.tensor([[0.5], [2.0], [0.25]], device=DEV))
    assert torch.equal(fp8_dequantize(wr, torch.float32, rows=(1, 3)),
                       dequantize_fp8(wr)[1:3])


def test_quantized_weight_leading_dims_and_default_path(poison):
    w = quantize_fp8(torch.randn(40, 256) * 3)
    w = FP8Weight(w.weight.to(DEV), w.scale.to(DEV))
    x = torch.randn(2, 3, 256, device=DEV)
    ref = x @ dequantize_fp8(w).T
    y = fp8_linear(x, w)
    assert y.shape == (2, 3, 40) and rel_err(y, ref) < 1e-2
    assert fp8_linear(x[:0], w).shape == (0, 3, 40)


def test_default_native(monkeypatch):
    # dot decodes with float8e4nv by default on sm_89+ (the target architecture: an older one
    # set by TINYSERVE_CUDA_ARCH bit-decodes); every path bit-decodes elsewhere
    from tinyserve.kernels.launch import target_arch

    assert not any(default_native(p, torch.device("cpu")) for p in PATHS)
    if DEV == "cuda":
        cuda = torch.device("cuda")
        assert default_native("dot", cuda) == (target_arch(cuda) >= 89)
        assert not default_native("gemv", cuda) and not default_native("dequant", cuda)
        monkeypatch.setenv("TINYSERVE_CUDA_ARCH", "sm_86")
        assert not default_native("dot", cuda)


def test_choose_path_and_errors():
    assert choose_path(1, 8192, 2048) == "gemv"
    assert choose_path(4, 8192, 2048) == "gemv"
    assert choose_path(16, 8192, 2048) == "dot"
    assert choose_path(1, 37, 202) == "dot"  # K % 4 != 0
    assert choose_path(64) == "dot"
    assert choose_path(4096) == "dequant"
    assert gemv_tiles(8192, 2048, 132) == (4, 512, 1)
    assert gemv_tiles(2048, 4096, 132) == (2, 1024, 1)
    assert gemv_tiles(512, 2048, 132) == (1, 512, 1)
    w = rand_fp8(16, 64, DEV)
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 32, device=DEV), w)
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 64, device=DEV), w, path="nope")
    with pytest.raises(TypeError):
        fp8_linear(torch.zeros(2, 64, dtype=torch.int32, device=DEV), w)
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 64, device=DEV), FP8Weight(w.weight, torch.ones(3)))
    with pytest.raises(ValueError):
        fp8_linear(torch.randn(2, 62, device=DEV), rand_fp8(16, 62, DEV), path="gemv")



def test_dequantize_checks_rows_and_weight(poison):
    # a row range past the weight would read past its buffer; bad scales or strides misread
    w = rand_fp8(16, 64, DEV)
    assert fp8_dequantize(w, torch.float32, rows=(5, 5)).shape == (0, 64)
    for rows in ((0, 17), (-1, 4), (6, 5)):
        with pytest.raises(ValueError):
            fp8_dequantize(w, rows=rows)
    with pytest.raises(ValueError):
        fp8_dequantize(FP8Weight(w.weight, torch.ones(3, device=DEV)))
    with pytest.raises(ValueError):
        fp8_dequantize(FP8Weight(torch.cat([w.weight, w.weight], 1)[:, ::2], w.scale))
    with pytest.raises(TypeError):
        fp8_dequantize(FP8Weight(w.weight.to(torch.int16), w.scale))


# --- Qwen3.5-35B-A3B projection shapes on a GPU ------------------------------------------

SHAPES = {  # (N, K)
    "qkv_q_8192x2048": (8192, 2048), "z_4096x2048": (4096, 2048),
    "out_o_2048x4096": (2048, 4096), "kv_512x2048": (512, 2048), "odd_1000x1000": (1000, 1000),
}
GPU_CASES = [(name, m, path) for name in SHAPES for m in (1, 3, 16, 17, 64, 512)
             for path in PATHS if not (path == "gemv" and m > 64)]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name,m,path", GPU_CASES, ids=lambda v: str(v))
def test_linear_gpu(poison, name, m, path):
    check(m, *SHAPES[name], path, torch.bfloat16, 1e-2)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("path", PATHS)
def test_linear_gpu_native_and_per_row(poison, path):
    check(1, 8192, 2048, path, torch.bfloat16, 1e-2, native=NATIVE[-1])
    check(16, 2048, 4096, path, torch.bfloat16, 1e-2, per_row=True, native=NATIVE[-1])


@pytest.mark.requires_cuda
@pytest.mark.parametrize("m", [1, 4, 16, 100, 512])
def test_linear_gpu_default_decode(poison, m):
    # native=None: each path's default decode (native dot on sm_89+)
    check(m, 8192, 2048, None, torch.bfloat16, 1e-2, native=None)
    check(m, 2048, 4096, None, torch.bfloat16, 1e-2, per_row=True, native=None)


@pytest.mark.requires_cuda
def test_linear_gpu_fp16_and_graph(poison):
    w, wd = _weight(2048, 4096, False)
    x = torch.randn(1, 4096, device=DEV, dtype=torch.float16)
    ref = x.float() @ wd.T
    fp8_linear(x, w)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fp8_linear(x, w)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref) < 1e-2


@pytest.mark.requires_cuda
def test_model_linear_uses_kernel(poison, monkeypatch):
    # model.linear dispatches FP8 on CUDA to this kernel; TINYSERVE_DISABLE_KERNELS -> reference
    from tinyserve.kernels import fp8 as fp8_mod
    from tinyserve.model.linear import linear

    w, wd = _weight(2048, 4096, False)
    x = torch.randn(3, 4096, device=DEV, dtype=torch.bfloat16)
    calls = []
    real = fp8_mod.fp8_linear
    monkeypatch.setattr(fp8_mod, "fp8_linear", lambda *a, **k: calls.append(1) or real(*a, **k))
    assert rel_err(linear(x, w), x.float() @ wd.T) < 1e-2 and calls
    monkeypatch.setenv("TINYSERVE_DISABLE_KERNELS", "1")
    assert rel_err(linear(x, w), x.float() @ wd.T) < 1e-2 and len(calls) == 1

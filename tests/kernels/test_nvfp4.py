"""NVFP4 Triton linear vs the torch reference (dequantize, fp32 matmul).

Without CUDA the kernels run in the Triton interpreter on small shapes; the 35B-A3B shapes run
on a GPU. Outputs and workspaces are poisoned with NaN so an unwritten element fails.
Bound: relative Frobenius error < 1e-2 for bf16 activations, < 1e-5 for fp32 (interpreter).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tinyserve.core import NVFP4Weight
from tinyserve.kernels.nvfp4.linear import (
    PATHS,
    choose_path,
    nvfp4_dequantize,
    nvfp4_linear,
)
from tinyserve.kernels.nvfp4.ref import dequantize_nvfp4, quantize_nvfp4

pytest.importorskip("triton")

pytestmark = pytest.mark.gpu_shapes
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rand_nvfp4(n: int, k: int, device: str, gen: torch.Generator | None = None) -> NVFP4Weight:
    """Random codes (all 16 appear), block scales around 1 (0x30..0x47), global ~ 1/sqrt(k)."""
    kw = {"dtype": torch.uint8, "generator": gen, "device": device}
    packed = torch.randint(0, 256, (n, k // 2), **kw)
    scale = torch.randint(0x30, 0x48, (n, k // 16), **kw)
    return NVFP4Weight(packed, scale, 0.5 / k**0.5)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref).norm() / ref.norm())


@functools.lru_cache(maxsize=1)
def _weight(n: int, k: int) -> tuple[NVFP4Weight, torch.Tensor]:
    # one weight per shape and session (the lm_head's fp32 reference is 2 GB)
    w = rand_nvfp4(n, k, DEV)
    return w, dequantize_nvfp4(w)


def check_linear(m: int, n: int, k: int, path: str | None, dtype: torch.dtype, bound: float):
    w, wd = _weight(n, k)
    x = torch.randn(m, k, device=DEV).to(dtype)
    ref = x.float() @ wd.T
    y = nvfp4_linear(x, w, path=path)
    assert y.shape == (m, n) and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < bound, (path, rel_err(y, ref))


# --- interpreter-sized grid (also runs on a GPU) ------------------------------------------

SMALL = [(64, 256), (37, 512), (48, 1024)]  # (N, K): N odd; K=1024: split-K in dot
SMALL_M = [1, 3, 16]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", SMALL_M, ids=lambda m: f"M{m}")
@pytest.mark.parametrize("nk", SMALL, ids=lambda s: f"N{s[0]}xK{s[1]}")
def test_linear_small(poison, nk, m, path):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    check_linear(m, *nk, path, dtype, 1e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("m", [2, 5], ids=lambda m: f"M{m}")
def test_gemv_row_groups(poison, m):
    # M = 2 (two x rows per program) and 5 (groups of four, the last one partly masked)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    check_linear(m, 40, 256, "gemv", dtype, 1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_dot_split_k(poison):
    # few output tiles: the dot path splits K (fp32 workspace, summed)
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    check_linear(3, 16, 1024, "dot", dtype, 1e-2 if dtype == torch.bfloat16 else 1e-5)


def test_gemv_every_code(poison):
    # all 16 codes in every nibble position, all 254 non-NaN scales: the gemv decode (bf16
    # bit patterns, fp32 subnormal 0.5) against the fp32 reference
    codes = torch.arange(256, dtype=torch.uint8).repeat(254 * 2).reshape(254, 512)
    scales = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    w = NVFP4Weight(codes.to(DEV), scales[:, None].expand(254, 64).contiguous().to(DEV), 0.75)
    x = torch.randn(3, 1024, device=DEV)
    ref = x @ dequantize_nvfp4(w).T
    y = nvfp4_linear(x, w, path="gemv")
    assert rel_err(y, ref) < 1e-5


def test_linear_leading_dims_and_default_path(poison):
    w = rand_nvfp4(32, 128, DEV)
    x = torch.randn(2, 3, 128, device=DEV)
    y = nvfp4_linear(x, w)
    ref = x.float() @ dequantize_nvfp4(w).T
    assert y.shape == (2, 3, 32) and rel_err(y, ref) < 1e-2
    y1 = nvfp4_linear(x[0, :1], w)  # the gemv
    assert rel_err(y1, ref[0, :1]) < 1e-2


def test_quantized_weight_matches_reference(poison):
    w = quantize_nvfp4(torch.randn(40, 256))
    w = NVFP4Weight(w.packed.to(DEV), w.block_scale.to(DEV), w.global_scale)
    x = torch.randn(2, 256, device=DEV)
    ref = x @ dequantize_nvfp4(w).T
    assert rel_err(nvfp4_linear(x, w, path="gemv"), ref) < 1e-2


def test_dequantize_every_code_exact(poison):
    # all 16 codes in every byte position and all 254 non-NaN E4M3 scales, bit-exact in fp32
    codes = torch.arange(256, dtype=torch.uint8).repeat(254 * 2)  # 254 rows of 256 bytes x 2
    scales = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    packed = codes.reshape(254, 512)
    scale = scales[:, None].expand(254, 64).contiguous()
    w = NVFP4Weight(packed.to(DEV), scale.to(DEV), 0.75)
    got = nvfp4_dequantize(w, torch.float32)
    assert torch.equal(got, dequantize_nvfp4(w))


def test_choose_path_and_errors():
    assert choose_path(1) == "gemv"
    assert choose_path(4096) == "dequant"
    assert choose_path(1, 248320, 2048) == "gemv"
    assert choose_path(4, 1024, 2048) == "gemv"  # small weight: the multi-row gemv
    assert choose_path(4, 8192, 2048) == "dot"
    assert choose_path(127) == "dot"
    assert choose_path(128) == "dequant"
    w = rand_nvfp4(16, 64, DEV)
    with pytest.raises(ValueError):
        nvfp4_linear(torch.randn(2, 32, device=DEV), w)
    with pytest.raises(ValueError):
        nvfp4_linear(torch.randn(2, 64, device=DEV), w, path="nope")
    with pytest.raises(TypeError):
        nvfp4_linear(torch.zeros(2, 64, dtype=torch.int32, device=DEV), w)



def test_dequantize_checks_rows_and_weight(poison):
    # a row range past the weight would read past its buffers; a strided weight is misread
    w = rand_nvfp4(16, 64, DEV)
    assert torch.equal(nvfp4_dequantize(w, torch.float32, rows=(3, 16)),
                       dequantize_nvfp4(w)[3:16])
    assert nvfp4_dequantize(w, torch.float32, rows=(5, 5)).shape == (0, 64)
    for rows in ((0, 17), (-1, 4), (6, 5)):
        with pytest.raises(ValueError):
            nvfp4_dequantize(w, rows=rows)
    strided = NVFP4Weight(torch.cat([w.packed, w.packed], 1)[:, ::2], w.block_scale, 1.0)
    with pytest.raises(ValueError):
        nvfp4_dequantize(strided)
    with pytest.raises(TypeError):
        nvfp4_dequantize(NVFP4Weight(w.packed.to(torch.int16), w.block_scale, 1.0))


# --- Qwen3.5-35B-A3B shapes on a GPU -----------------------------------------------------

SHAPES = {  # (N, K)
    "gate_up": (1024, 2048), "down": (2048, 512), "qkvz": (8192, 2048),
    "o_proj": (2048, 4096), "odd": (1023, 1040), "lm_head": (248320, 2048),
}


GPU_CASES = [  # grouped by shape so each weight is built once
    (name, m, path) for name in SHAPES for m in (1, 3, 16, 100, 512)
    for path in (None, *PATHS)
    if not (name == "lm_head" and (m in (3, 100) or (path == "gemv" and m > 16)))
]


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name,m,path", GPU_CASES, ids=lambda v: str(v))
def test_linear_gpu(poison, name, m, path):
    check_linear(m, *SHAPES[name], path, torch.bfloat16, 1e-2)


@pytest.mark.requires_cuda
def test_linear_gpu_fp16_and_graph(poison):
    w = rand_nvfp4(2048, 2048, DEV)
    x = torch.randn(1, 2048, device=DEV, dtype=torch.float16)
    ref = x.float() @ dequantize_nvfp4(w).T
    nvfp4_linear(x, w)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = nvfp4_linear(x, w)
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, ref) < 1e-2


@pytest.mark.requires_cuda
@pytest.mark.parametrize("name", [s for s in SHAPES if s != "lm_head"])
def test_gemv_fp32_x_gpu(poison, name):
    # an fp32 model decodes through the Triton gemv (the CUDA kernel takes 16-bit x): fp32
    # products and sums
    w, wd = _weight(*SHAPES[name])
    for m in (1, 3):
        x = torch.randn(m, SHAPES[name][1], device=DEV)
        assert rel_err(nvfp4_linear(x, w), x @ wd.T) < 1e-5

"""The CUDA NVFP4 decode kernels (`kernels/nvfp4_cuda.py`, `csrc/nvfp4_decode.cu`) vs the
torch references.

On a GPU: the gemv at every supported K, both tile variants, bf16 and fp16 x, row counts that
leave warps and blocks partly empty, the lm_head's 248,320 rows (the row loop); every code
and scale bit pattern against a reference that is exact in fp32; x with 0, inf and NaN
blocks; the MoE decode at 35B-A3B shapes (1, 4, 8 tokens, top 8 with and without the shared
expert, int32 and int64 ids, fp32 and bf16 routing weights, both variants) and at a small
shape, graph replay equal to eager. Outputs come from a NaN-poisoned torch.empty (the fp32
intermediate too). Bounds (relative Frobenius): 1e-2 for bf16 outputs (the products summed
in fp16 per block of 16, the output rounded to bf16), 2e-3 for fp16. Without a GPU: the
kernels' sm_90 build (nvcc, no GPU needed; slow) and the dispatch rules.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch

from tests.kernels.test_nvfp4 import rand_nvfp4, rel_err
from tinyserve.core import NVFP4Weight
from tinyserve.kernels import nvfp4_cuda
from tinyserve.kernels.cuda_lib import CSRC
from tinyserve.kernels.fused_moe import (
    allocate_expert_slots,
    fused_moe_ref,
    single_expert_slots,
    write_slot,
)
from tinyserve.kernels.nvfp4_ref import dequantize_nvfp4

BOUND = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def _x(k: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(1, k, device="cuda", dtype=dtype)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("variant", nvfp4_cuda.VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("n", [1, 37, 1000, 8192])
@pytest.mark.parametrize("k", nvfp4_cuda.GEMV_KS)
def test_gemv(poison, k, n, dtype, variant):
    w = rand_nvfp4(n, k, "cuda")
    x = _x(k, dtype)
    ref = x.float() @ dequantize_nvfp4(w).T
    y = nvfp4_cuda.nvfp4_gemv_cuda(x, w, variant)
    assert y.shape == (1, n) and y.dtype == dtype
    assert not torch.isnan(y).any()
    bound = BOUND[dtype] if n > 1 else 1e-2  # one value: no averaging over rows
    assert rel_err(y, ref) < bound, rel_err(y, ref)


@pytest.mark.requires_cuda
def test_gemv_lm_head_rows(poison):
    w = rand_nvfp4(248320, 2048, "cuda")
    x = _x(2048, torch.bfloat16)
    y = nvfp4_cuda.nvfp4_gemv_cuda(x, w)
    for r0 in (0, 123456, 248320 - 4096):  # the fp32 reference in row chunks
        ref = x.float() @ dequantize_nvfp4(NVFP4Weight(w.packed[r0:r0 + 4096],
                                                       w.block_scale[r0:r0 + 4096],
                                                       w.global_scale)).T
        assert rel_err(y[:, r0:r0 + 4096], ref) < 1e-2


@pytest.mark.requires_cuda
@pytest.mark.parametrize("k", nvfp4_cuda.GEMV_KS)
def test_gemv_every_code_and_scale_exact(poison, k):
    """One-hot x picks one column of W: one product per row, no rounding until the bf16
    output, which holds E2M1 x E4M3 exactly. Every code byte sits at every row's column
    over the rows, every non-NaN scale is a row; the NaN scales (0x7F, 0xFF) give NaN."""
    scales = [s for s in range(256) if s & 0x7F != 0x7F]
    n = len(scales)
    byte = (torch.arange(n, device="cuda")[:, None] + torch.arange(k // 2, device="cuda"))
    scale = torch.tensor(scales, dtype=torch.uint8, device="cuda")[:, None].repeat(1, k // 16)
    w = NVFP4Weight((byte % 256).to(torch.uint8).contiguous(), scale.contiguous(), 1.0)
    wd = dequantize_nvfp4(w)
    for j in torch.randperm(k)[:48].tolist():
        x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
        x[0, j] = 1.0
        y = nvfp4_cuda.nvfp4_gemv_cuda(x, w)
        assert torch.equal(y[0].float(), wd[:, j]), j
    nan_w = NVFP4Weight(w.packed[:2].contiguous(), torch.tensor(
        [[0x7F], [0xFF]], dtype=torch.uint8, device="cuda").repeat(1, k // 16), 1.0)
    assert torch.isnan(nvfp4_cuda.nvfp4_gemv_cuda(x, nan_w)).all()


@pytest.mark.requires_cuda
def test_gemv_x_zero_and_non_finite_blocks(poison):
    k, n = 2048, 64
    w = rand_nvfp4(n, k, "cuda")
    x = _x(k, torch.bfloat16)
    x[0, :16] = 0.0  # an all-zero block
    x[0, 16:32] *= 1e-30  # a block of tiny values: scaled up, not flushed
    y = nvfp4_cuda.nvfp4_gemv_cuda(x, w)
    assert rel_err(y, x.float() @ dequantize_nvfp4(w).T) < 1e-2
    x[0, 100] = float("inf")
    y = nvfp4_cuda.nvfp4_gemv_cuda(x, w)
    ref = x.float() @ dequantize_nvfp4(w).T  # +-inf, NaN where W[n, 100] is 0
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y), nan) and torch.equal(y[~nan].float(), ref[~nan])


def _expert(h: int, f: int, gen: torch.Generator):
    return (rand_nvfp4(f, h, "cuda", gen), rand_nvfp4(f, h, "cuda", gen),
            rand_nvfp4(h, f, "cuda", gen))


_LAYERS: dict = {}


def _layer(h: int, f: int, e: int):
    if (h, f, e) not in _LAYERS:
        gen = torch.Generator(device="cuda").manual_seed(h + f + e)
        slots = allocate_expert_slots(e, h, f, fp4=True, device="cuda")
        for i in range(e):
            write_slot(slots, i, *_expert(h, f, gen))
        _LAYERS[(h, f, e)] = (slots, single_expert_slots(*_expert(h, f, gen)))
    return _LAYERS[(h, f, e)]


def _routing(n: int, e: int, k: int, id_dtype: torch.dtype, w_dtype: torch.dtype):
    ids = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(n)]).to(id_dtype)
    return ids, torch.softmax(torch.randn(n, k, device="cuda"), dim=-1).to(w_dtype)


def _moe(x, ids, wts, slots, shared=None, logit=None, variant=0):
    return nvfp4_cuda.moe_decode_cuda(x, ids.contiguous().view(-1), wts.contiguous().view(-1),
                                      ids.shape[1], slots, shared, logit, variant)


@pytest.mark.requires_cuda
@pytest.mark.parametrize("variant", nvfp4_cuda.VARIANTS)
@pytest.mark.parametrize("n", [1, 4, 8])
def test_moe_decode_35b_layer(poison, n, variant):
    slots, sh = _layer(2048, 512, 256)
    x = torch.randn(n, 2048, device="cuda", dtype=torch.bfloat16)
    logit = torch.randn(n, 3, device="cuda", dtype=torch.bfloat16)[:, 1:2]  # row stride 3
    for id_dtype, w_dtype in ((torch.int32, torch.bfloat16), (torch.int64, torch.float32)):
        ids, wts = _routing(n, 256, 8, id_dtype, w_dtype)
        ref = fused_moe_ref(x, ids, wts, slots, shared_slots=sh, shared_logit=logit).float()
        y = _moe(x, ids, wts, slots, sh, logit, variant)
        assert not torch.isnan(y).any() and rel_err(y, ref) < 1e-2, rel_err(y, ref)
        y = _moe(x, ids, wts, slots, variant=variant)
        assert rel_err(y, fused_moe_ref(x, ids, wts, slots).float()) < 1e-2


@pytest.mark.requires_cuda
@pytest.mark.parametrize("h,f,k", [(512, 512, 2), (1024, 512, 8), (2048, 1024, 4)])
def test_moe_decode_other_shapes(poison, h, f, k):
    slots, sh = _layer(h, f, 12)
    x = torch.randn(3, h, device="cuda", dtype=torch.float16)
    ids, wts = _routing(3, 12, k, torch.int64, torch.float16)
    logit = torch.randn(3, 1, device="cuda", dtype=torch.float16)
    ref = fused_moe_ref(x, ids, wts, slots, shared_slots=sh, shared_logit=logit).float()
    y = _moe(x, ids, wts, slots, sh, logit)
    assert rel_err(y, ref) < 2e-3, rel_err(y, ref)


@pytest.mark.requires_cuda
def test_moe_decode_graph_equals_eager(poison):
    slots, sh = _layer(2048, 512, 256)
    ids, wts = _routing(1, 256, 8, torch.int32, torch.bfloat16)
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    logit = torch.randn(1, 1, device="cuda", dtype=torch.bfloat16)
    eager = _moe(x, ids, wts, slots, sh, logit)
    assert all(torch.equal(eager, _moe(x, ids, wts, slots, sh, logit)) for _ in range(10))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = _moe(x, ids, wts, slots, sh, logit)
    g.replay()
    assert torch.equal(y, eager)
    ids2, wts2 = _routing(1, 256, 8, torch.int32, torch.bfloat16)
    ids.copy_(ids2)
    wts.copy_(wts2)
    g.replay()
    assert torch.equal(y, _moe(x, ids, wts, slots, sh, logit))


def test_support_rules_and_errors():
    w = rand_nvfp4(64, 2048, "cpu")
    x = torch.randn(1, 2048, dtype=torch.bfloat16)
    assert not nvfp4_cuda.gemv_supported(x, w)  # not on a GPU
    with pytest.raises(ValueError, match="CUDA NVFP4 gemv"):
        nvfp4_cuda.nvfp4_gemv_cuda(x, w)
    slots = allocate_expert_slots(4, 2048, 512, fp4=True, device="cpu")
    assert not nvfp4_cuda.moe_supported(torch.randn(1, 2048), 2, slots, None)
    with pytest.raises(ValueError, match="CUDA MoE decode"):
        nvfp4_cuda.moe_decode_cuda(torch.randn(1, 2048), torch.zeros(2, dtype=torch.int32),
                                   torch.ones(2), 2, slots, None, None)


def test_default_configs_take_the_cuda_kernels(monkeypatch):
    """The defaults carry the CUDA variant; `nvfp4_linear` and `fused_moe` hand a call the
    CUDA kernels take to them (here faked, so the rule is checked without a GPU)."""
    from tinyserve.kernels import fused_moe_decode as fmd
    from tinyserve.kernels import nvfp4
    from tinyserve.kernels.fused_moe import fused_moe

    calls = []
    monkeypatch.setattr(nvfp4_cuda, "gemv_supported", lambda x, w: True)
    monkeypatch.setattr(nvfp4_cuda, "nvfp4_gemv_cuda",
                        lambda x, w, v: calls.append(("gemv", v)) or x.new_zeros(1, w.shape[0]))
    monkeypatch.setattr(nvfp4_cuda, "moe_supported", lambda *a: True)
    monkeypatch.setattr(nvfp4_cuda, "moe_decode_cuda",
                        lambda x, *a: calls.append(("moe", a[-1])) or torch.zeros_like(x))
    w = rand_nvfp4(16, 512, "cpu")
    nvfp4.nvfp4_linear(torch.randn(1, 512), w, path="gemv")
    slots = allocate_expert_slots(4, 512, 512, fp4=True, device="cpu")
    fused_moe(torch.randn(1, 512), torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 2),
              slots, path="fused")
    assert calls == [("gemv", 0), ("moe", fmd.MOE_FUSED_CUDA)]


def test_every_cuda_source_is_in_a_build_hash() -> None:
    from tinyserve.kernels import iso_cuda

    built = set(iso_cuda._SOURCES) | {"nvfp4_decode.cu"}
    assert {p.name for p in CSRC.glob("*.cu")} == built
    assert {p.name for p in CSRC.glob("*.cuh")} == set(iso_cuda._HEADERS)


@pytest.mark.slow
def test_kernels_build_for_sm90(tmp_path) -> None:
    """nvcc (no GPU needed) builds every instantiation for sm_90 within the register caps of
    their launch bounds; only the two alternatives named below may spill, and little."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    res = subprocess.run([nvcc, "-std=c++17", "-O3", "-arch=sm_90", "-c", "-Xptxas", "-v",
                          "-o", str(tmp_path / "nvfp4.o"), str(CSRC / "nvfp4_decode.cu")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    blocks = re.split(r"Compiling entry function", res.stderr)[1:]
    assert len(blocks) == 66, res.stderr[-3000:]  # 2 dtypes x (7 + 9 gemv, 4 + 9 gate_up, 4 down)
    for b in blocks:
        spill = int(re.search(r"(\d+) bytes spill stores", b).group(1))
        # down at F = 1024 with 3 blocks per SM; the gemv at K = 2048, 3 blocks per SM;
        # gate_up in one pass with 4 features per warp at H = 2048
        allowed = 200 if re.search(r"moe_down_kernel\w+Li2ELi3E|gemv_kernel\w+Li4ELi1ELi3E|"
                                   r"gate_up_once_kernel\w+Li4ELi4ELi2E", b) else 0
        assert spill <= allowed, b[:400]

"""RMSNorm Triton kernels (`kernels/norm.py`) vs the torch references (`model/norm.py`).

Without CUDA the kernels run in the Triton interpreter at small sizes; the 35B-A3B widths
(hidden 2048, head_dim 256, GDN head 128) run on a GPU. Outputs come from a NaN-poisoned
torch.empty. Bound: fp32 within 1e-5 relative; bf16 within two bf16 rounding steps (2^-6
relative) elementwise and, on the GPU, at most 1 % of the elements differing at all (the fp32
row sum is accumulated in another order than torch's). The interpreter casts fp32 -> bf16 by
truncation (the GPU rounds to nearest even), so on the CPU the bound is 2^-5 (up to three
truncating casts in a row) and no share of exact elements is asked.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.test_nvfp4 import poison  # noqa: E402, F401
from tinyserve.model.norm import (  # noqa: E402
    add_rms_norm_ref,
    gated_rms_norm_ref,
    rms_norm_ref,
)

pytest.importorskip("triton")
from tinyserve.kernels import norm as K  # noqa: E402

pytestmark = pytest.mark.usefixtures("poison")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# (rows shape, D): odd row counts, odd widths, the model widths on the GPU
SMALL = [((1,), 64), ((3,), 37), ((5, 3), 16), ((7,), 100)]
FULL = [((1,), 2048), ((8,), 2048), ((1, 16), 256), ((8, 2), 256), ((1, 32), 128),
        ((8, 32), 128), ((5,), 2049)]
SHAPES = SMALL if DEV == "cpu" else SMALL + FULL


def _id(case) -> str:
    rows, d = case
    return "x".join(map(str, rows)) + f"-D{d}"


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    assert not torch.isnan(y).any(), "unwritten (NaN-poisoned) elements"
    if y.dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)
        return
    yf, rf = y.float(), ref.float()
    bound = (2.0**-6 if DEV == "cuda" else 2.0**-5) * rf.abs() + 1e-6
    assert ((yf - rf).abs() <= bound).all(), float((yf - rf).abs().max())
    if DEV == "cuda":
        assert (yf != rf).float().mean().item() <= 0.01


def _rand(shape, dtype, gen_seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(gen_seed)
    return (2 * torch.randn(shape, generator=g, device=DEV)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SHAPES, ids=_id)
def test_rms_norm(case, dtype) -> None:
    rows, d = case
    x = _rand((*rows, d), dtype, 1)
    w = (0.3 * _rand((d,), torch.float32, 2)).to(dtype)
    assert_close(K.rms_norm(x, w, 1e-6), rms_norm_ref(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_strided_heads(dtype) -> None:
    # q_norm input: the q half of [N, H, 2D] (row stride 2D)
    n, h, d = 3, 4, 32 if DEV == "cpu" else 256
    qg = _rand((n, h, 2 * d), dtype, 3)
    q = qg[..., :d]
    w = (0.3 * _rand((d,), torch.float32, 4)).to(dtype)
    y = K.rms_norm(q, w, 1e-6)
    assert y.is_contiguous()
    assert_close(y, rms_norm_ref(q, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SHAPES, ids=_id)
def test_add_rms_norm(case, dtype) -> None:
    rows, d = case
    x, r = _rand((*rows, d), dtype, 5), _rand((*rows, d), dtype, 6)
    w = (0.3 * _rand((d,), torch.float32, 7)).to(dtype)
    y, s = K.add_rms_norm(x, r, w, 1e-6)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-6)
    if DEV == "cuda" or dtype == torch.float32:
        assert torch.equal(s, s_ref)  # the residual add rounds once, exactly like torch
    assert_close(s, s_ref)
    assert_close(y, y_ref)


@pytest.mark.parametrize("w_dtype", ["fp32", "model"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", SHAPES, ids=_id)
def test_gated_rms_norm(case, dtype, w_dtype) -> None:
    rows, d = case
    x, z = _rand((*rows, d), dtype, 8), _rand((*rows, d), dtype, 9)
    w = 1 + 0.3 * _rand((d,), torch.float32, 10)
    w = w if w_dtype == "fp32" else w.to(dtype)
    assert_close(K.gated_rms_norm(x, z, w, 1e-6), gated_rms_norm_ref(x, z, w, 1e-6))


def test_empty_and_bad_inputs() -> None:
    x = torch.empty(0, 16, device=DEV)
    assert K.rms_norm(x, torch.zeros(16, device=DEV), 1e-6).shape == (0, 16)
    with pytest.raises(ValueError):
        K.rms_norm(torch.zeros(2, 16, device=DEV), torch.zeros(8, device=DEV), 1e-6)
    with pytest.raises(ValueError):
        K.add_rms_norm(torch.zeros(2, 16, device=DEV), torch.zeros(3, 16, device=DEV),
                       torch.zeros(16, device=DEV), 1e-6)

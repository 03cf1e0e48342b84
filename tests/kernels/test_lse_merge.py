"""The log-sum-exp merge of two attention results (`glue.lse_merge`) against its fp32 torch
reference (`attention.lse_merge_ref`) and against attention over the union of the keys.

Without CUDA the kernel runs in the Triton interpreter at small sizes; the 35B-A3B extend
shape (16 heads, 2k queries, head_dim 256) runs on a GPU. Outputs come from a NaN-poisoned
torch.empty. fp32 within 1e-5; bf16 within one rounding step of the output (2^-7 relative to
the larger input: both round an fp32 value computed in another order; the interpreter
truncates, 2^-6).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_attention import _math_with_lse
from tests.kernels.test_norm import interpreter_ok, run_in_interpreter_child  # noqa: F401
from tinyserve.kernels.attention.chunk import lse_merge_ref

pytest.importorskip("triton")
from tinyserve.kernels import glue

pytestmark = [pytest.mark.usefixtures("poison", "interpreter_ok"), pytest.mark.gpu_shapes]
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1, 16), (3, 5, 37), (2, 7, 128)] + ([(16, 2048, 256)] if DEV == "cuda" else [])


def test_kernels_in_interpreter_child() -> None:
    run_in_interpreter_child(__file__)


def _attend(q, k, v):
    return _math_with_lse(q, k, v, False, 1.0)


@pytest.mark.parametrize("h,n,d", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_lse_merge(h: int, n: int, d: int, dtype: torch.dtype) -> None:
    g = torch.Generator(device=DEV).manual_seed(h * n + d)
    q = torch.randn(h, n, d, device=DEV, generator=g) * 0.3
    k = torch.randn(h, 19, d, device=DEV, generator=g)
    v = torch.randn(h, 19, d, device=DEV, generator=g)
    a, lse_a = _attend(q, k[:, :12], v[:, :12])
    b, lse_b = _attend(q, k[:, 12:], v[:, 12:])
    # a strided view for a (rows of a wider buffer), as the prefix's stacked heads come
    wide = torch.full((h, n, d + 3), float("nan"), device=DEV)
    wide[..., :d] = a
    a_in, b_in = wide[..., :d].to(dtype), b.to(dtype)
    if dtype == torch.float32:
        assert a_in.stride(1) == d + 3
    got = glue.lse_merge(a_in, lse_a, b_in, lse_b)
    want = lse_merge_ref(a_in, lse_a, b_in, lse_b)
    assert got.shape == (h, n, d) and got.dtype == dtype and not got.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        whole, _ = _attend(q, k, v)  # the merge is attention over the union of the keys
        torch.testing.assert_close(got, whole, rtol=1e-4, atol=1e-5)
    else:
        bound = (2.0 ** -7 if DEV == "cuda" else 2.0 ** -6) * torch.maximum(
            a_in.float().abs(), b_in.float().abs()) + 1e-6
        assert ((got.float() - want.float()).abs() <= bound).all()


def test_lse_merge_refuses_mismatched_inputs() -> None:
    a = torch.zeros(2, 3, 16, device=DEV)
    lse = torch.zeros(2, 3, device=DEV)
    with pytest.raises(ValueError, match="alike"):
        glue.lse_merge(a, lse, a[:, :2], lse)
    with pytest.raises(ValueError, match="fp32"):
        glue.lse_merge(a, lse.double(), a, lse)
    with pytest.raises(ValueError, match="unit last stride"):
        glue.lse_merge(a.transpose(1, 2).contiguous().transpose(1, 2), lse, a, lse)

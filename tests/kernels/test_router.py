"""Router and shared-expert glue kernels (`kernels/moe/router.py`, `kernels/glue.py`) vs
the torch references in `model/moe.py`.

Without CUDA the kernels run in the Triton interpreter at small sizes; the 35B-A3B router
(256 experts, top-8) and widths (H 2048, F 512) run on a GPU. Outputs come from a
NaN-poisoned torch.empty. Router logits are distinct (a random permutation of a spaced grid),
so the top-k ids must equal torch.topk's exactly; weights within 1e-6 (fp32) or one bf16
rounding step. Elementwise glue: fp32 within 1e-5, bf16 within 2^-6 relative on the GPU (one
step plus the exp difference; for the gated add relative to |routed| + |shared|, as the sum
may cancel); the interpreter truncates fp32 -> bf16, so 2^-5 on the CPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.test_norm import assert_close as _assert_close
from tests.kernels.test_norm import interpreter_ok, run_in_interpreter_child  # noqa: F401
from tinyserve.model.moe import gated_add_ref, silu_mul_ref, topk_softmax_ref

pytest.importorskip("triton")
from tinyserve.kernels import glue as S
from tinyserve.kernels.moe import router as R

pytestmark = [pytest.mark.usefixtures("poison", "interpreter_ok"), pytest.mark.gpu_shapes]


def test_kernels_in_interpreter_child() -> None:
    run_in_interpreter_child(__file__)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# (tokens, experts, top_k)
ROUTER_SMALL = [(1, 8, 2), (3, 37, 5), (5, 64, 8)]
ROUTER_FULL = [(1, 256, 8), (8, 256, 8), (33, 256, 8), (7, 257, 8)]
ROUTER = ROUTER_SMALL if DEV == "cpu" else ROUTER_SMALL[1:2] + ROUTER_FULL
# (rows, width)
ELEM_SMALL = [(1, 16), (3, 37), (5, 100)]
ELEM_FULL = [(1, 512), (8, 512), (1, 2048), (8, 2048), (3, 2049)]
ELEM = ELEM_SMALL if DEV == "cpu" else ELEM_SMALL[1:2] + ELEM_FULL


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def distinct_logits(n: int, e: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """[n, e] logits, every row a permutation of e distinct values exact in bf16."""
    grid = torch.linspace(-4.0, 4.0, e, device=DEV).to(torch.bfloat16).float()
    assert grid.unique().numel() == e, "grid collapsed in bf16"
    g = _gen(seed)
    rows = [grid[torch.randperm(e, generator=g, device=DEV)] for _ in range(n)]
    return torch.stack(rows).to(dtype)


def assert_close(y: torch.Tensor, ref: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """test_norm's bound, without its bound on the share of differing elements."""
    _assert_close(y, ref, scale, max_mismatch=None)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ROUTER, ids=lambda c: "N{}-E{}-k{}".format(*c))
def test_topk_softmax(case, dtype) -> None:
    n, e, k = case
    logits = distinct_logits(n, e, dtype, seed=n * 1000 + e)
    ids, w = R.topk_softmax(logits, k, dtype)
    ids_ref, w_ref = topk_softmax_ref(logits, k, dtype)
    assert ids.dtype == torch.int64 and ids.shape == (n, k)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)
    if dtype == torch.float32:
        torch.testing.assert_close(w.sum(-1), torch.ones(n, device=DEV))


def test_topk_softmax_strided_columns() -> None:
    # the router logits as the first E columns of the [N, E + 1] router | shared-gate output
    n, e, k = 3, 16, 4
    wide = distinct_logits(n, e + 1, torch.float32, seed=7)
    ids, w = R.topk_softmax(wide[:, :e], k, torch.float32)
    ids_ref, w_ref = topk_softmax_ref(wide[:, :e].contiguous(), k, torch.float32)
    assert torch.equal(ids, ids_ref)
    assert_close(w, w_ref)


def test_topk_softmax_ties_take_the_lower_id() -> None:
    logits = torch.zeros(2, 8, device=DEV)
    logits[0, 5] = logits[0, 2] = 1.0
    ids, w = R.topk_softmax(logits, 3, torch.float32)
    assert ids[0].tolist() == [2, 5, 0] and ids[1].tolist() == [0, 1, 2]
    torch.testing.assert_close(w[1], torch.full((3,), 1 / 3, device=DEV))


def test_topk_softmax_non_finite_logits_keep_ids_in_range() -> None:
    # a NaN or +inf logit makes the row's softmax NaN: the ids must still index real experts
    # (they address expert slots), the weights stay NaN as in the reference
    n, e, k = 3, 12, 4
    logits = distinct_logits(n, e, torch.float32, seed=11)
    logits[0, 3] = float("nan")
    logits[1, 7] = float("inf")
    logits[2] = float("-inf")
    ids, w = R.topk_softmax(logits, k, torch.float32)
    assert bool(((ids >= 0) & (ids < e)).all()), ids
    assert bool(torch.isnan(w).all())


def test_topk_softmax_bad_inputs() -> None:
    with pytest.raises(ValueError):
        R.topk_softmax(torch.zeros(2, 4, device=DEV), 5, torch.float32)
    with pytest.raises(ValueError):
        R.topk_softmax(torch.zeros(4, 2, device=DEV).t(), 1, torch.float32)
    ids, w = R.topk_softmax(torch.zeros(0, 8, device=DEV), 2, torch.float32)
    assert ids.shape == w.shape == (0, 2)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "gate_up"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ELEM, ids=lambda c: "N{}-F{}".format(*c))
def test_silu_mul(case, dtype, fused) -> None:
    n, f = case
    gu = (3 * torch.randn(n, 2 * f, generator=_gen(f), device=DEV)).to(dtype)
    g, u = (gu[:, :f], gu[:, f:]) if fused else (gu[:, :f].contiguous(),
                                                  gu[:, f:].contiguous())
    assert_close(S.silu_mul(g, u), silu_mul_ref(g, u))


@pytest.mark.parametrize("strided_gate", [False, True], ids=["gate", "gate_column"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ELEM, ids=lambda c: "N{}-H{}".format(*c))
def test_gated_add(case, dtype, strided_gate) -> None:
    n, h = case
    g = _gen(h + 1)
    routed = torch.randn(n, h, generator=g, device=DEV).to(dtype)
    shared = torch.randn(n, h, generator=g, device=DEV).to(dtype)
    wide = (3 * torch.randn(n, 9, generator=g, device=DEV)).to(dtype)
    logit = wide[:, 8:] if strided_gate else wide[:, 8:].contiguous()
    # the sum may cancel: bound relative to the operands
    assert_close(S.gated_add(routed, logit, shared), gated_add_ref(routed, logit, shared),
                 scale=routed.abs() + shared.abs())


def test_glue_bad_inputs() -> None:
    a = torch.zeros(2, 8, device=DEV)
    with pytest.raises(ValueError):
        S.silu_mul(a, torch.zeros(3, 8, device=DEV))
    with pytest.raises(ValueError):
        S.gated_add(a, torch.zeros(2, 2, device=DEV), a)
    with pytest.raises(ValueError):  # the output takes routed's dtype: shared must match it
        S.gated_add(a, torch.zeros(2, 1, device=DEV), a.to(torch.bfloat16))
    with pytest.raises(ValueError):
        S.gated_add(a, torch.zeros(2, 1, device=DEV, dtype=torch.int32), a)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [(1, 2, 32), (3, 4, 48)] + (
    [(1, 16, 256), (8, 16, 256)] if DEV == "cuda" else []), ids=lambda c: "N{}-H{}-D{}".format(*c))
def test_sigmoid_mul_attention_gate(case, dtype) -> None:
    from tinyserve.model.attention import sigmoid_mul_ref

    n, h, d = case
    g = _gen(d)
    o = torch.randn(n, h, d, generator=g, device=DEV).to(dtype)
    qg = (3 * torch.randn(n, h, 2 * d, generator=g, device=DEV)).to(dtype)
    gate = qg[..., d:]  # the gate half of q|gate rows, read in place
    assert_close(S.sigmoid_mul(o, gate), sigmoid_mul_ref(o, gate))

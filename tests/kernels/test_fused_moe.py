"""Fused MoE over expert slots vs the per-slot torch loop, NVFP4 and dense experts.

Without CUDA the kernels run in the Triton interpreter on a tiny layer; the 35B-A3B layer
(H=2048, F=512, 256 experts, top-8) runs on a GPU. Workspaces are poisoned with NaN.
Bound: relative Frobenius error < 1e-2 (bf16 activations), < 1e-5 (fp32, interpreter).
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.kernels.test_nvfp4 import rand_nvfp4, rel_err
from tinyserve.core import DenseWeight
from tinyserve.kernels.moe.fused import (
    FUSED_MAX_TOKENS,
    MOE_PATHS,
    align_pairs,
    allocate_expert_slots,
    choose_path,
    fused_moe,
    fused_moe_ref,
    pack_expert_slots,
    write_slot,
)

pytest.importorskip("triton")
pytestmark = [pytest.mark.usefixtures("poison"), pytest.mark.gpu_shapes]

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_experts(num: int, h: int, f: int, fp4: bool) -> list:
    if fp4:
        return [(rand_nvfp4(f, h, DEV), rand_nvfp4(f, h, DEV), rand_nvfp4(h, f, DEV))
                for _ in range(num)]
    dt = torch.bfloat16 if DEV == "cuda" else torch.float32
    return [tuple(DenseWeight((torch.randn(o, i, device=DEV) / i**0.5).to(dt))
                  for o, i in ((f, h), (f, h), (h, f))) for _ in range(num)]


def routing(n: int, num_slots: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(num_slots, device=DEV)[:k] for _ in range(n)])
    weights = torch.softmax(torch.randn(n, k, device=DEV), dim=-1)
    return ids, weights


def check(slots, n: int, k: int, dtype: torch.dtype, bound: float, path=None) -> None:
    ids, weights = routing(n, slots.num_slots, k)
    x = torch.randn(n, slots.hidden_size, device=DEV).to(dtype)
    ref = fused_moe_ref(x.float(), ids, weights, slots)
    y = fused_moe(x, ids, weights, slots, path=path)
    assert y.shape == x.shape and y.dtype == dtype
    assert not torch.isnan(y).any()
    assert rel_err(y, ref) < bound, rel_err(y, ref)
    # the sum left in fp32 (a CPU part joins it before the one rounding): the same sum
    y32 = fused_moe(x, ids, weights, slots, path=path, out_dtype=torch.float32)
    assert y32.dtype == torch.float32 and torch.equal(y32.to(dtype), y)


SMALL_CASES = [(True, "dot"), (False, "gemv"), (False, "dot")]  # "fused": *_decode.py


@pytest.mark.parametrize("n", [1, 5], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("fp4,path", SMALL_CASES, ids=lambda v: str(v))
def test_fused_moe_small(fp4, path, n):
    dtype = torch.bfloat16 if DEV == "cuda" else torch.float32
    slots = pack_expert_slots(make_experts(6, 64, 48, fp4), DEV, dtype=dtype)
    check(slots, n, 3, dtype, 1e-2 if dtype == torch.bfloat16 else 1e-5, path)


def test_choose_path():
    assert choose_path(1, 8, fp4=True) == "fused"
    assert choose_path(FUSED_MAX_TOKENS, 8, fp4=True) == "fused"
    assert choose_path(FUSED_MAX_TOKENS + 1, 2, fp4=True) == "dot"
    assert choose_path(8, 8, fp4=False) == "gemv"
    assert choose_path(9, 8, fp4=False) == "dot"


def test_fused_moe_default_path():
    slots = pack_expert_slots(make_experts(4, 64, 32, True), DEV)
    ids, weights = routing(1, 4, 2)
    x = torch.randn(1, 64, device=DEV)
    assert rel_err(fused_moe(x, ids, weights, slots), fused_moe_ref(x, ids, weights, slots)) < 1e-2


def test_align_pairs():
    ids = torch.tensor([3, 0, 3, 3, 1, 0, 3], device=DEV)
    sorted_pairs, block_slot = align_pairs(ids, 5, 2)
    got = {}
    for b, s in enumerate(block_slot.tolist()):
        chunk = sorted_pairs[2 * b:2 * b + 2].tolist()
        if s < 0:
            assert chunk == [7, 7]
            continue
        got.setdefault(s, []).extend(p for p in chunk if p < 7)
    assert got == {0: [1, 5], 1: [4], 3: [0, 2, 3, 6]}


def test_write_slot_then_route():
    # a cache-like buffer: experts land in arbitrary slots; routing names those slots
    experts = make_experts(2, 64, 32, True)
    slots = allocate_expert_slots(5, 64, 32, fp4=True, device=DEV)
    write_slot(slots, 3, *experts[0])
    write_slot(slots, 1, *experts[1])
    ref_slots = pack_expert_slots(experts, DEV)
    x = torch.randn(4, 64, device=DEV)
    ids = torch.tensor([[3, 1], [1, 3], [3, 1], [1, 3]], device=DEV)
    weights = torch.rand(4, 2, device=DEV)
    y = fused_moe(x, ids, weights, slots)
    ref = fused_moe_ref(x, torch.where(ids == 3, 0, 1), weights, ref_slots)
    assert rel_err(y, ref.float()) < 1e-2


def test_errors():
    slots = pack_expert_slots(make_experts(2, 32, 16, True), DEV)
    x = torch.randn(1, 32, device=DEV)
    with pytest.raises(ValueError):
        fused_moe(torch.randn(1, 48, device=DEV), torch.zeros(1, 2, dtype=torch.int64,
                                                              device=DEV),
                  torch.ones(1, 2, device=DEV), slots)
    with pytest.raises(TypeError):
        fused_moe(x, torch.zeros(1, 2, device=DEV), torch.ones(1, 2, device=DEV), slots)
    with pytest.raises(TypeError, match="float32"):  # fp32 x, an fp16 sum
        fused_moe(x, torch.zeros(1, 2, dtype=torch.int64, device=DEV),
                  torch.ones(1, 2, device=DEV), slots, out_dtype=torch.float16)
    with pytest.raises(TypeError):  # integer activations
        fused_moe(x.to(torch.int32), torch.zeros(1, 2, dtype=torch.int64, device=DEV),
                  torch.ones(1, 2, device=DEV), slots)
    with pytest.raises(TypeError):
        write_slot(slots, 0, *make_experts(1, 32, 16, False)[0])
    with pytest.raises(IndexError):
        write_slot(slots, 2, *make_experts(1, 32, 16, True)[0])
    ids = torch.zeros(1, 2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError):  # NVFP4 decode is the fused path's
        fused_moe(x, ids, torch.ones(1, 2, device=DEV), slots, path="gemv")
    dense = pack_expert_slots(make_experts(2, 32, 16, False), DEV)
    with pytest.raises(ValueError):
        fused_moe(x, ids, torch.ones(1, 2, device=DEV), dense, path="fused")
    with pytest.raises(ValueError):
        fused_moe(x, ids, torch.ones(1, 2, device=DEV), slots, path="fused2")


# --- Qwen3.5-35B-A3B layer on a GPU ------------------------------------------------------


@pytest.mark.requires_cuda
@pytest.mark.parametrize("path", [None, *MOE_PATHS], ids=lambda p: p or "default")
@pytest.mark.parametrize("n", [1, 3, 64, 2048], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("fp4", [True, False], ids=["nvfp4", "bf16"])
def test_fused_moe_gpu(fp4, n, path):
    if path == "fused" and not fp4:
        pytest.skip("the fused path takes NVFP4 slots")
    if path == "gemv" and fp4:
        pytest.skip("the gemv path takes dense slots")
    check(_gpu_slots(fp4), n, 8, torch.bfloat16, 1e-2, path)


@functools.lru_cache(maxsize=1)
def _gpu_slots(fp4: bool):
    return pack_expert_slots(make_experts(256 if fp4 else 64, 2048, 512, fp4), DEV)


@pytest.mark.requires_cuda
def test_fused_moe_gpu_graph():
    slots = pack_expert_slots(make_experts(16, 2048, 512, True), DEV)
    ids, weights = routing(1, 16, 8)
    x = torch.randn(1, 2048, device=DEV, dtype=torch.bfloat16)
    fused_moe(x, ids, weights, slots)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = fused_moe(x, ids, weights, slots)
    ids.copy_(routing(1, 16, 8)[0])  # new routing, same graph
    g.replay()
    torch.cuda.synchronize()
    assert rel_err(y, fused_moe_ref(x.float(), ids, weights, slots)) < 1e-2

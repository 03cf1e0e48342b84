"""`kernels/moe/cpu_exchange.py`: the request written into a CPU expert call's stage and its
answer added, Triton (the interpreter on CPU) against the torch references, exactly (but for
the interpreter's truncating casts to 16 bits); on a GPU in pinned host memory, inside a CUDA
graph too."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels.moe.cpu_exchange import (
    add_answer,
    add_answer_ref,
    write_request,
    write_request_ref,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PIN = torch.cuda.is_available()


def _pairs(n: int, h: int, k: int, seed: int, dtype: torch.dtype = torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g).to(dtype)
    ids = torch.randint(0, 256, (n, k), generator=g)
    slot_ids = torch.where(torch.rand(n, k, generator=g) < 0.5, -1,
                           torch.randint(0, 90, (n, k), generator=g)).to(torch.int32)
    weights = torch.rand(n, k, generator=g)
    return [t.to(DEV) for t in (x, ids, slot_ids, weights)]


@pytest.mark.parametrize("n,h,k,dtype,wdtype", [
    (1, 512, 8, torch.bfloat16, torch.float32), (3, 320, 6, torch.float32, torch.float32),
    (16, 64, 1, torch.float16, torch.bfloat16)], ids=["decode", "odd-h", "batch-bf16-weights"])
def test_write_request_equals_reference(n, h, k, dtype, wdtype) -> None:
    x, ids, slot_ids, weights = _pairs(n, h, k, seed=n + h, dtype=dtype)
    weights = weights.to(wdtype)
    want = torch.empty(n, h + 2 * k)
    want_slots, want_weights = write_request_ref(x.cpu(), ids.cpu(), slot_ids.cpu(),
                                                 weights.cpu(), want)
    stage = torch.full((n, h + 2 * k), float("nan"), pin_memory=PIN)
    gpu_slots, gpu_weights = write_request(x, ids, slot_ids, weights, stage)
    if PIN:
        torch.cuda.synchronize()
    assert torch.equal(stage.view(torch.int32), want.view(torch.int32))  # bits: ids, NaN
    rel = stage[:, h:h + k].view(torch.int32)
    assert torch.equal(rel, torch.where(slot_ids.cpu() < 0, ids.cpu().int(), -1))
    # the GPU part: the CPU's pairs at slot 0 with weight 0, the others as they were
    assert gpu_slots.dtype == torch.int32 and gpu_weights.dtype == wdtype
    assert torch.equal(gpu_slots.cpu(), want_slots) and torch.equal(gpu_weights.cpu(),
                                                                   want_weights)
    assert (want_weights[slot_ids.cpu() < 0] == 0).all()
    assert torch.equal(want_weights[slot_ids.cpu() >= 0], weights.cpu()[slot_ids.cpu() >= 0])


@pytest.mark.parametrize("n,h,dtype,out_dtype", [
    (1, 512, torch.bfloat16, None), (5, 300, torch.float16, None), (2, 64, torch.float32, None),
    (1, 512, torch.float32, torch.bfloat16)], ids=["bf16", "f16-odd", "f32", "f32-to-bf16"])
def test_add_answer_equals_reference(n, h, dtype, out_dtype) -> None:
    # f32-to-bf16: a GPU part summed in fp32, the layer's sum rounded once
    g = torch.Generator().manual_seed(h)
    out = torch.randn(n, h, generator=g).to(dtype).to(DEV)
    answer = torch.randn(n, h, generator=g).pin_memory() if PIN else torch.randn(n, h, generator=g)
    got = add_answer(out, answer, out_dtype)
    dtype = out_dtype or dtype
    assert got.dtype == dtype and got.device == out.device
    want = add_answer_ref(out.cpu(), answer, out_dtype)
    assert want.dtype == dtype
    if DEV == "cpu" and dtype != torch.float32:  # the interpreter truncates: one rounding step
        step = want.float().abs() * torch.finfo(dtype).eps
        assert ((got.float() - want.float()).abs() <= step).all()
    else:
        assert torch.equal(got.cpu(), want)


def test_exchange_checks_its_inputs() -> None:
    x, ids, slot_ids, weights = _pairs(2, 64, 4, seed=0)
    with pytest.raises(ValueError, match="stage"):
        write_request(x, ids, slot_ids, weights, torch.zeros(2, 64 + 4))
    with pytest.raises(ValueError, match="slot_ids must be int32"):
        write_request(x, ids, slot_ids.long(), weights, torch.zeros(2, 72))
    with pytest.raises(ValueError, match=r"contiguous \[2, k\]"):
        write_request(x, ids[:, :2], slot_ids, weights, torch.zeros(2, 72))
    with pytest.raises(ValueError, match="answer"):
        add_answer(x, torch.zeros(2, 64, dtype=torch.float64))
    with pytest.raises(ValueError, match="out"):
        add_answer(x.t(), torch.zeros(64, 2))


@pytest.mark.requires_cuda
def test_exchange_in_a_cuda_graph_sees_each_replays_host_data() -> None:
    # the answer changes on the host between replays: the kernel reads it anew each time
    n, h, k = 1, 2048, 8
    x, ids, slot_ids, weights = _pairs(n, h, k, seed=1)
    stage = torch.zeros(n, h + 2 * k, pin_memory=True)
    answer = torch.zeros(n, h, pin_memory=True)
    out = torch.randn(n, h, device="cuda").bfloat16()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gpu_part = write_request(x, ids, slot_ids, weights, stage)
        res = add_answer(out, answer)
    for seed in range(3):
        x.copy_(torch.randn(n, h, generator=torch.Generator().manual_seed(seed)))
        answer.copy_(torch.randn(n, h, generator=torch.Generator().manual_seed(seed + 10)))
        graph.replay()
        torch.cuda.synchronize()
        want = torch.empty_like(stage)
        want_part = write_request_ref(x.cpu(), ids.cpu(), slot_ids.cpu(), weights.cpu(), want)
        assert torch.equal(stage.view(torch.int32), want.view(torch.int32))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu_part, want_part, strict=True))
        assert torch.equal(res.cpu(), add_answer_ref(out.cpu(), answer))

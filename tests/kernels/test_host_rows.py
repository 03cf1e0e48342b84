"""`kernels/moe/host_rows.py`: the row copy and gather (Triton; the interpreter on CPU) against
torch indexing, and host-memory registration. On a GPU the table lives in registered host memory and
the gather reads it from the device, inside a CUDA graph too."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels.moe.host_rows import copy_rows, gather_rows, register_mapped

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype,width", [(torch.bfloat16, 96), (torch.float32, 40),
                                         (torch.bfloat16, 7)], ids=["bf16", "f32", "odd"])
def test_gather_rows_equals_indexing(poison, dtype, width) -> None:
    table = torch.randn(50, width).to(dtype)
    for ids in (torch.tensor([3, 0, 49, 3]), torch.tensor([7], dtype=torch.int32)):
        got = gather_rows(table.to(DEV), ids.to(DEV))
        assert got.dtype == dtype and torch.equal(got.cpu(), table[ids.long()])
    assert gather_rows(table.to(DEV), torch.empty(0, dtype=torch.long, device=DEV)).shape == (
        0, width)


@pytest.mark.parametrize("dtype,shape", [(torch.uint8, (6, 5)), (torch.float32, (3,)),
                                         (torch.uint8, (4, 3))], ids=["u8", "f32", "u8-words"])
def test_copy_rows_into_listed_rows(dtype, shape) -> None:
    # rows of any shape (uint8 rows of 30 bytes copied as bytes, of 12 bytes as 4-byte words),
    # -1 skipped
    src = (torch.rand(9, *shape) * 100).to(dtype)
    dst = torch.full((5, *shape), 7).to(dtype).to(DEV)
    want = dst.cpu().clone()
    rows, slots = torch.tensor([4, -1, 0, 8], dtype=torch.int32), torch.tensor([2, 0, 4, 1])
    for r, s in zip(rows.tolist(), slots.tolist(), strict=True):
        if r >= 0:
            want[s] = src[r]
    copy_rows(src.to(DEV), dst, rows.to(DEV), slots.to(DEV))
    assert torch.equal(dst.cpu(), want)


def test_copy_rows_checks_its_inputs() -> None:
    a, b = torch.zeros(4, 6), torch.zeros(2, 6)
    ok = torch.zeros(1, dtype=torch.long)
    with pytest.raises(ValueError, match="rows differ"):
        copy_rows(a, torch.zeros(2, 5), ok)
    with pytest.raises(ValueError, match="rows differ"):
        copy_rows(a, b.half(), ok)
    with pytest.raises(ValueError, match="contiguous"):
        copy_rows(torch.zeros(6, 4).t(), b, ok)
    with pytest.raises(ValueError, match="dst_rows"):
        copy_rows(a, b, ok, torch.zeros(1))
    with pytest.raises(ValueError, match="destination rows"):
        copy_rows(a, b, ok, torch.zeros(2, dtype=torch.long))


def test_gather_rows_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="table"):
        gather_rows(torch.zeros(4, 6).t(), torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="ids"):
        gather_rows(torch.zeros(4, 6), torch.zeros(1))


def test_register_mapped_refuses_what_it_cannot_pin() -> None:
    with pytest.raises(ValueError, match="table"):
        register_mapped(torch.zeros(4, 6).t(), "table")
    if not torch.cuda.is_available():
        assert register_mapped(torch.zeros(4, 6), "table") is False  # warned, stays pageable


@pytest.mark.requires_cuda
def test_gather_rows_from_registered_host_memory() -> None:
    table = torch.randn(1000, 256).to(torch.bfloat16)
    assert register_mapped(table, "test table")
    ids = torch.randint(0, 1000, (5,), device="cuda")
    assert torch.equal(gather_rows(table, ids).cpu(), table[ids.cpu()])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = gather_rows(table, ids)
    ids.copy_(torch.tensor([0, 999, 5, 5, 1], device="cuda"))
    g.replay()
    assert torch.equal(out.cpu(), table[[0, 999, 5, 5, 1]])

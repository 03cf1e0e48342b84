"""`kernels/host_rows.py`: the row gather (Triton; the interpreter on CPU) against torch
indexing, and host-memory registration. On a GPU the table lives in registered host memory and
the gather reads it from the device, inside a CUDA graph too."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tinyserve.kernels.host_rows import gather_rows, register_mapped  # noqa: E402

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

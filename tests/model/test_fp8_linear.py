"""`linear` of an FP8 (W8A16) weight equals the bit-level reference."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels.nvfp4.ref import fp8_linear_ref, quantize_fp8
from tinyserve.model.linear import linear

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.requires_cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel", [False, True], ids=["tensor", "channel"])
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])
def test_fp8_linear_matches_reference(device, per_channel, dtype, bound) -> None:
    w = torch.randn(257, 192) * 3
    q = quantize_fp8(w, per_channel=per_channel)
    q = type(q)(q.weight.to(device), q.scale.to(device))
    x = torch.randn(7, 192, device=device)
    ref = fp8_linear_ref(x.float().cpu(), type(q)(q.weight.cpu(), q.scale.cpu()))
    got = linear(x.to(dtype), q)
    assert got.dtype == dtype and got.shape == (7, 257)
    err = ((got.float().cpu() - ref).norm() / ref.norm()).item()
    assert err < bound, err

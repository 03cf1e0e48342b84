"""The chunk's causal attention (lower-right mask through SDPA) against fp32 math."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels.attention import chunk_causal_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    group = q.shape[0] // k.shape[0]
    n, s = q.shape[1], k.shape[1]
    ke, ve = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    sc = (q.double() @ ke.transpose(1, 2)) * scale
    hidden = torch.arange(s)[None, :] > torch.arange(n)[:, None] + (s - n)
    return torch.softmax(sc.masked_fill(hidden, float("-inf")), -1) @ ve


@pytest.mark.parametrize("hq,hkv,n,s", [(8, 2, 5, 5), (8, 2, 5, 13), (4, 4, 1, 9),
                                        (16, 2, 33, 100), (2, 1, 7, 7)])
def test_chunk_causal_attention_matches_fp32_math(hq: int, hkv: int, n: int, s: int) -> None:
    torch.manual_seed(n * 100 + s)
    q, k, v = torch.randn(hq, n, 64), torch.randn(hkv, s, 64), torch.randn(hkv, s, 64)
    out = chunk_causal_attention(q, k, v, 0.125)
    assert out.shape == (hq, n, 64) and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.125), rtol=1e-5, atol=1e-5)


def test_chunk_longer_than_its_sequence_is_refused() -> None:
    with pytest.raises(ValueError, match="5 queries over 4 keys"):
        chunk_causal_attention(torch.randn(2, 5, 8), torch.randn(2, 4, 8),
                               torch.randn(2, 4, 8), 1.0)


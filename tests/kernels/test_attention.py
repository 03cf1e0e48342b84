"""The chunk's causal attention (lower-right mask through SDPA) against fp32 math."""

from __future__ import annotations

import pytest
import torch

from tinyserve.kernels.attention import chunk as attention
from tinyserve.kernels.attention.chunk import chunk_causal_attention

pytestmark = pytest.mark.gpu_shapes


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



def _math_with_lse(q, k, v, causal, scale):
    """fp32 stand-in for the cuDNN call: top-left causal, natural-log LSE."""
    sc = (q.float() @ k.float().transpose(1, 2)) * scale
    if causal:
        sc = sc.masked_fill(torch.ones(sc.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(sc, -1)
    return (torch.softmax(sc, -1) @ v.float()).to(q.dtype), lse


@pytest.mark.parametrize("hq,hkv,n,s", [(8, 2, 5, 13), (16, 2, 33, 100), (4, 4, 7, 8)])
def test_split_path_merges_prefix_and_chunk(monkeypatch, hq: int, hkv: int, n: int,
                                            s: int) -> None:
    # the CUDA path's structure (the prefix with a KV head's query heads stacked, the chunk
    # causal, the log-sum-exp merge) with the cuDNN call replaced by fp32 math
    monkeypatch.setattr(attention, "_cudnn", _math_with_lse)
    torch.manual_seed(hq + n + s)
    q, k, v = torch.randn(hq, n, 64), torch.randn(hkv, s, 64), torch.randn(hkv, s, 64)
    out = attention._split_cudnn(q, k, v, 0.125)
    torch.testing.assert_close(out.double(), _reference(q, k, v, 0.125), rtol=1e-5, atol=1e-5)


def test_cudnn_check_accepts_right_and_refuses_wrong_attention(monkeypatch) -> None:
    # the one-time check against fp32 math, with the cuDNN call replaced by fp32 math (passes)
    # and by math that ignores the causal mask (must be refused)
    monkeypatch.setattr(attention, "_cudnn", _math_with_lse)
    assert attention._check_cudnn(torch.device("cpu"), torch.float32, 64)
    monkeypatch.setattr(attention, "_cudnn",
                        lambda q, k, v, causal, scale: _math_with_lse(q, k, v, False, scale))
    assert not attention._check_cudnn(torch.device("cpu"), torch.float32, 64)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("hq,hkv,n,s", [(16, 2, 2048, 2048), (16, 2, 2048, 4096),
                                        (16, 2, 300, 9000), (8, 8, 64, 65), (16, 2, 1, 500)])
def test_chunk_causal_attention_on_cuda(hq: int, hkv: int, n: int, s: int) -> None:
    torch.manual_seed(n + s)
    q = torch.randn(hq, n, 256, device="cuda").bfloat16()
    k = torch.randn(hkv, s, 256, device="cuda").bfloat16()
    v = torch.randn(hkv, s, 256, device="cuda").bfloat16()
    out = chunk_causal_attention(q, k, v, 256 ** -0.5)
    want = _reference(q.cpu().float(), k.cpu().float(), v.cpu().float(), 256 ** -0.5)
    cos = torch.nn.functional.cosine_similarity(out.cpu().double().flatten(), want.flatten(),
                                                dim=0).item()
    err = (out.cpu().double() - want).abs().max().item()
    print(f"\nhq {hq} hkv {hkv} n {n} s {s}: cosine {cos:.7f} max abs err {err:.2e}, "
          f"cuDNN split path {attention._CUDNN_OK}")
    assert cos >= 0.9999 and err < 2e-2
    if torch.cuda.get_device_capability()[0] >= 9 and 1 < n < s:  # the H200 takes cuDNN
        assert all(attention._CUDNN_OK.values())

"""Model building blocks against the transformers modules they mirror (bf16 bit-exact where HF
is deterministic), and the linear dispatch over every weight storage."""

from __future__ import annotations

import pytest
import torch

from tinyserve.core import DenseWeight
from tinyserve.kernels.nvfp4.ref import dequantize, quantize_fp8, quantize_nvfp4
from tinyserve.model.linear import linear
from tinyserve.model.moe import topk_softmax
from tinyserve.model.norm import gated_rms_norm, rms_norm
from tinyserve.model.rope import PartialRoPE

hf = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rms_norms_match_hf(dtype: torch.dtype) -> None:
    g = _gen(0)
    x = torch.randn(5, 3, 32, generator=g).to(dtype)
    w = 0.3 * torch.randn(32, generator=g)
    ref = hf.Qwen3_5MoeRMSNorm(32, eps=1e-6)
    ref.weight.data = w.to(dtype)
    with torch.no_grad():
        assert torch.equal(rms_norm(x, w.to(dtype), 1e-6), ref(x))
    z = torch.randn(5, 3, 32, generator=g).to(dtype)
    gated = hf.Qwen3_5MoeRMSNormGated(32, eps=1e-6)
    gated.weight.data = (1 + w).to(dtype)
    with torch.no_grad():
        assert torch.equal(gated_rms_norm(x, z, (1 + w).to(dtype), 1e-6), gated(x, z))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_partial_rope_matches_hf(dtype: torch.dtype) -> None:
    head_dim, rot = 32, 8
    rope = PartialRoPE(head_dim, rot, 1e7)
    pos = torch.tensor([0, 1, 2, 17, 300])
    q = torch.randn(5, 4, head_dim, generator=_gen(1)).to(dtype)
    k = torch.randn(5, 2, head_dim, generator=_gen(2)).to(dtype)
    cos, sin = rope.cos_sin(pos, dtype)
    # HF layout [B, H, T, D] with cos/sin [B, T, R].
    q_ref, k_ref = hf.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                           cos[None], sin[None])
    assert torch.equal(rope.apply(q, cos, sin), q_ref[0].transpose(0, 1))
    assert torch.equal(rope.apply(k, cos, sin), k_ref[0].transpose(0, 1))
    assert torch.equal(q[0, :, rot:], rope.apply(q, cos, sin)[0, :, rot:])


def test_router_matches_hf() -> None:
    cfg = type("C", (), {"num_experts_per_tok": 3, "num_experts": 8, "hidden_size": 16})()
    ref = hf.Qwen3_5MoeTopKRouter(cfg)
    ref.weight.data = torch.randn(8, 16, generator=_gen(3)).bfloat16()
    x = torch.randn(6, 16, generator=_gen(4)).bfloat16()
    ids, weights = topk_softmax(linear(x, DenseWeight(ref.weight.data)), 3, x.dtype)
    with torch.no_grad():
        _, w_ref, ids_ref = ref(x)
    assert torch.equal(ids, ids_ref) and torch.equal(weights, w_ref)
    assert weights.dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["dense", "nvfp4", "fp8", "fp8_channel"])
def test_linear_every_storage(kind: str) -> None:
    w = torch.randn(48, 64, generator=_gen(5))
    store = {"dense": lambda: DenseWeight(w), "nvfp4": lambda: quantize_nvfp4(w),
             "fp8": lambda: quantize_fp8(w),
             "fp8_channel": lambda: quantize_fp8(w, per_channel=True)}[kind]()
    x = torch.randn(7, 64, generator=_gen(6))
    dense = dequantize(store, torch.float32)
    assert dense.shape == (48, 64)
    torch.testing.assert_close(linear(x, store), x @ dense.T, rtol=1e-5, atol=1e-5)
    if kind != "dense":  # quantized, but close to the original weight
        assert (dense - w).abs().max() < 0.35 * w.abs().max()

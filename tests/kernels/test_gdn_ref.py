"""The GDN references: chunked == recurrent (fp64), conv state continuation, and agreement with
the transformers torch fallbacks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinyserve.kernels.gdn.ref import (
    causal_conv1d_ref,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule_ref,
)


def _inputs(T: int, H: int, dk: int, dv: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(rnd(T, H, dk), dim=-1) * dk**-0.5
    k = F.normalize(rnd(T, H, dk), dim=-1)
    v = rnd(T, H, dv)
    g = -F.softplus(rnd(T, H)) * 0.5
    beta = torch.sigmoid(rnd(T, H))
    state = rnd(H, dk, dv) * 0.1
    return tuple(t.to(dtype) for t in (q, k, v, g, beta, state))


@pytest.mark.parametrize("T,chunk", [(1, 64), (7, 4), (64, 64), (70, 64), (33, 16)],
                         ids=lambda x: str(x))
def test_chunk_equals_recurrent_fp64(T: int, chunk: int) -> None:
    q, k, v, g, beta, state = _inputs(T, 3, 8, 6, torch.float64, seed=T)
    o_r, s_r = recurrent_gated_delta_rule_ref(q, k, v, g, beta, state)
    o_c, s_c = chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk_size=chunk)
    assert o_c.dtype == torch.float64 and o_c.shape == (T, 3, 6) and s_c.shape == (3, 8, 6)
    torch.testing.assert_close(o_c, o_r, rtol=0, atol=1e-12)
    torch.testing.assert_close(s_c, s_r, rtol=0, atol=1e-12)


def test_split_continuation_fp32() -> None:
    q, k, v, g, beta, state = _inputs(50, 2, 16, 16, torch.float32, seed=1)
    o_full, s_full = chunk_gated_delta_rule_ref(q, k, v, g, beta, state, chunk_size=16)
    o1, s1 = chunk_gated_delta_rule_ref(q[:23], k[:23], v[:23], g[:23], beta[:23], state, 16)
    o2, s2 = recurrent_gated_delta_rule_ref(q[23:], k[23:], v[23:], g[23:], beta[23:], s1)
    torch.testing.assert_close(torch.cat([o1, o2]), o_full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s2, s_full, rtol=1e-5, atol=1e-5)


def test_matches_transformers_fallbacks() -> None:
    mod = pytest.importorskip("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
    T, Hk, Hv, dk, dv = 70, 2, 4, 16, 8
    gen = torch.Generator().manual_seed(3)
    q_raw = torch.randn(1, T, Hk, dk, generator=gen)
    k_raw = torch.randn(1, T, Hk, dk, generator=gen)
    v = torch.randn(1, T, Hv, dv, generator=gen)
    g = -F.softplus(torch.randn(1, T, Hv, generator=gen))
    beta = torch.sigmoid(torch.randn(1, T, Hv, generator=gen))
    s0 = torch.randn(1, Hv, dk, dv, generator=gen) * 0.1
    o_hf, s_hf = mod.torch_chunk_gated_delta_rule(
        q_raw, k_raw, v, g, beta, initial_state=s0, output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    rep = Hv // Hk
    q = (mod.l2norm(q_raw[0]) * dk**-0.5).repeat_interleave(rep, dim=1)
    k = mod.l2norm(k_raw[0]).repeat_interleave(rep, dim=1)
    for fn in (chunk_gated_delta_rule_ref, recurrent_gated_delta_rule_ref):
        o, s = fn(q, k, v[0], g[0], beta[0], s0[0])
        torch.testing.assert_close(o, o_hf[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, s_hf[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_causal_conv1d_state_continuation(dtype: torch.dtype) -> None:
    C, K, T = 12, 4, 9
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(T, C, generator=gen).to(dtype)
    w = torch.randn(C, K, generator=gen).to(dtype)
    zero = torch.zeros(C, K - 1, dtype=dtype)
    y, st = causal_conv1d_ref(x, w, zero)
    # Against a plain padded conv.
    ref = F.silu(F.conv1d(x.t()[None], w[:, None], padding=K - 1, groups=C)[0, :, :T]).t()
    torch.testing.assert_close(y, ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6,
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    torch.testing.assert_close(st, x[-(K - 1):].t(), rtol=0, atol=0)
    # Split in two pieces (the second a single token) equals one piece, state included.
    y1, s1 = causal_conv1d_ref(x[:5], w, zero)
    y2, s2 = causal_conv1d_ref(x[5:8], w, s1)
    y3, s3 = causal_conv1d_ref(x[8:], w, s2)
    # NOTE: SiLU may round differently in SIMD and tail lanes, hence not bit-exact.
    torch.testing.assert_close(torch.cat([y1, y2, y3]), y, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s3, st, rtol=0, atol=0)
    # A short first piece keeps zeros on the left of the state.
    _, s_short = causal_conv1d_ref(x[:1], w, zero)
    assert torch.equal(s_short[:, :2], zero[:, :2]) and torch.equal(s_short[:, 2], x[0])

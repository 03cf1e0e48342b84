"""Pure-torch references of the Gated DeltaNet mixer for ONE sequence: causal conv1d and the
gated delta rule in chunked and recurrent form. q and k come l2-normalised, q scaled by
dk**-0.5, key heads repeated to the value heads; the state S [dk, dv] is fp32; per token:
S <- S * exp(g); S <- S + k (x) beta * (v - S^T k); o = S^T q. Math in fp32 (fp64 when an
input is fp64); outputs in that dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    if any(t.dtype == torch.float64 for t in tensors):
        return torch.float64
    return torch.float32


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor,
                      state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv (tap K-1 on the newest input) + SiLU of x [T, C] after `state`
    [C, K-1] (the previous inputs, oldest first). Returns (y [T, C] in x.dtype, the last K-1
    inputs [C, K-1] in state.dtype)."""
    T, C = x.shape
    K = weight.shape[1]
    assert weight.shape == (C, K), f"weight {tuple(weight.shape)} != ({C}, {K})"
    assert state.shape == (C, K - 1), f"state {tuple(state.shape)} != ({C}, {K - 1})"
    full = torch.cat([state.to(x.dtype), x.t()], dim=1)  # [C, K-1+T]
    # NOTE: taps accumulate in fp32 one by one (so any split of x gives the same sums);
    # the sum is then cast to the weight (model) dtype and the SiLU runs there, as in HF.
    acc_dtype = _compute_dtype(x, weight)
    acc = torch.zeros(C, T, dtype=acc_dtype, device=x.device)
    for j in range(K):
        acc += weight[:, j:j + 1].to(acc_dtype) * full[:, j:j + T].to(acc_dtype)
    y = F.silu(acc.to(weight.dtype)).t().to(x.dtype)  # [T, C]
    new_state = full[:, full.shape[1] - (K - 1):].to(state.dtype)
    return y.contiguous(), new_state.contiguous()


def recurrent_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                   g: torch.Tensor, beta: torch.Tensor,
                                   state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token gated delta rule: q, k [T, H, dk], v [T, H, dv], g (log decay) and beta
    [T, H], state [H, dk, dv] -> (o [T, H, dv], new state), in the compute dtype."""
    dt = _compute_dtype(q, k, v, g, beta, state)
    q, k, v, g, beta = (t.to(dt) for t in (q, k, v, g, beta))
    S = state.to(dt).clone()  # [H, dk, dv]
    T = q.shape[0]
    o = torch.empty(T, *v.shape[1:], dtype=dt, device=v.device)
    for t in range(T):
        S = S * g[t].exp()[:, None, None]
        kv = (S * k[t].unsqueeze(-1)).sum(dim=-2)  # [H, dv]
        delta = (v[t] - kv) * beta[t].unsqueeze(-1)
        S = S + k[t].unsqueeze(-1) * delta.unsqueeze(-2)
        o[t] = (S * q[t].unsqueeze(-1)).sum(dim=-2)
    return o, S


def chunk_gated_delta_rule_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) gated delta rule, equal to the recurrence up to rounding.

    Same arguments and results as `recurrent_gated_delta_rule_ref`. T is padded to a multiple
    of `chunk_size` with q = k = v = 0, beta = 0, g = 0 (padding changes neither o nor S).
    """
    dt = _compute_dtype(q, k, v, g, beta, state)
    T, H, dk = q.shape
    dv = v.shape[-1]
    BT = chunk_size
    pad = (BT - T % BT) % BT
    # [H, T', D] fp32/fp64, padded along time
    q, k, v = (F.pad(t.to(dt).transpose(0, 1), (0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.to(dt).t(), (0, pad)) for t in (g, beta))
    n = (T + pad) // BT
    q, k, v = (t.reshape(H, n, BT, -1) for t in (q, k, v))
    g, beta = g.reshape(H, n, BT), beta.reshape(H, n, BT)

    cum = g.cumsum(-1)  # [H, n, BT]
    upper = torch.ones(BT, BT, dtype=torch.bool, device=q.device).triu(1)
    # D[i, j] = exp(cum_i - cum_j) for j <= i, else 0 (diagonal kept)
    D = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()
    kb = k * beta.unsqueeze(-1)
    vb = v * beta.unsqueeze(-1)
    # (Id + L) with L = strictly-lower((kb k^T) * D); the solve is unit-lower-triangular
    A = (kb @ k.transpose(-1, -2)) * D
    U = torch.linalg.solve_triangular(A, vb, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * cum.exp().unsqueeze(-1), upper=False,
                                      unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * D  # [H, n, BT, BT]
    q_dec = q * cum.exp().unsqueeze(-1)
    k_dec = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    last = cum[..., -1].exp()  # [H, n]

    S = state.to(dt).clone()  # [H, dk, dv]
    o = torch.empty(H, n, BT, dv, dtype=dt, device=q.device)
    for i in range(n):
        v_new = U[:, i] - W[:, i] @ S  # [H, BT, dv]
        o[:, i] = q_dec[:, i] @ S + attn[:, i] @ v_new
        S = S * last[:, i, None, None] + k_dec[:, i].transpose(-1, -2) @ v_new
    o = o.reshape(H, n * BT, dv)[:, :T].transpose(0, 1).contiguous()  # [T, H, dv]
    return o, S

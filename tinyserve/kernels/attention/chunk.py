"""Causal attention of a chunk of queries (the last n of S positions) over its sequence's K/V.

Without a prefix: causal SDPA. With one, on CUDA, the prefix (non-causal, a KV head's query
heads stacked: GQA without repeating K/V) and the chunk (causal) run apart on cuDNN, merged by
log-sum-exp (`glue.lse_merge`): faster than flash attention's lower-right mask at head_dim 256.
Where cuDNN fails or disagrees with fp32 math (checked once per device, dtype, head_dim), and
on CPU, SDPA runs with `causal_lower_right`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.kernels.iso.ref import attention_oracle
from tinyserve.log import get_logger

log = get_logger(__name__)

# (device, dtype, head_dim) -> whether the cuDNN split path passed its check
_CUDNN_OK: dict[tuple, bool] = {}


def chunk_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [Hq, n, D] at the last n of S positions; k, v [Hkv, S, D] (Hq a multiple of Hkv,
    n <= S). Query i sees keys 0 .. S - n + i. Returns [Hq, n, D] in q's dtype."""
    n, s = q.shape[1], k.shape[1]
    if n > s:
        raise ValueError(f"{n} queries over {s} keys: the chunk must be inside the sequence")
    gqa = q.shape[0] != k.shape[0]
    if n == s or n == 1:  # plain causal, or one query that sees every key
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=n > 1,
                                              scale=scale, enable_gqa=gqa)[0]
    if q.is_cuda and _cudnn_ok(q):
        return _split_cudnn(q, k, v, scale)
    # NOTE: imported here: the module pulls in torch._dynamo (and triton) at import
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q[None], k[None], v[None],
                                          attn_mask=causal_lower_right(n, s), scale=scale,
                                          enable_gqa=gqa)[0]


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN attention of q [H, L, D] over k, v [H, S, D] (top-left causal): (out [H, L, D],
    natural-log LSE fp32 [H, L])."""
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q[None], k[None], v[None], None, True, 0.0, causal, False, scale=scale)[:2]
    return out[0], lse.reshape(q.shape[0], -1)[:, :q.shape[1]].float()


def _split_cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float) -> torch.Tensor:
    hq, n, d = q.shape
    hkv, s = k.shape[:2]
    group, prefix = hq // hkv, s - n
    o_pre, lse_pre = _cudnn(q.reshape(hkv, group * n, d), k[:, :prefix], v[:, :prefix], False,
                            scale)
    k_new, v_new = k[:, prefix:], v[:, prefix:]
    if group > 1:
        k_new, v_new = k_new.repeat_interleave(group, 0), v_new.repeat_interleave(group, 0)
    o_new, lse_new = _cudnn(q, k_new, v_new, True, scale)
    merge = lse_merge_ref
    if q.is_cuda:
        from tinyserve.kernels.glue import lse_merge as merge
    return merge(o_pre.reshape(hq, n, d), lse_pre.reshape(hq, n), o_new, lse_new)


def lse_merge_ref(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
                  lse_b: torch.Tensor) -> torch.Tensor:
    """Attention outputs a, b [H, N, D] over disjoint keys with natural-log LSEs lse_a, lse_b
    fp32 [H, N] -> their merge in a's dtype (fp32 math; `glue.lse_merge` on CUDA)."""
    w = torch.sigmoid(lse_a - lse_b)[..., None]  # a's share
    return torch.lerp(b.float(), a.float(), w).to(a.dtype)


def _cudnn_ok(q: torch.Tensor) -> bool:
    """Whether the cuDNN split path runs and agrees with fp32 math on this device, dtype and
    head_dim (checked once, outside CUDA-graph capture; a failure is logged and the path is
    not used again)."""
    key = (q.device, q.dtype, q.shape[-1])
    if key not in _CUDNN_OK:
        if torch.cuda.is_current_stream_capturing():
            return False
        _CUDNN_OK[key] = _check_cudnn(q.device, q.dtype, q.shape[-1])
    return _CUDNN_OK[key]


def _check_cudnn(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    gen = torch.Generator(device=device).manual_seed(0)
    hq, hkv, n, s = 4, 2, 48, 112
    q = torch.randn(hq, n, head_dim, device=device, generator=gen).to(dtype)
    k = torch.randn(hkv, s, head_dim, device=device, generator=gen).to(dtype)
    v = torch.randn(hkv, s, head_dim, device=device, generator=gen).to(dtype)
    scale = head_dim ** -0.5
    try:
        got = _split_cudnn(q, k, v, scale).float()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        log.info("chunk attention: cuDNN unavailable (%s); using SDPA's lower-right causal mask",
                 str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
        return False
    want = attention_oracle(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), s - n,
                            scale).transpose(0, 1)
    if not torch.allclose(got, want, atol=2e-2, rtol=2e-2):
        log.warning("chunk attention: cuDNN differs from fp32 math (max error %.3g); using "
                    "SDPA's lower-right causal mask", (got - want).abs().max().item())
        return False
    return True

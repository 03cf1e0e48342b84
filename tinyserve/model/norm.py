"""RMSNorms of Qwen3.5-MoE: the zero-centred one (weight enters as 1 + w) and the gated one of
the GDN output (plain weight w, SiLU gate)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`dt(f32(x) * rsqrt(mean(f32(x)^2) + eps) * (1 + f32(w)))` over the last dim.

    Used for the layer norms, the final norm and q_norm / k_norm. The cast back to x.dtype
    happens after the weight multiply.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """GDN output norm per head: `dt((w * dt(norm(x))) * silu(f32(gate)))`.

    Args:
        x, gate: [..., D] in the model dtype; weight: [D] (plain, initialised to ones; kept in
        fp32 or the model dtype, whichever the loader gives).
    """
    dtype = x.dtype
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    h = weight * h
    return (h * F.silu(gate.float())).to(dtype)

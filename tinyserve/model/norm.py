"""RMSNorms of Qwen3.5-MoE: zero-centred (weight enters as 1 + w), fused with the residual
add before it, and the GDN output's gated one (plain w, SiLU gate). `*_ref`: the CPU path and
the Triton kernels' references."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.model.linear import kernels_enabled


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`dt(f32(x) * rsqrt(mean(f32(x)^2) + eps) * (1 + f32(w)))` over the last dim (cast after
    the weight multiply); x [..., D] (unit last stride on CUDA), weight [D]."""
    if kernels_enabled(x.device):
        from tinyserve.kernels import norm as norm_kernels

        return norm_kernels.rms_norm(x, weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual` in x.dtype, then `rms_norm(s, weight, eps)`; returns (normed, s)."""
    if kernels_enabled(x.device):
        from tinyserve.kernels import norm as norm_kernels

        return norm_kernels.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """GDN output norm per head: `dt((w * dt(norm(x))) * silu(f32(gate)))`; x, gate [..., D]
    in the model dtype, weight [D] plain (fp32 or the model dtype)."""
    if kernels_enabled(x.device):
        from tinyserve.kernels import norm as norm_kernels

        return norm_kernels.gated_rms_norm(x, gate, weight, eps)
    return gated_rms_norm_ref(x, gate, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-torch `rms_norm`."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch `add_rms_norm`."""
    s = x + residual
    return rms_norm_ref(s, weight, eps), s


def gated_rms_norm_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Pure-torch `gated_rms_norm`."""
    dtype = x.dtype
    xf = x.float()
    h = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    h = weight * h
    return (h * F.silu(gate.float())).to(dtype)

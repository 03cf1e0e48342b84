"""Partial rotary position embedding (NeoX rotate_half) over the first `rotary_dim` dims of
each head (for text-only input Qwen3.5's interleaved mRoPE equals this 1-D RoPE). `norm_apply`:
q_norm / k_norm then the rotation, one Triton kernel on CUDA, `norm_rope_ref` elsewhere."""

from __future__ import annotations

import torch

from tinyserve.model.linear import kernels_enabled
from tinyserve.model.norm import rms_norm_ref


class PartialRoPE:
    """cos/sin from absolute positions; applies to [N, H, D] tensors in place of HF's rotary."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float,
                 device: torch.device | str = "cpu") -> None:
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, {head_dim}]")
        self.rotary_dim = rotary_dim
        exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim
        self.inv_freq = (1.0 / (theta ** exponent)).to(device)  # [R/2] fp32

    def cos_sin(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """[N] int positions -> (cos, sin) [N, R] in `dtype` (computed in fp32, then cast)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [N, R/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, R]
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate the first R dims of x [N, H, D] (model dtype); the rest pass through."""
        R = self.rotary_dim
        rot, rest = x[..., :R], x[..., R:]
        cos, sin = cos[:, None, :], sin[:, None, :]  # [N, 1, R]
        half = R // 2
        rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
        return torch.cat([rot * cos + rotated * sin, rest], dim=-1)

    def norm_apply(self, x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
        """`apply(rms_norm(x, weight, eps), cos, sin)` for x [N, H, D] (may be a strided view);
        returns a new contiguous [N, H, D]."""
        if kernels_enabled(x.device) and x.stride(-1) == 1:
            from tinyserve.kernels import norm as norm_kernels

            return norm_kernels.rms_norm_rope(x, weight, eps, cos, sin)
        return norm_rope_ref(self, x, weight, eps, cos, sin)


def norm_rope_ref(rope: PartialRoPE, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pure-torch `PartialRoPE.norm_apply`."""
    return rope.apply(rms_norm_ref(x, weight, eps), cos, sin)

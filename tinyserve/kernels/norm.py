"""RMSNorms of Qwen3.5-MoE, one Triton kernel each (one program per row, fp32 math), rounding
to the model dtype where the references of `model/norm.py` and `model/rope.py` do."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.launch import FLOATS, ROUNDING_AS_TORCH


@triton.jit
def _load_row(x_ptr, stride_x, D, BLOCK_D: tl.constexpr):
    """This program's row of x: (row index, columns, column mask, x fp32 [BLOCK_D])."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    return row, cols, m, x


@triton.jit
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, D, stride_x, stride_r, stride_y,
                    stride_s, eps, HAS_RESIDUAL: tl.constexpr, BLOCK_D: tl.constexpr):
    row, cols, m, x = _load_row(x_ptr, stride_x, D, BLOCK_D)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        s = (x + r).to(s_ptr.dtype.element_ty)  # the new residual, in the model dtype
        tl.store(s_ptr + row * stride_s + cols, s, mask=m)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    rstd = tl.rsqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = (x * rstd) * (1.0 + w)
    tl.store(y_ptr + row * stride_y + cols, y.to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def gated_rms_norm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, D, HZ, stride_x, stride_zn, stride_zh,
                          stride_y, eps, ROUND_WH: tl.constexpr, BLOCK_D: tl.constexpr):
    # row = n * HZ + h: z's row at n * stride_zn + h * stride_zh (HZ = 1: plain row stride)
    row, cols, m, x = _load_row(x_ptr, stride_x, D, BLOCK_D)
    z_row = (row // HZ) * stride_zn + (row % HZ) * stride_zh
    z = tl.load(z_ptr + z_row + cols, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(x * x, axis=0) / D
    h = (x * tl.rsqrt(var + eps)).to(y_ptr.dtype.element_ty).to(tl.float32)
    h = w * h
    if ROUND_WH:  # w in the model dtype: torch rounds w * h to it
        h = h.to(y_ptr.dtype.element_ty).to(tl.float32)
    g = z / (1.0 + tl.exp(-z))  # silu in fp32
    tl.store(y_ptr + row * stride_y + cols, (h * g).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def rms_norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, y_ptr, H, D, R, stride_xn, stride_xh,
                         stride_c, eps, BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    dt = y_ptr.dtype.element_ty
    row = x_ptr + n * stride_xn + h * stride_xh
    x = tl.load(row + cols, mask=m, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / D + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    y = ((x * rstd) * (1.0 + w)).to(dt).to(tl.float32)
    # rotate_half partner of each rotary column: j + R/2 for the first half, j - R/2 after
    half = R // 2
    is_rot = cols < R
    partner = tl.where(cols < half, cols + half, cols - half)
    pm = m & is_rot
    xp = tl.load(row + partner, mask=pm, other=0.0).to(tl.float32)
    wp = tl.load(w_ptr + partner, mask=pm, other=0.0).to(tl.float32)
    yp = ((xp * rstd) * (1.0 + wp)).to(dt).to(tl.float32)
    yp = tl.where(cols < half, -yp, yp)
    c = tl.load(cos_ptr + n * stride_c + cols, mask=pm, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + n * stride_c + cols, mask=pm, other=0.0).to(tl.float32)
    rot = (y * c).to(dt).to(tl.float32) + (yp * s).to(dt).to(tl.float32)
    out = tl.where(is_rot, rot, y)
    tl.store(y_ptr + (n * H + h) * D + cols, out.to(dt), mask=m)


def _rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """t [..., D] as [R, D] rows with unit column stride (a view when the strides allow)."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _check(x: torch.Tensor, weight: torch.Tensor, *others: torch.Tensor) -> int:
    d = x.shape[-1]
    if x.dtype not in FLOATS:
        raise TypeError(f"x must be bf16/fp16/fp32, got {x.dtype}")
    if weight.shape != (d,):
        raise ValueError(f"weight {list(weight.shape)} does not match the last dim {d}")
    for t in others:
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"{list(t.shape)} {t.dtype} does not match x {list(x.shape)} "
                             f"{x.dtype}")
    if any(t.device != x.device for t in (weight, *others)):
        raise ValueError("all tensors must be on one device")
    return d


def _launch_cfg(d: int) -> tuple[int, int]:
    block = triton.next_power_of_2(d)
    return block, max(1, min(8, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm over the last dim. x [..., D] (any strides with a unit last
    stride), weight [D] -> [..., D] contiguous in x.dtype."""
    d = _check(x, weight)
    x2 = _rows(x, d)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, d)
    if x2.shape[0]:
        block, warps = _launch_cfg(d)
        rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, y2, y2, d, x2.stride(0), 0,
                                        y2.stride(0), 0, eps, HAS_RESIDUAL=False,
                                        BLOCK_D=block, num_warps=warps, **ROUNDING_AS_TORCH)
    return y


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """s = x + residual (rounded to x.dtype), then `rms_norm(s)`, in one pass; returns
    (normed, s), both new contiguous tensors in x.dtype."""
    d = _check(x, weight, residual)
    x2, r2 = _rows(x, d), _rows(residual, d)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2, s2 = y.view(-1, d), s.view(-1, d)
    if x2.shape[0]:
        block, warps = _launch_cfg(d)
        rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, y2, s2, d, x2.stride(0), r2.stride(0),
                                        y2.stride(0), s2.stride(0), eps, HAS_RESIDUAL=True,
                                        BLOCK_D=block, num_warps=warps, **ROUNDING_AS_TORCH)
    return y, s


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """GDN output norm per head: x, gate [..., D] in the model dtype, weight [D] (fp32 or the
    model dtype) -> [..., D] contiguous in x.dtype. A gate [N, H, D] with a unit last stride
    is read in place whatever its other strides (e.g. the z columns of fused qkv | z rows)."""
    d = _check(x, weight, gate)
    x2 = _rows(x, d)
    if gate.dim() == 3 and gate.stride(-1) == 1:
        z2, hz, stride_zn, stride_zh = gate, gate.shape[1], gate.stride(0), gate.stride(1)
    else:
        z2 = _rows(gate, d)
        hz, stride_zn, stride_zh = 1, z2.stride(0), 0
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    y2 = y.view(-1, d)
    round_wh = torch.promote_types(weight.dtype, x.dtype) != torch.float32
    if x2.shape[0]:
        block, warps = _launch_cfg(d)
        gated_rms_norm_kernel[(x2.shape[0],)](x2, z2, weight, y2, d, hz, x2.stride(0),
                                              stride_zn, stride_zh, y2.stride(0), eps,
                                              ROUND_WH=round_wh, BLOCK_D=block,
                                              num_warps=warps, **ROUNDING_AS_TORCH)
    return y


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """Per-head zero-centred RMSNorm, then RoPE (rotate_half) over the first R dims: x
    [N, H, D] (unit last stride), cos / sin [N, R] in x.dtype (R even, <= D) -> [N, H, D]."""
    d = _check(x, weight)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"x must be [N, H, D] with unit last stride, got {list(x.shape)}")
    n, h, _ = x.shape
    r = cos.shape[-1]
    if (cos.shape != (n, r) or sin.shape != cos.shape or r % 2 or r > d
            or cos.stride() != sin.stride() or cos.stride(-1) != 1):
        raise ValueError(f"cos/sin {list(cos.shape)} {list(sin.shape)} do not fit x "
                         f"{list(x.shape)}")
    if cos.dtype != x.dtype or sin.dtype != x.dtype:
        raise TypeError(f"cos/sin must be in {x.dtype}")
    if cos.device != x.device or sin.device != x.device:
        raise ValueError(f"cos/sin must be on {x.device}")
    y = torch.empty(n, h, d, dtype=x.dtype, device=x.device)
    if y.numel():
        block, warps = _launch_cfg(d)
        rms_norm_rope_kernel[(n, h)](x, weight, cos, sin, y, h, d, r, x.stride(0), x.stride(1),
                                     cos.stride(0), eps, BLOCK_D=block, num_warps=warps,
                                     **ROUNDING_AS_TORCH)
    return y

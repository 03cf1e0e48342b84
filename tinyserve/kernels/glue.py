"""Elementwise glue of the decoder layer in Triton, rounding where torch rounds (dt(...)):
`silu_mul` = dt(dt(silu(gate)) * up); `gated_add` = dt(routed + dt(dt(sigmoid(g)) * shared));
`sigmoid_mul` = dt(x * dt(sigmoid(gate))); `lse_merge`: two attentions over disjoint keys
merged by their log-sum-exp in fp32. References: `model.moe`, `model.attention`,
`attention.chunk.lse_merge_ref`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tinyserve.kernels.launch import ROUNDING_AS_TORCH

BLOCK = 1024  # elements of one row per program


@triton.jit
def silu_mul_kernel(g_ptr, u_ptr, y_ptr, F, stride_g, stride_u, stride_y,
                    BLOCK_F: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    m = cols < F
    g = tl.load(g_ptr + row * stride_g + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=m, other=0.0).to(tl.float32)
    a = (g / (1.0 + tl.exp(-g))).to(y_ptr.dtype.element_ty).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (a * u).to(y_ptr.dtype.element_ty), mask=m)


@triton.jit
def gated_add_kernel(r_ptr, s_ptr, g_ptr, y_ptr, H, stride_r, stride_s, stride_g, stride_y,
                     BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    m = cols < H
    dt = y_ptr.dtype.element_ty
    logit = tl.load(g_ptr + row * stride_g).to(tl.float32)
    gate = (1.0 / (1.0 + tl.exp(-logit))).to(dt).to(tl.float32)
    s = tl.load(s_ptr + row * stride_s + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    sh = (gate * s).to(dt).to(tl.float32)
    tl.store(y_ptr + row * stride_y + cols, (r + sh).to(dt), mask=m)


@triton.jit
def sigmoid_mul_kernel(x_ptr, g_ptr, y_ptr, H, D, stride_xn, stride_xh, stride_gn, stride_gh,
                       BLOCK_D: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    cols = tl.arange(0, BLOCK_D)
    m = cols < D
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + n * stride_xn + h * stride_xh + cols, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + n * stride_gn + h * stride_gh + cols, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(y_ptr + (n * H + h) * D + cols, (x * s).to(dt), mask=m)


@triton.jit
def lse_merge_kernel(a_ptr, la_ptr, b_ptr, lb_ptr, y_ptr, N, D, stride_ah, stride_an,
                     stride_bh, stride_bn, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # h * N + n
    h = row // N
    n = row - h * N
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = cols < D
    la = tl.load(la_ptr + row)
    lb = tl.load(lb_ptr + row)
    top = tl.maximum(la, lb)
    wa = tl.exp(la - top)
    wb = tl.exp(lb - top)
    a = tl.load(a_ptr + h * stride_ah + n * stride_an + cols, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + h * stride_bh + n * stride_bn + cols, mask=m, other=0.0).to(tl.float32)
    y = (a * wa + b * wb) / (wa + wb)
    tl.store(y_ptr + row * D + cols, y.to(y_ptr.dtype.element_ty), mask=m)


def _check_rows(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dim() != 2 or t.stride(-1) != 1:
            raise ValueError(f"expected [N, C] with unit column stride, got {list(t.shape)} "
                             f"strides {t.stride()}")
        if t.device != ts[0].device or t.shape[0] != ts[0].shape[0]:
            raise ValueError("tensors must share the device and the number of rows")


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [N, F] in the model dtype (unit column stride, any row stride) -> [N, F]."""
    _check_rows(gate, up)
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {list(gate.shape)} {gate.dtype} != up {list(up.shape)} "
                         f"{up.dtype}")
    n, f = gate.shape
    y = torch.empty(n, f, dtype=gate.dtype, device=gate.device)
    if n and f:
        block = min(BLOCK, triton.next_power_of_2(f))
        silu_mul_kernel[(n, triton.cdiv(f, block))](
            gate, up, y, f, gate.stride(0), up.stride(0), y.stride(0), BLOCK_F=block,
            num_warps=max(1, min(4, block // 256)), **ROUNDING_AS_TORCH)
    return y


def gated_add(routed: torch.Tensor, gate_logit: torch.Tensor,
              shared: torch.Tensor) -> torch.Tensor:
    """routed, shared [N, H] in the model dtype; gate_logit [N, 1] (any row stride, e.g. the
    last column of a wider projection) -> routed + sigmoid(gate_logit) * shared, [N, H]."""
    _check_rows(routed, gate_logit, shared)
    if (routed.shape != shared.shape or gate_logit.shape[1] != 1
            or shared.dtype != routed.dtype or not gate_logit.is_floating_point()):
        raise ValueError(f"routed {list(routed.shape)} {routed.dtype}, shared "
                         f"{list(shared.shape)} {shared.dtype} (one dtype), gate_logit "
                         f"{list(gate_logit.shape)} {gate_logit.dtype} (float [N, 1])")
    n, h = routed.shape
    y = torch.empty(n, h, dtype=routed.dtype, device=routed.device)
    if n and h:
        block = min(BLOCK, triton.next_power_of_2(h))
        gated_add_kernel[(n, triton.cdiv(h, block))](
            routed, shared, gate_logit, y, h, routed.stride(0), shared.stride(0),
            gate_logit.stride(0), y.stride(0), BLOCK_H=block,
            num_warps=max(1, min(4, block // 256)), **ROUNDING_AS_TORCH)
    return y


def sigmoid_mul(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """x, gate [N, H, D] in the model dtype (unit last stride, any other strides) ->
    x * sigmoid(gate) as [N, H * D] contiguous."""
    if x.dim() != 3 or x.shape != gate.shape or x.dtype != gate.dtype:
        raise ValueError(f"x {list(x.shape)} {x.dtype} and gate {list(gate.shape)} "
                         f"{gate.dtype} must be [N, H, D] alike")
    if x.stride(-1) != 1 or gate.stride(-1) != 1 or x.device != gate.device:
        raise ValueError("x and gate need a unit last stride and one device")
    n, h, d = x.shape
    y = torch.empty(n, h * d, dtype=x.dtype, device=x.device)
    if y.numel():
        block = triton.next_power_of_2(d)
        sigmoid_mul_kernel[(n, h)](x, gate, y, h, d, x.stride(0), x.stride(1), gate.stride(0),
                                   gate.stride(1), BLOCK_D=block,
                                   num_warps=max(1, min(4, block // 256)), **ROUNDING_AS_TORCH)
    return y


def lse_merge(a: torch.Tensor, lse_a: torch.Tensor, b: torch.Tensor,
              lse_b: torch.Tensor) -> torch.Tensor:
    """a, b [H, N, D] (unit last stride, any other strides): attention outputs over disjoint
    key sets with natural-log LSEs lse_a, lse_b fp32 [H, N] -> their merge (a * e^lse_a +
    b * e^lse_b) / (e^lse_a + e^lse_b) in a's dtype, [H, N, D] contiguous."""
    if a.dim() != 3 or a.shape != b.shape or a.dtype != b.dtype:
        raise ValueError(f"a {list(a.shape)} {a.dtype} and b {list(b.shape)} {b.dtype} must "
                         f"be [H, N, D] alike")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("a and b need a unit last stride")
    h, n, d = a.shape
    if any(t.shape != (h, n) or t.dtype != torch.float32 for t in (lse_a, lse_b)):
        raise ValueError(f"lse_a, lse_b must be fp32 [{h}, {n}], got {lse_a.dtype} "
                         f"{list(lse_a.shape)}, {lse_b.dtype} {list(lse_b.shape)}")
    y = torch.empty(h, n, d, dtype=a.dtype, device=a.device)
    if y.numel():
        block = min(BLOCK, triton.next_power_of_2(d))
        lse_merge_kernel[(h * n, triton.cdiv(d, block))](
            a, lse_a.contiguous(), b, lse_b.contiguous(), y, n, d, a.stride(0), a.stride(1),
            b.stride(0), b.stride(1), BLOCK_D=block, num_warps=max(1, min(4, block // 256)))
    return y

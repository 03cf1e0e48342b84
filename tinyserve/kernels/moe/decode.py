"""Launcher of the Triton fused NVFP4 MoE decode (`decode_triton.py`): the "fused" path of
`fused.py` where the CUDA kernels of `nvfp4.cuda.moe_decode` do not apply (fp32 x, other
(H, F), more pairs per token). Two launches (the second a dependent launch on sm_90+), no
atomics, no workspace to keep zero: the same bits on every run."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from tinyserve.kernels.launch import dependent_launch, next_pow2

if TYPE_CHECKING:
    from tinyserve.kernels.moe.fused import ExpertSlots

# Tiles. gate_up: BLOCK_F features of one expert per program (its BLOCK_F gate and BLOCK_F up
# rows in one tile), BLOCK_B blocks of 16 inputs per K step (>= H/16: one step, every load of
# a program in flight at once), GATE_UP_WARPS warps, the "h2" decode (`nvfp4/triton.py`). down:
# BLOCK_H output rows per program (all pairs of a token, full rows of F/2 code bytes),
# DOWN_WARPS warps. The Triton interpreter (no GPU) runs one Python step per program: there
# gate_up takes INTERPRETER_BLOCK_F features per program.
BLOCK_F, BLOCK_B, GATE_UP_WARPS = 4, 128, 4
BLOCK_H, DOWN_WARPS = 8, 4
INTERPRETER_BLOCK_F = 16


@functools.cache
def _kernels():
    from tinyserve.kernels.moe import decode_triton as fused_moe_decode_triton

    return fused_moe_decode_triton


def moe_fused_decode(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
                     slots: ExpertSlots, shared: ExpertSlots | None,
                     logit: torch.Tensor | None) -> torch.Tensor:
    """sum_j wts[t, j] * expert_{ids[t, j]}(x_t) (+ sigmoid(logit[t]) * shared(x_t)) in
    x.dtype: x [N, H] contiguous, ids / wts flat [N * topk], slots checked by `fused_moe`."""
    n, h, f = x.shape[0], slots.hidden_size, slots.intermediate_size
    block_f = min(BLOCK_F if x.is_cuda else INTERPRETER_BLOCK_F, next_pow2(f))
    while f % block_f:  # NOTE: F is a multiple of 16 (slot layout)
        block_f //= 2
    sh = shared if shared is not None else slots
    assert slots.w13_scale is not None and sh.w13_scale is not None
    assert slots.w2_scale is not None and sh.w2_scale is not None
    kp = topk + (shared is not None)
    kern = _kernels()
    use_asm = x.device.type == "cuda"  # NOTE: the interpreter runs the h2 emulation
    pdl = dependent_launch(x.device)
    # [N * KP, F] fp32, block-transposed rows; every element written by launch 1
    inter = torch.empty(n * kp, f, dtype=torch.float32, device=x.device)
    kern.moe_fused_gate_up_kernel[(n * kp, f // block_f)](
        x, ids, slots.w13.view(torch.int64), slots.w13_scale, slots.w13_global,
        sh.w13.view(torch.int64), sh.w13_scale, sh.w13_global, inter, x.stride(0),
        H=h, F=f, TOPK=topk, HAS_SHARED=shared is not None, BLOCK_F=block_f,
        BLOCK_B=min(BLOCK_B, next_pow2(h // 16)), USE_ASM=use_asm, TRIGGER=pdl,
        num_warps=GATE_UP_WARPS)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h = min(BLOCK_H, next_pow2(h))
    kern.moe_fused_down_kernel[(n, -(-h // block_h))](
        inter, ids, wts, logit if logit is not None else wts,
        slots.w2.view(torch.int64), slots.w2_scale, slots.w2_global,
        sh.w2.view(torch.int64), sh.w2_scale, sh.w2_global, out,
        logit.stride(0) if logit is not None else 0,
        H=h, F=f, TOPK=topk, KPAD=next_pow2(topk), FBP=next_pow2(f // 16),
        HAS_SHARED=shared is not None, BLOCK_H=block_h, PDL=pdl, num_warps=DOWN_WARPS,
        **({"launch_pdl": True} if pdl else {}))
    return out

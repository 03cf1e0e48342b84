"""The one-launch fused NVFP4 MoE decode ("fused1" path of `kernels/fused_moe.py`): tiles,
the counter workspace and the launcher of `fused_moe_decode1_triton.py`.

The two-launch decode's gate_up and down programs in one grid; a down program requests its
weight rows at once and waits at a per-token arrival counter for the gate_up programs of its
token, so its loads overlap gate_up instead of waiting for a launch boundary. Same contract
and same bits as the two-launch path with `down_warps = num_warps` (the one launch has one
warp count). Off by default: `fused_moe_decode.MOE_FUSED_PATH = "fused1"` makes it the path
`fused_moe` picks by itself.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from tinyserve.kernels.fused_moe_decode import MOE_FUSED_MAX_TOKENS, MoEFusedConfig

if TYPE_CHECKING:
    from tinyserve.kernels.fused_moe import ExpertSlots

# NOTE: True: the down programs poll with `ld.acquire.gpu` (inline PTX, every thread); False:
# one thread's atomic_add(0, sem="acquire") per poll (the fallback if the PTX fails to build)
MOE_FUSED1_SPIN_ASM = True
MOE_FUSED1_MAX_SPIN = 1 << 20  # polls before a down program gives up (~1 s): no hang

# (H, F) -> tiles of the one-launch decode (`down_warps` unused: every program has
# `num_warps`); other shapes get MoEFusedConfig(). Until the H200 says otherwise: the
# two-launch table's tiles with 4-warp down programs (1152 + 1024 programs at 1 token).
MOE_FUSED1_TILES: dict[tuple[int, int], MoEFusedConfig] = {
    (2048, 512): MoEFusedConfig(4, 128, 4, 2, 4, "h2"),
}

_C = MoEFusedConfig
# Timed beside the table's entry by `bench/nvfp4.py --only moe` (35B-A3B shapes)
MOE_FUSED1_CANDIDATES: tuple[MoEFusedConfig, ...] = (
    _C(4, 128, 4, 4, 4, "h2"),  # 1152 + 512 programs
    _C(8, 128, 4, 4, 4, "h2"),  # 576 + 512: closer to one resident wave
    _C(8, 128, 4, 8, 4, "h2"),  # 576 + 256
    _C(4, 128, 2, 2, 2, "h2"),  # 2 warps everywhere: 1152 + 1024 small programs
    _C(16, 128, 8, 16, 8, "h2"),  # 288 + 128 programs of 8 warps
)


def default_moe_fused1_config(hidden_size: int, intermediate_size: int) -> MoEFusedConfig:
    """The `MOE_FUSED1_TILES` entry, else `MoEFusedConfig()`."""
    return MOE_FUSED1_TILES.get((hidden_size, intermediate_size), MoEFusedConfig())


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def fused1_counters(device: torch.device) -> torch.Tensor:
    """The device's counter workspace, int32 [2, MOE_FUSED_MAX_TOKENS] (arrive, done), zero
    between launches (the kernel's last down program of each token resets its pair). Made
    (zeroed) on first use; raises RuntimeError when that first use is inside a CUDA-graph
    capture (the zero fill would only run at replay): launch once eagerly before capturing."""
    ws = _COUNTERS.get(device)
    if ws is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the fused1 MoE counters must exist before a CUDA-graph "
                               "capture: run the layer once eagerly first")
        ws = torch.zeros(2, MOE_FUSED_MAX_TOKENS, dtype=torch.int32, device=device)
        _COUNTERS[device] = ws
    return ws


@functools.cache
def _kernels():
    from tinyserve.kernels import fused_moe_decode1_triton

    return fused_moe_decode1_triton


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def moe_fused1_decode(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
                      slots: ExpertSlots, shared: ExpertSlots | None,
                      logit: torch.Tensor | None, cfg: MoEFusedConfig) -> torch.Tensor:
    """sum_j wts[t, j] * expert_{ids[t, j]}(x_t) (+ sigmoid(logit[t]) * shared(x_t)), in one
    launch.

    x [N, H] contiguous (N <= MOE_FUSED_MAX_TOKENS), ids / wts flat [N * topk], NVFP4 `slots`
    and `shared` (slot 0, same H and F) checked by `fused_moe`; logit [N, 1] (any row
    stride) with `shared`. Returns [N, H] in x.dtype. No host synchronisation,
    deterministic; the device's `fused1_counters` must not be in use by another stream.
    """
    n, h, f = x.shape[0], slots.hidden_size, slots.intermediate_size
    if n > MOE_FUSED_MAX_TOKENS:
        raise ValueError(f"fused1 takes at most {MOE_FUSED_MAX_TOKENS} tokens, got {n}")
    block_f = min(cfg.block_f, _next_pow2(f))
    while f % block_f:  # NOTE: F is a multiple of 16 (slot layout)
        block_f //= 2
    sh = shared if shared is not None else slots
    assert slots.w13_scale is not None and sh.w13_scale is not None
    assert slots.w2_scale is not None and sh.w2_scale is not None
    kp = topk + (shared is not None)
    block_h = min(cfg.block_h, _next_pow2(h))
    counters = fused1_counters(x.device)
    cuda = x.device.type == "cuda"  # NOTE: the interpreter runs the h2 emulation
    # [N * KP, F] fp32, block-transposed rows; every element written by a gate_up program
    inter = torch.empty(n * kp, f, dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    grid = (n * kp * (f // block_f) + n * -(-h // block_h),)
    _kernels().moe_fused1_kernel[grid](
        x, ids, wts, logit if logit is not None else wts,
        slots.w13.view(torch.int64), slots.w13_scale, slots.w13_global,
        sh.w13.view(torch.int64), sh.w13_scale, sh.w13_global,
        slots.w2.view(torch.int64), slots.w2_scale, slots.w2_global,
        sh.w2.view(torch.int64), sh.w2_scale, sh.w2_global, inter, out,
        counters[0], counters[1], x.stride(0),
        logit.stride(0) if logit is not None else 0, n,
        H=h, F=f, TOPK=topk, KPAD=_next_pow2(topk), FBP=_next_pow2(f // 16),
        HAS_SHARED=shared is not None, BLOCK_F=block_f,
        BLOCK_B=min(cfg.block_b, _next_pow2(h // 16)), BLOCK_H=block_h,
        IS_H2=cfg.decode == "h2", USE_ASM=cuda, SPIN_ASM=cuda and MOE_FUSED1_SPIN_ASM,
        MAX_SPIN=MOE_FUSED1_MAX_SPIN, num_warps=cfg.num_warps)
    return out

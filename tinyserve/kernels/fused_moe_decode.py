"""The fused NVFP4 MoE decode ("fused" path of `kernels/fused_moe.py`): the switch, tiles,
their table and candidates, and the launcher of `fused_moe_decode_triton.py`.

Every (token, expert) pair of a layer, the shared expert included as one more pair: launch
1 computes silu(gate) * up per (pair, feature chunk) into a small fp32 intermediate
[N * KP, F]; launch 2 computes blocks of output rows of each token, reading the full down
rows of all its pairs and summing them in registers in a fixed order (on sm_90+ launch 2 is a
programmatic dependent of launch 1: `MoEFusedConfig.down_pdl`). No atomics and no
workspace that must be kept zero: the same bits on every run (graph replay == eager).
`MOE_FUSED_DECODE = False` switches the path off (fused_moe then takes the gemv path and the
model its separate shared-expert GEMVs).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tinyserve.kernels.launch import dependent_launch

if TYPE_CHECKING:
    from tinyserve.kernels.fused_moe import ExpertSlots

# NOTE: the switch of the fused decode; False = the gemv path (two launches + a sum, the
# shared expert through the model's separate gemvs). Both sum in a fixed order, so graph and
# eager decode give the same bits (bench/graph_vs_eager.py checks it on the full-size model).
MOE_FUSED_DECODE = True
MOE_FUSED_MAX_TOKENS = 8  # the most tokens `fused_moe` takes in the fused path
# fused_moe takes the fused path by itself up to this many tokens (it is faster than the gemv
# path at 1, 4 and 8 tokens: docs/RESULTS.md, "NVFP4 decode")
MOE_FUSED_AUTO_TOKENS = 8


@dataclass(frozen=True)
class MoEFusedConfig:
    """Tiles of the fused decode. gate_up: `block_f` features of one expert per program (its
    `block_f` gate and `block_f` up rows in one tile), `block_b` blocks of 16 inputs per K
    step (>= H/16: one step, every load of a program in flight at once), `num_warps`, the
    `decode` ("h2" / "f32", as in `nvfp4_tiles`). down: `block_h` output rows per program (all
    pairs of a token, full rows of F/2 code bytes), `down_warps`. All powers of two.
    `down_pdl`: on sm_90+ the down kernel is a programmatic dependent launch of gate_up (which
    lets it launch as soon as all of its own programs have started): down programs become
    resident while gate_up drains, request their weight rows, and only then wait for gate_up's
    writes before they read h (elsewhere an ordinary launch)."""

    block_f: int = 4
    block_b: int = 128
    num_warps: int = 4
    block_h: int = 8
    down_warps: int = 4
    decode: str = "h2"
    down_pdl: bool = True

    def __post_init__(self) -> None:
        sizes = (self.block_f, self.block_b, self.num_warps, self.block_h, self.down_warps)
        if self.decode not in ("f32", "h2"):
            raise ValueError(f"unknown NVFP4 decode {self.decode!r}")
        if any(v < 1 or v & (v - 1) for v in sizes):
            raise ValueError(f"fused MoE tiles must be powers of two, got {sizes}")


# (H, F) -> tiles of the fused decode (bench/nvfp4.py `--only moe` prints the best entry);
# other shapes get MoEFusedConfig().
MOE_FUSED_TILES: dict[tuple[int, int], MoEFusedConfig] = {
    # 35B-A3B: 8-feature gate_up chunks (a token's 9 pairs, shared expert included, in one
    # wave), 4 down rows of 4 warps, down a dependent launch: the best of the sweep at 1, 4
    # and 8 tokens (docs/RESULTS.md)
    (2048, 512): MoEFusedConfig(8, 128, 4, 4, 4, "h2"),
}


# Tiles the sweep (`bench/nvfp4.py --only moe`) times beside the table's at 35B-A3B
# shapes (the first `FUSED_MULTI` of the bench also at 4 and 8 tokens, and routed only at 1);
# `tests/kernels/test_fused_moe_decode.py` builds each for sm_90 (no spills). With the down
# kernel a dependent launch, gate_up and down programs share the GPU, so both tiles count.
_C = MoEFusedConfig
MOE_FUSED_CANDIDATES: tuple[MoEFusedConfig, ...] = (
    _C(4, 128, 4, 2, 2, "h2", down_pdl=False),  # the earlier table entry, ordinary launches
    _C(8, 128, 4, 4, 4, "h2", down_pdl=False),  # the table's tiles, ordinary launches
    _C(4, 128, 4, 2, 2, "h2"),  # 1152 gate_up programs at 1 token + shared: two waves
    _C(8, 128, 4, 2, 2, "h2"),  # 576: one wave
    _C(8, 128, 2, 2, 2, "h2"),
    _C(8, 128, 8, 2, 2, "h2"),
    _C(16, 128, 8, 2, 2, "h2"),
    _C(8, 128, 4, 4, 2, "h2"),
    _C(8, 128, 4, 8, 4, "h2"),
    _C(4, 128, 4, 4, 4, "h2"),
    _C(4, 128, 2, 2, 2, "h2"),  # 1152 gate_up programs of 2 warps
    _C(4, 128, 4, 8, 4, "h2"),  # the earlier down tiles (256 programs of 4 warps)
    _C(4, 128, 4, 8, 4, "f32"),  # no x pass before the weights
    _C(8, 128, 4, 2, 2, "f32"),
    _C(4, 64, 4, 2, 2, "h2"),  # 2 gate_up K steps, the second's loads in flight
)


def default_moe_fused_config(hidden_size: int, intermediate_size: int) -> MoEFusedConfig:
    """The `MOE_FUSED_TILES` entry, else `MoEFusedConfig()`."""
    return MOE_FUSED_TILES.get((hidden_size, intermediate_size), MoEFusedConfig())


def fuses_shared_expert(num_tokens: int) -> bool:
    """Whether `fused_moe` runs `num_tokens` tokens (NVFP4 slots) in the fused path, which
    takes a shared expert in its launches (the model then hands it over)."""
    return MOE_FUSED_DECODE and 0 < num_tokens <= MOE_FUSED_AUTO_TOKENS


@functools.cache
def _kernels():
    from tinyserve.kernels import fused_moe_decode_triton

    return fused_moe_decode_triton


def _next_pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


def moe_fused_decode(x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor, topk: int,
                     slots: ExpertSlots, shared: ExpertSlots | None,
                     logit: torch.Tensor | None, cfg: MoEFusedConfig) -> torch.Tensor:
    """sum_j wts[t, j] * expert_{ids[t, j]}(x_t) (+ sigmoid(logit[t]) * shared(x_t)).

    x [N, H] contiguous, ids / wts flat [N * topk], NVFP4 `slots` and `shared` (slot 0, same
    H and F) checked by `fused_moe`; logit [N, 1] (any row stride) with `shared`. Returns
    [N, H] in x.dtype. Two launches, no host synchronisation, deterministic.
    """
    n, h, f = x.shape[0], slots.hidden_size, slots.intermediate_size
    block_f = min(cfg.block_f, _next_pow2(f))
    while f % block_f:  # NOTE: F is a multiple of 16 (slot layout)
        block_f //= 2
    sh = shared if shared is not None else slots
    assert slots.w13_scale is not None and sh.w13_scale is not None
    assert slots.w2_scale is not None and sh.w2_scale is not None
    kp = topk + (shared is not None)
    kern = _kernels()
    use_asm = x.device.type == "cuda"  # NOTE: the interpreter runs the h2 emulation
    pdl = cfg.down_pdl and dependent_launch(x.device)
    # [N * KP, F] fp32, block-transposed rows; every element written by launch 1
    inter = torch.empty(n * kp, f, dtype=torch.float32, device=x.device)
    kern.moe_fused_gate_up_kernel[(n * kp, f // block_f)](
        x, ids, slots.w13.view(torch.int64), slots.w13_scale, slots.w13_global,
        sh.w13.view(torch.int64), sh.w13_scale, sh.w13_global, inter, x.stride(0),
        H=h, F=f, TOPK=topk, HAS_SHARED=shared is not None, BLOCK_F=block_f,
        BLOCK_B=min(cfg.block_b, _next_pow2(h // 16)), IS_H2=cfg.decode == "h2",
        USE_ASM=use_asm, TRIGGER=pdl, num_warps=cfg.num_warps)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_h = min(cfg.block_h, _next_pow2(h))
    kern.moe_fused_down_kernel[(n, -(-h // block_h))](
        inter, ids, wts, logit if logit is not None else wts,
        slots.w2.view(torch.int64), slots.w2_scale, slots.w2_global,
        sh.w2.view(torch.int64), sh.w2_scale, sh.w2_global, out,
        logit.stride(0) if logit is not None else 0,
        H=h, F=f, TOPK=topk, KPAD=_next_pow2(topk), FBP=_next_pow2(f // 16),
        HAS_SHARED=shared is not None, BLOCK_H=block_h, PDL=pdl, num_warps=cfg.down_warps,
        **({"launch_pdl": True} if pdl else {}))
    return out

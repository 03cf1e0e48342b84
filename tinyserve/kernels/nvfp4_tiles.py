"""Tile tables of the NVFP4 decode kernels (gemv and fused-MoE gemv), one entry per shape.

Plain data: the kernels take their tiles from here, so the winners of a `bench/nvfp4.py`
sweep go into `GEMV_TILES` / `MOE_GEMV_TILES` without touching kernel code. Shapes missing
from a table get the rule-based default (`default_gemv_config`, `default_moe_gemv_config`).

Decode variants (`decode`): "f32" builds fp32 E2M1 values from bf16 bit patterns and sums in
fp32 (6 integer ops per 2 weights + 2 FMAs); "h2" builds fp16x2 pairs of E2M1 values and
multiplies them against x (scaled by a power of two per program so that max|x| is in
[2^13, 2^14)) with packed half2 FMAs, summed in fp16 over a block of 16 inputs, then in fp32
(M = 1 and bf16/fp16 x only in `nvfp4_linear`; the fused-MoE kernels also round fp32 x and
their fp32 intermediate to fp16; inline PTX on a GPU, an fp32 emulation of the same packed
words elsewhere, which rounds x to fp16 but not the products or the block sums).
"""

from __future__ import annotations

from dataclasses import dataclass

DECODES = ("f32", "h2")


@dataclass(frozen=True)
class GemvConfig:
    """Tiles of the gemv path: `block_n` weight rows per program, `block_b` blocks of 16
    inputs (one int64 word of codes + one scale byte each) per K step, `num_warps`. K is split
    across programs (powers of two, at least one step per split) only while there are fewer
    than `programs_per_sm` programs per SM. `prefetch`: two K steps in flight per program.
    `vec`: contiguous code words per thread and row (2 = 16-byte loads). `num_stages`: Triton's
    software pipelining of the K loop. `decode`: "f32" or "h2" (module docstring).

    `persistent` > 0: the persistent gemv (`nvfp4_persist_triton`, "h2" only, M = 1..4,
    bf16/fp16 x) with that many programs per SM (at most as many as fit) looping over row
    tiles of `block_n` rows (at most 32 / M); `block_b` is raised to cover K (one K step per
    tile), `prefetch` loads the next row tile into registers before this one is decoded,
    `num_stages` > 1 lets Triton stage the loads through shared memory, `hoist_x`: x's fp16x2
    words are built once per program and kept in registers (else once per tile).
    `programs_per_sm` (split-K) does not apply. fp32 x and M > 4 take the one-tile-per-program
    kernel with the f32 decode and the same tiles."""

    block_n: int = 8
    block_b: int = 128
    num_warps: int = 4
    programs_per_sm: int = 0
    prefetch: bool = False  # load the next K step before decoding this one
    vec: int = 2
    num_stages: int = 3  # Triton's default
    decode: str = "f32"
    persistent: int = 0  # programs per SM of the persistent gemv; 0 = one program per tile
    hoist_x: bool = True  # persistent: x words built once per program

    def __post_init__(self) -> None:
        _check_tiles(self.decode, self.block_n, self.block_b, self.vec)
        if self.persistent < 0 or (self.persistent and self.decode != "h2"):
            raise ValueError(f"persistent={self.persistent} needs decode 'h2' and >= 0")


@dataclass(frozen=True)
class MoEGemvConfig:
    """Tiles of the fused-MoE gemv path: weight rows per program and blocks of 16 inputs per K
    step, for gate_up (K = H) and down (K = F), and warps per program (down_num_warps 0: the
    same as num_warps). `decode` as for GemvConfig (both kernels). `down_expert_split`: the
    down kernel's k experts in that many groups of programs (fp32 partial sums, then one sum
    kernel; 1 = every program sums all k, one launch less).

    NOTE: a K step covering all of H (gate_up) or F (down) leaves no loop, so every load of a
    program is in flight at once (decode is latency bound).
    """

    gate_up_block_n: int = 4
    gate_up_block_b: int = 128
    down_block_n: int = 8
    down_block_b: int = 32
    num_warps: int = 4
    prefetch: bool = False  # load the next K step before decoding this one
    down_num_warps: int = 2
    decode: str = "f32"
    down_expert_split: int = 1

    def __post_init__(self) -> None:
        _check_tiles(self.decode, self.gate_up_block_n, self.gate_up_block_b,
                     self.down_block_n, self.down_block_b, self.down_expert_split)


def _check_tiles(decode: str, *sizes: int) -> None:
    # NOTE: an unknown decode name would silently run "f32"; Triton needs power-of-two tiles
    if decode not in DECODES:
        raise ValueError(f"unknown NVFP4 decode {decode!r}; choose from {DECODES}")
    if any(v < 1 or v & (v - 1) for v in sizes):
        raise ValueError(f"NVFP4 tile sizes must be powers of two, got {sizes}")


# (N, K) -> Triton tiles for M = 1, the winners of the `bench/nvfp4.py` sweeps (measured on an
# H200; docs/RESULTS.md, "NVFP4 decode in Triton"). A row of bf16/fp16 x on a GPU with K in
# 1024 / 2048 / 4096 takes the CUDA kernel instead (`nvfp4_cuda`; these tiles then serve fp32 x
# and TINYSERVE_NVFP4_CUDA=0).
GEMV_TILES: dict[tuple[int, int], GemvConfig] = {
    (248320, 2048): GemvConfig(8, 128, 4, 0, vec=4, num_stages=3, decode="h2",
                               persistent=6),  # lm_head: the persistent gemv
    (8192, 2048): GemvConfig(16, 128, 4, 0, vec=4, num_stages=3, decode="f32"),  # qkvz
    (2048, 512): GemvConfig(16, 32, 2, 0, vec=2, num_stages=3, decode="f32"),  # expert down
}

# The persistent gemv tiles the sweep (`bench/nvfp4.py`) measures beside the table's;
# `tests/kernels/test_nvfp4_persist.py` builds each for sm_90 (no spills, shared memory fits).
# Offline sm_90 build (Triton 3.6): registers / shared memory per program, SASS instructions
# per weight of the tile loop at K = 2048, M = 1.
PERSISTENT_CANDIDATES: tuple[GemvConfig, ...] = (
    # Triton stages the next tiles' loads through shared memory (cp.async)
    GemvConfig(16, 128, 4, vec=4, num_stages=3, decode="h2", persistent=4),  # 72 r, 37 KB, 3.7
    GemvConfig(16, 128, 4, vec=4, num_stages=3, decode="h2", persistent=8),  # capped at ~6
    GemvConfig(16, 128, 4, vec=4, num_stages=2, decode="h2", persistent=6),  # 72 r, 18 KB
    GemvConfig(32, 128, 4, vec=4, num_stages=2, decode="h2", persistent=4),  # 72 r, 37 KB, 3.6
    GemvConfig(8, 128, 4, vec=4, num_stages=3, decode="h2", persistent=6),  # 64 r, 18 KB, 3.8
    GemvConfig(4, 128, 4, vec=4, num_stages=3, decode="h2", persistent=8),  # 64 r, 9 KB, 4.2
    # the next tile's loads into registers before this tile's decode
    GemvConfig(16, 128, 4, vec=4, num_stages=1, prefetch=True, decode="h2",
               persistent=4),  # 128 r, 3.6
)

# (H, F) -> tiles for one decode token, the winners of the `bench/nvfp4.py` sweeps.
MOE_GEMV_TILES: dict[tuple[int, int], MoEGemvConfig] = {
    (2048, 512): MoEGemvConfig(4, 128, 16, 32, 4, False, 4, "h2", 8),
}


def _next_pow2(v: int) -> int:
    return 1 << (v - 1).bit_length()


# Weights of at least this many bytes (K 1024..2048) without a table entry take the
# lm_head's persistent tiles: from ~16 MB up they beat the one-tile-per-program default, at
# 9.4 MB and below the default wins (bench/gemv_floor.py; docs/RESULTS.md).
PERSISTENT_MIN_BYTES = 16 << 20


def default_gemv_config(n: int, k: int, num_sms: int = 132) -> GemvConfig:
    """Tiles for an [N, K] weight at M = 1: the `GEMV_TILES` entry, else the lm_head's
    persistent tiles for weights of PERSISTENT_MIN_BYTES or more with 1024 <= K <= 2048, else
    8 rows x 128 blocks (2048 inputs; x reaches the threads through shared memory in one
    coalesced load) when K >= 1024, else 1024 / (K/16) rows x all of K; no split-K (it was
    never faster in the sweeps)."""
    hit = GEMV_TILES.get((n, k))
    if hit is not None:
        return hit
    if 1024 <= k <= 2048 and n * k // 2 >= PERSISTENT_MIN_BYTES:
        return GEMV_TILES[(248320, 2048)]
    block_b = 128 if k // 16 > 32 else _next_pow2(max(1, k // 16))
    block_n = max(1, 1024 // block_b)
    warps = max(1, min(4, block_n * block_b // 64))
    return GemvConfig(block_n, block_b, warps, 0)


def default_moe_gemv_config(hidden_size: int, intermediate_size: int) -> MoEGemvConfig:
    """The `MOE_GEMV_TILES` entry, else gate_up 4 gate + 4 up rows x up to 128 blocks, down
    8 rows x F/16 blocks (2 warps), x block-transposed."""
    hit = MOE_GEMV_TILES.get((hidden_size, intermediate_size))
    if hit is not None:
        return hit
    gu_b = min(128, _next_pow2(max(1, hidden_size // 16)))
    dn_b = min(128, _next_pow2(max(1, intermediate_size // 16)))
    return MoEGemvConfig(4, gu_b, 8, dn_b, 4, False, 2)

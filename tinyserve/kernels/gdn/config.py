"""Launch configurations of the GDN chunk kernel and their shared-memory bound (fitted to sm_90
builds, +25 %), so `chunk.py` launches one that fits the device (moving down the list when a
build still fails); plus the argument helpers both GDN launchers share."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.kernels.launch import next_pow2

# sm_90 (H100, H200) opt-in shared memory per block; used when the device is not queried.
SM90_SMEM_BYTES = 232_448
_MARGIN = 1.25


@dataclass(frozen=True)
class ChunkConfig:
    """One launch variant of the chunk kernels: chunk length, dv tile, warps and software
    pipeline stages of `gdn_chunk_kernel`, warps of the prep kernel."""

    chunk: int
    block_v: int
    num_warps: int
    num_stages: int = 1
    prep_warps: int = 4  # of `gdn_chunk_prep_kernel`
    blocked_inverse: bool = True  # prep: 16-row blocks by dots (False: 63 row steps)


def chunk_smem_bytes(cfg: ChunkConfig, block_k: int) -> int:
    """Upper bound of `gdn_chunk_kernel`'s shared memory (bytes) per program (sm_90, BT=64,
    BK=128: 80 KiB at BV=16, 96 KiB at BV=32; each extra stage buffers one more chunk)."""
    fp32, bt, bv = 4, cfg.chunk, cfg.block_v
    base = (2 * bt * block_k + 2 * bt * bt) * fp32  # q/k operands, Ti/att
    tiles = (block_k * bv + 2 * bt * bv) * fp32 * 2  # S, v_new (tf32 hi/lo)
    per_stage = (2 * bt * block_k + bt * bv + 2 * bt * bt) * fp32
    return int((base + tiles + (cfg.num_stages - 1) * per_stage) * _MARGIN)


def chunk_configs(dv: int, chunk: int, block_k: int, *, block_v: int | None = None,
                  smem_limit: int = SM90_SMEM_BYTES) -> list[ChunkConfig]:
    """Launch variants to try, best first: those that fit `smem_limit`, then the smallest
    (half the chunk, dv tile 16). `block_v` pins the dv tile (benchmarks)."""
    top = max(16, next_pow2(dv))
    tiles = [block_v] if block_v else [16, 32]
    # NOTE: 4 warps only: a dv-16 tile with 8 warps hit an illegal memory access on the GPU
    # (bench sweep); 4 warps is the configuration the GPU tests verified.
    ladder = [ChunkConfig(chunk, max(16, min(bv, top)), 4) for bv in tiles]
    fits = [c for c in ladder if chunk_smem_bytes(c, block_k) <= smem_limit]
    smallest = ChunkConfig(max(16, chunk // 2), 16, 4)
    return [*dict.fromkeys(fits), smallest] if smallest not in fits else fits


def check(ok: bool, msg: str) -> None:
    """Raise ValueError(msg) unless `ok` (launcher argument checks)."""
    if not ok:
        raise ValueError(msg)


def last_contig(t: torch.Tensor) -> torch.Tensor:
    """`t` itself when its last dim is contiguous, else a contiguous copy."""
    return t if t.stride(-1) == 1 else t.contiguous()


def strides(q, k, v, a, b, y) -> tuple:
    """The token / head strides the recurrent and chunk kernels take, in their order."""
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), b.stride(0), y.stride(0), y.stride(1))

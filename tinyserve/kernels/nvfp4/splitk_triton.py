"""The program -> tile mapping of the split-K `tl.dot` kernels (FP8 and NVFP4 `dot` paths).

Imports triton at the top, so only the kernel modules import it.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def splitk_tile(M, N, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(pid_k, offs_m, rows, m_mask, row_mask) of this program in a grid of
    cdiv(M, BM) * SPLIT_K * cdiv(N, BN) programs: its K split, its BM activation rows and its
    BN weight rows (output columns), with their bounds masks."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    pid_m = pid % num_m  # NOTE: M tiles vary fastest so one weight tile is reused from L2
    rest = pid // num_m
    pid_k = rest % SPLIT_K
    pid_n = rest // SPLIT_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return pid_k, offs_m, rows, offs_m < M, rows < N

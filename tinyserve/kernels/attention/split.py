"""The split-K plan and partial buffers of the paged decode kernels (`iso/mma.py`,
`iso/triton.py`, `paged_triton.py`): programs over `chunk` tokens of a sequence write fp32
partials that a second kernel merges by log-sum-exp."""

from __future__ import annotations

import math

import torch

from tinyserve.kernels import cuda_launch


def plan_splits(batch: int, num_kv_heads: int, max_seq_len: int, num_sms: int, *,
                min_tokens: int, ctas_per_sm: int, tile: int = 32,
                one_wave: bool = False) -> tuple[int, int]:
    """(tokens per split, splits): about `ctas_per_sm` CTAs per SM (`one_wave`: at most that
    many), >= `min_tokens` tokens per split, the split a multiple of `tile`."""
    max_seq_len = max(1, max_seq_len)
    rows = max(1, batch * num_kv_heads)
    if one_wave:
        want = max(1, ctas_per_sm * num_sms // rows)
    else:
        want = max(1, math.ceil(ctas_per_sm * num_sms / rows))
    splits = max(1, min(math.ceil(max_seq_len / max(1, min_tokens)), want))
    chunk = math.ceil(math.ceil(max_seq_len / splits) / tile) * tile
    return chunk, math.ceil(max_seq_len / chunk)


def decode_splits(q: torch.Tensor, seq_lens: torch.Tensor, num_kv_heads: int,
                  max_seq_len: int | None, split_tokens: int | None, *, split_tile: int,
                  **plan: int) -> tuple[int, int]:
    """(tokens per split, number of splits) of a split-K decode launcher: `split_tokens`
    (rounded up to `split_tile`) when forced, else `plan_splits(..., **plan)` for the device.
    Reads max(seq_lens) (a device sync) only when `max_seq_len` is None."""
    b = q.shape[0]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if b else 1
    if split_tokens:
        chunk = math.ceil(split_tokens / split_tile) * split_tile
        return chunk, math.ceil(max(1, max_seq_len) / chunk)
    return plan_splits(b, num_kv_heads, max_seq_len, cuda_launch.num_sms(q.device), **plan)


def split_buffers(q: torch.Tensor, splits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp32 partials of a split-K decode: accumulators [B, Hq, splits, D] and (max, sum)
    [B, Hq, splits, 2]."""
    b, hq, d = q.shape
    return (torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device),
            torch.empty(b, hq, splits, 2, dtype=torch.float32, device=q.device))

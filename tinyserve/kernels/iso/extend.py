"""ISO3/ISO4 extend attention: a prefill chunk's queries over the packed prefix plus the
chunk's own K/V (causal; never its own quantized K/V). The prefix is dequantized bit-exactly
(`cuda.iso_dequant_rows`) into head-major rows followed by the chunk, then
`attention.chunk.chunk_causal_attention` runs as on a bf16 cache."""

from __future__ import annotations

import torch

from tinyserve.kernels.attention.chunk import chunk_causal_attention
from tinyserve.kernels.iso import cuda as iso_cuda


def _with_prefix(cache: torch.Tensor, slots: torch.Tensor, chunk: torch.Tensor, fmt: str,
                 dtype: torch.dtype) -> torch.Tensor:
    """[Hkv, P + n, D]: the packed prefix rows at slots [P] dequantized, then chunk [n, Hkv, D]."""
    prefix, (n, heads, d) = slots.numel(), chunk.shape
    rows = torch.empty(heads, prefix + n, d, dtype=dtype, device=chunk.device)
    iso_cuda.iso_dequant_rows(cache, slots, fmt, d, dtype, head_major=True,
                              out=rows[:, :prefix])
    rows[:, prefix:] = chunk.transpose(0, 1)
    return rows


def iso_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         q_lens: list[int], prefix_lens: list[int], page_size: int, fmt: str,
                         scale: float) -> torch.Tensor:
    """Prefill chunks: q [N, Hq, D] over each sequence's packed prefix and its own k, v
    [N, Hkv, D] (causal). Does not store anything. Returns [N, Hq, D] in q's dtype."""
    iso_cuda.format_bits(fmt)  # (checks the format)
    out = torch.empty_like(q)
    start = 0
    for b, (n, prefix) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        if n == 0:
            continue
        ks, vs = k[start:start + n].to(q.dtype), v[start:start + n].to(q.dtype)
        if prefix == 0:
            kh, vh = ks.transpose(0, 1), vs.transpose(0, 1)
        else:
            t = torch.arange(prefix, device=q.device)
            slots = page_table[b].long()[t // page_size] * page_size + t % page_size
            kh = _with_prefix(k_cache, slots, ks, fmt, q.dtype)
            vh = _with_prefix(v_cache, slots, vs, fmt, q.dtype)
        o = chunk_causal_attention(q[start:start + n].transpose(0, 1), kh, vh, scale)
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out

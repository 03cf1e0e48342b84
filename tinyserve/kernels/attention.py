"""Causal attention of a chunk of queries over its sequence's K/V, through torch SDPA.

The chunk's queries are the last positions of the sequence (a prefill chunk after its cached
prefix), so query i sees keys 0 .. S - n + i: the lower-right causal mask. Passed as
`causal_lower_right`, SDPA runs the fused kernels (flash attention on CUDA, GQA without
repeating the K/V heads) instead of a materialised [n, S] mask; on CPU the mask is built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


def chunk_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """q [Hq, n, D] at the last n of S positions; k, v [Hkv, S, D] (Hq a multiple of Hkv,
    n <= S). Query i sees keys 0 .. S - n + i. Returns [Hq, n, D] in q's dtype."""
    n, s = q.shape[1], k.shape[1]
    if n > s:
        raise ValueError(f"{n} queries over {s} keys: the chunk must be inside the sequence")
    out = F.scaled_dot_product_attention(q[None], k[None], v[None],
                                         attn_mask=causal_lower_right(n, s), scale=scale,
                                         enable_gqa=q.shape[0] != k.shape[0])
    return out[0]

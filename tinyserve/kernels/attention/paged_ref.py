"""Pure-torch references of the bf16 KV cache's store and decode (kernels: `paged_triton.py`).

k_cache, v_cache [slots, Hkv, D], slot = page * page_size + offset; page_table [B, P] (rows
past a sequence's pages are never read); seq_lens [B], each >= 1. No host synchronisation.
`paged_decode_ref` gathers the pages, zeroes rows past each length (stale pages may hold NaN)
and calls SDPA with a boolean mask."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Most bytes of gathered K/V one batched reference call holds (rows beyond run in turn).
DECODE_GATHER_BYTES = 256 * 2**20


def paged_store_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor,
                    k: torch.Tensor, v: torch.Tensor, pad_slot: int) -> None:
    """Write k, v [N, Hkv, D] at `slots` [N] of k_cache, v_cache [slots, Hkv, D] (cast to the
    cache dtype); a negative slot (a padded row of a captured batch) writes `pad_slot`."""
    slots = torch.where(slots < 0, pad_slot, slots)
    k_cache.index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.index_copy_(0, slots, v.to(v_cache.dtype))


def paged_decode_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                     scale: float, *, max_seq_len: int) -> torch.Tensor:
    """One query q [B, Hq, D] per sequence over its first `seq_lens[b]` cached tokens
    (layout in the module docstring); `max_seq_len` bounds seq_lens and sizes the gather,
    run in groups of rows whose K/V stay under DECODE_GATHER_BYTES. Returns [B, Hq, D] in
    q's dtype (SDPA in the cache dtype)."""
    B, _, D = q.shape
    hkv = k_cache.shape[1]
    kc = k_cache.view(-1, page_size, hkv, D)
    vc = v_cache.view(-1, page_size, hkv, D)
    n_pages = max(1, min(-(-max_seq_len // page_size), page_table.shape[1]))
    pages = page_table[:, :n_pages].long()  # [B, P]
    row_bytes = 2 * n_pages * kc[0].numel() * kc.element_size()
    group = max(1, DECODE_GATHER_BYTES // row_bytes)
    if group >= B:
        return _gathered_decode(q, kc, vc, pages, seq_lens, scale)
    out = torch.empty_like(q)
    for b in range(0, B, group):
        out[b:b + group] = _gathered_decode(q[b:b + group], kc, vc, pages[b:b + group],
                                            seq_lens[b:b + group], scale)
    return out


def _gathered_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pages: torch.Tensor,
                     seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D] over the K/V of pages [B, P] (caches [pages, page_size, Hkv, D]), keys
    past seq_lens [B] masked. Returns [B, Hq, D]."""
    B, Hq, D = q.shape
    Hkv = kc.shape[2]
    S = pages.shape[1] * kc.shape[1]
    keep = torch.arange(S, device=q.device)[None, :] < seq_lens[:, None]  # [B, S]
    # NOTE: rows past the length are zeroed, not only masked: stale pages may hold NaN.
    k = kc[pages].view(B, S, Hkv, D).masked_fill_(~keep[:, :, None, None], 0)
    v = vc[pages].view(B, S, Hkv, D).masked_fill_(~keep[:, :, None, None], 0)
    # GQA without repeating K/V: a KV head's query heads become its query rows.
    qg = q.reshape(B, Hkv, Hq // Hkv, D).to(kc.dtype)
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=keep[:, None, None], scale=scale)
    return o.reshape(B, Hq, D).to(q.dtype)  # [B, Hkv, G, D] -> [B, Hq, D]

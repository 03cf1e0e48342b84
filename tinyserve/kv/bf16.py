"""Paged KV store in the model dtype (bf16 on GPU, fp32 for exact CPU tests) with a
pure-torch attention over it.

Store: K and V each [num_attention_layers, num_pages + 1, page_size, Hkv, D]. Page `num_pages`
is a padding page: tokens whose slot is negative (padded rows of a captured batch) are written
there and never read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tinyserve.core import ForwardContext
from tinyserve.kernels.attention import chunk_causal_attention
from tinyserve.kv.base import KVBackend


class BF16KVBackend(KVBackend):
    """KV backend storing post-norm, post-RoPE K/V unquantized in the model dtype."""

    name = "bf16"

    def __init__(self, *, layer_ids: list[int], num_kv_heads: int, head_dim: int,
                 num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype) -> None:
        super().__init__(layer_ids=layer_ids, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         num_pages=num_pages, page_size=page_size, device=device, dtype=dtype)
        self._index = {L: i for i, L in enumerate(self.layer_ids)}
        shape = (len(self.layer_ids), num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    @classmethod
    def bytes_per_token(cls, num_layers: int, num_kv_heads: int, head_dim: int,
                        dtype_bytes: int = 2) -> int:
        """K and V of every attention layer: 10 x 2 x 2 x 256 x 2 B = 20,480 B for 35B-A3B."""
        return num_layers * 2 * num_kv_heads * head_dim * dtype_bytes

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_pages + 1, page_size, Hkv, D] (views)."""
        i = self._index[layer_id]
        return self.k_cache[i], self.v_cache[i]

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store k, v [N, Hkv, D] at flat slots [N] (negative slot -> the padding page)."""
        kc, vc = self.layer_cache(layer_id)
        pad_slot = self.num_pages * self.page_size
        slots = torch.where(slot_mapping < 0, pad_slot, slot_mapping)
        kc.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, k.to(kc.dtype))
        vc.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slots, v.to(vc.dtype))

    def gather(self, layer_id: int, page_ids: torch.Tensor,
               length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `length` cached tokens of a sequence: (K, V) each [length, Hkv, D]."""
        kc, vc = self.layer_cache(layer_id)
        n_pages = -(-length // self.page_size)
        pages = page_ids[:n_pages].long()
        k = kc[pages].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        v = vc[pages].reshape(-1, self.num_kv_heads, self.head_dim)[:length]
        return k, v

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        self.write(layer_id, k, v, ctx.slot_mapping)
        if ctx.is_decode and (q.is_cuda or ctx.max_seq_len is not None):
            return self.decode(layer_id, q, ctx.page_table, ctx.seq_lens, ctx.seq_len_bound,
                               scale)
        out = torch.empty_like(q)
        start = 0
        for b, (n, prefix) in enumerate(zip(ctx.q_lens_cpu, ctx.prefix_lens_cpu, strict=True)):
            if n == 0:
                continue
            end = start + n
            kb, vb = self.gather(layer_id, ctx.page_table[b], prefix + n)
            out[start:end] = causal_attention(q[start:end], kb, vb, prefix, scale)
            start = end
        return out

    def decode(self, layer_id: int, q: torch.Tensor, page_table: torch.Tensor,
               seq_lens: torch.Tensor, max_seq_len: int, scale: float) -> torch.Tensor:
        """One query per sequence over its first `seq_lens[b]` cached tokens, batched and
        without a host synchronisation (CUDA-graph safe): the first ceil(max_seq_len /
        page_size) pages of each page-table row are gathered and the keys past the length
        masked, in groups of rows whose gathered K/V fit DECODE_GATHER_BYTES.

        Args:
            q: [B, Hq, D]; page_table: [B, P] int; seq_lens: [B] int (>= 1, the new token
                included, <= max_seq_len).
        Returns:
            [B, Hq, D] in q.dtype.
        """
        kc, vc = self.layer_cache(layer_id)
        B = q.shape[0]
        n_pages = max(1, min(-(-max_seq_len // self.page_size), page_table.shape[1]))
        pages = page_table[:, :n_pages].long()  # [B, P]
        row_bytes = 2 * n_pages * kc[0].numel() * kc.element_size()
        group = max(1, DECODE_GATHER_BYTES // row_bytes)
        if group >= B:
            return _paged_decode(q, kc, vc, pages, seq_lens, scale)
        out = torch.empty_like(q)
        for b in range(0, B, group):
            out[b:b + group] = _paged_decode(q[b:b + group], kc, vc, pages[b:b + group],
                                             seq_lens[b:b + group], scale)
        return out


# Most bytes of gathered K/V one batched decode attention call holds (rows beyond run in turn).
DECODE_GATHER_BYTES = 256 * 2**20


def _paged_decode(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pages: torch.Tensor,
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
    qg = q.reshape(B, Hkv, Hq // Hkv, D)
    o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=keep[:, None, None], scale=scale)
    return o.reshape(B, Hq, D)  # [B, Hkv, G, D] -> [B, Hq, D]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                     scale: float) -> torch.Tensor:
    """Attention of one sequence's chunk with GQA (`kernels.attention`).

    q [n, Hq, D] at positions prefix .. prefix+n-1; k, v [prefix+n, Hkv, D]. Query i sees keys
    0 .. prefix+i. Returns [n, Hq, D] in q.dtype (SDPA: fp32 softmax inside).
    """
    if k.shape[0] != prefix + q.shape[0]:
        raise ValueError(f"{k.shape[0]} keys for a prefix of {prefix} and {q.shape[0]} queries")
    o = chunk_causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)
    return o.transpose(0, 1)

"""Paged KV store in the model dtype (bf16 on GPU, fp32 for exact CPU tests) and the
attention over it.

Store: K and V each [num_attention_layers, num_pages + 1, page_size, Hkv, D]. Page `num_pages`
is a padding page: tokens whose slot is negative (padded rows of a captured batch) are written
there and never read.

On CUDA (sm_80+) with a bf16/fp16 cache the store and decode attention run the Triton kernels of
`kernels.attention.paged_triton` (decode: for the shapes `decode_supported` takes, chosen when
the pool is built); elsewhere, for other shapes, or with TINYSERVE_DISABLE_KERNELS=1, their
references in `kernels.attention.paged_ref`. Prefill and extend attention gather the sequence's
K/V and call `kernels.attention.chunk`.
"""

from __future__ import annotations

import torch

from tinyserve import envs
from tinyserve.core import ForwardContext
from tinyserve.kernels.attention.chunk import chunk_causal_attention
from tinyserve.kernels.attention.paged_ref import paged_decode_ref, paged_store_ref
from tinyserve.kv.base import KVBackend


class BF16KVBackend(KVBackend):
    """KV backend storing post-norm, post-RoPE K/V unquantized in the model dtype. The decode
    kernel for `num_q_heads` is chosen here."""

    name = "bf16"

    def __init__(self, *, layer_ids: list[int], num_kv_heads: int, head_dim: int,
                 num_pages: int, page_size: int, device: torch.device | str,
                 num_q_heads: int, dtype: torch.dtype) -> None:
        super().__init__(layer_ids=layer_ids, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         num_pages=num_pages, page_size=page_size, device=device, dtype=dtype)
        self._index = {L: i for i, L in enumerate(self.layer_ids)}
        shape = (len(self.layer_ids), num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        # NOTE: the Triton kernels need 16-bit tensor-core dots (sm_80+) and a power-of-two
        # head_dim (their row loads span it).
        self.use_kernels = (self.device.type == "cuda" and not envs.DISABLE_KERNELS.get()
                            and dtype in (torch.bfloat16, torch.float16)
                            and not head_dim & (head_dim - 1)
                            and torch.cuda.get_device_capability(self.device)[0] >= 8)
        self._decode_fn = paged_decode_ref  # or the Triton kernel (`_pick_decode`)
        self.decode_impl = "gather + SDPA (torch reference)"
        if self.use_kernels:
            self._pick_decode(num_q_heads)

    @classmethod
    def bytes_per_token(cls, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """K and V of every attention layer in 16 bits: 10 x 2 x 2 x 256 x 2 B = 20,480 B for
        35B-A3B."""
        return num_layers * 2 * num_kv_heads * head_dim * 2

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer, each [num_pages + 1, page_size, Hkv, D] (views)."""
        i = self._index[layer_id]
        return self.k_cache[i], self.v_cache[i]

    def write(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
              slot_mapping: torch.Tensor) -> None:
        """Store k, v [N, Hkv, D] at flat slots [N] (negative slot -> the padding page)."""
        kc, vc = self._flat(layer_id)
        pad_slot = self.num_pages * self.page_size
        if self.use_kernels:
            from tinyserve.kernels.attention import paged_triton as paged_kv_triton

            paged_kv_triton.paged_store(kc, vc, slot_mapping, k, v, pad_slot)
            return
        paged_store_ref(kc, vc, slot_mapping, k, v, pad_slot)

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
        """One query per sequence, q [B, Hq, D], over its first `seq_lens[b]` cached tokens
        ([B] int32, <= `max_seq_len`, the host bound that sizes the work) -> [B, Hq, D]. No host
        synchronisation (CUDA-graph safe): the split-K Triton kernel on CUDA, else the reference."""
        kc, vc = self._flat(layer_id)
        return self._decode_fn(q, kc, vc, page_table, seq_lens, self.page_size, scale,
                               max_seq_len=max_seq_len)

    def _pick_decode(self, num_q_heads: int) -> None:
        """Decode on the Triton kernel where it takes the shapes (else the reference);
        `decode_impl` names the choice for the start-up log."""
        from tinyserve.kernels.attention import paged_triton as paged_kv_triton

        if paged_kv_triton.decode_supported(num_q_heads, self.num_kv_heads, self.head_dim,
                                            self.dtype):
            self._decode_fn = paged_kv_triton.paged_decode_attention
            self.decode_impl = "Triton split-K"

    def _flat(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of one layer as [slots, Hkv, D] views, slot = page * page_size + offset."""
        kc, vc = self.layer_cache(layer_id)
        return (kc.view(-1, self.num_kv_heads, self.head_dim),
                vc.view(-1, self.num_kv_heads, self.head_dim))


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int,
                     scale: float) -> torch.Tensor:
    """Attention (GQA) of one sequence's chunk q [n, Hq, D] at positions prefix ..
    prefix+n-1 over k, v [prefix+n, Hkv, D] -> [n, Hq, D] in q.dtype."""
    if k.shape[0] != prefix + q.shape[0]:
        raise ValueError(f"{k.shape[0]} keys for a prefix of {prefix} and {q.shape[0]} queries")
    o = chunk_causal_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale)
    return o.transpose(0, 1)

"""ISO3/ISO4 paged KV backend: uint8 slabs of packed K/V rows for the full-attention layers.

Layout (specs/iso_kv.md §5.2): one slab [2 (K, V), layers, (num_pages + 1) * page_size,
num_kv_heads, row_bytes]; slot = page * page_size + offset, the last page is padding.

Ordering contract (§6.2):
- decode (every sequence has one new token and a cached prefix): store the new token's K/V
  first, then attend, so the token sees its own quantized K/V;
- extend (anything else): attend over the packed prefix plus the chunk's own K/V in the model
  dtype (causal), then store the chunk (deferred quantization).

On CUDA the store and extend run `kernels.iso.cuda` and `kernels.iso.extend`; decode runs the
one kernel `kernels.iso.choose_decode` picks for the model's shapes when the pool is built
(CUDA tensor cores for iso3 with GQA groups up to 8, else Triton). Elsewhere (or with
TINYSERVE_DISABLE_KERNELS=1) the references of `kernels.iso.ref` run: quantize on write,
dequantize + fp32 attention.
"""

from __future__ import annotations

import torch

from tinyserve import envs
from tinyserve.core import ForwardContext
from tinyserve.kernels import iso
from tinyserve.kv.base import KVBackend


class ISOKVBackend(KVBackend):
    """Paged ISO3/ISO4 KV store and attention. Raises ValueError when head_dim % 128 != 0.
    On CUDA the decode kernel for `num_q_heads` is chosen here."""

    name = "iso"

    def __init__(self, *, layer_ids: list[int], num_kv_heads: int, head_dim: int,
                 num_pages: int, page_size: int, device: torch.device | str,
                 num_q_heads: int, dtype: torch.dtype, fmt: str = "iso3") -> None:
        if head_dim % iso.BLOCK:
            raise ValueError(f"--kv {fmt} needs head_dim % {iso.BLOCK} == 0, but the model has "
                             f"head_dim={head_dim}; use --kv bf16")
        super().__init__(layer_ids=layer_ids, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         num_pages=num_pages, page_size=page_size, device=device, dtype=dtype)
        self.fmt = fmt
        self.name = fmt
        self.row_bytes = iso.packed_row_bytes(head_dim, fmt)  # (ValueError: unknown format)
        self._layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.num_slots = (num_pages + 1) * page_size
        # [2, L, slots, Hkv, row_bytes]
        self.buffer = torch.zeros(2, len(self.layer_ids), self.num_slots, num_kv_heads,
                                  self.row_bytes, dtype=torch.uint8, device=self.device)
        self.use_kernels = self.device.type == "cuda" and not envs.DISABLE_KERNELS.get()
        self._decode_fn = None  # the CUDA decode kernel
        self.decode_impl = "torch reference"
        if self.use_kernels:
            self._pick_decode(num_q_heads)

    @classmethod
    def bytes_per_token(cls, num_layers: int, num_kv_heads: int, head_dim: int,
                        fmt: str = "iso3") -> int:
        """2 (K, V) x layers x kv heads x packed_row_bytes(head_dim, fmt)."""
        return 2 * num_layers * num_kv_heads * iso.packed_row_bytes(head_dim, fmt)

    def k_cache(self, layer_id: int) -> torch.Tensor:
        """uint8 [slots, Hkv, row_bytes] of one layer; KeyError for a layer without a slab."""
        return self.buffer[0, self._layer_index[layer_id]]

    def v_cache(self, layer_id: int) -> torch.Tensor:
        return self.buffer[1, self._layer_index[layer_id]]

    # ---------------------------------------------------------------------------------------

    def store(self, layer_id: int, k: torch.Tensor, v: torch.Tensor,
              slots: torch.Tensor) -> None:
        """Quantize k, v [N, Hkv, D] and write them at `slots` [N] (int32 or int64); a
        negative slot (a padded row of a captured batch) goes to the padding page."""
        kc, vc = self.k_cache(layer_id), self.v_cache(layer_id)
        slots = torch.where(slots < 0, self.num_pages * self.page_size, slots)
        if self.use_kernels:
            from tinyserve.kernels.iso import cuda as iso_cuda

            iso_cuda.iso_store(kc, vc, slots, k, v, self.fmt)
            return
        idx = slots.long().to(kc.device)
        kc[idx] = iso.quantize_ref(k.float(), self.fmt).to(kc.device)
        vc[idx] = iso.quantize_ref(v.float(), self.fmt).to(vc.device)

    def forward(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        if ctx.is_decode:
            self.store(layer_id, k, v, ctx.slot_mapping)
            return self._decode(layer_id, q, ctx, scale)
        out = self._extend(layer_id, q, k, v, ctx, scale)
        self.store(layer_id, k, v, ctx.slot_mapping)
        return out

    def _decode(self, layer_id: int, q: torch.Tensor, ctx: ForwardContext,
                scale: float) -> torch.Tensor:
        kc, vc = self.k_cache(layer_id), self.v_cache(layer_id)
        if self._decode_fn is not None:
            return self._decode_fn(q, kc, vc, ctx.page_table, ctx.seq_lens, ctx.page_size,
                                   self.fmt, scale, max_seq_len=ctx.seq_len_bound)
        out = iso.decode_attention_ref(q, kc.cpu(), vc.cpu(), ctx.page_table.cpu(),
                                       ctx.seq_lens.cpu(), ctx.page_size, self.fmt, scale)
        return out.to(device=q.device, dtype=q.dtype)

    def _pick_decode(self, num_q_heads: int) -> None:
        """Choose the CUDA decode kernel for this pool (every layer's caches checked for the
        16-byte copies); `decode_impl` names it for the start-up log."""
        from tinyserve.kernels.iso.mma import caches_aligned

        aligned = all(caches_aligned(self.k_cache(lid), self.v_cache(lid))
                      for lid in self.layer_ids)
        name = iso.choose_decode(self.fmt, num_q_heads, self.num_kv_heads, self.head_dim,
                                 aligned)
        self.decode_impl = iso.DECODE_KERNELS[name]
        self._decode_fn = iso.decode_launcher(name)

    def _extend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        kc, vc = self.k_cache(layer_id), self.v_cache(layer_id)
        if self.use_kernels:
            from tinyserve.kernels.iso import extend as iso_extend

            return iso_extend.iso_extend_attention(
                q, k, v, kc, vc, ctx.page_table, ctx.q_lens_cpu, ctx.prefix_lens_cpu,
                ctx.page_size, self.fmt, scale)
        out = torch.empty(q.shape, dtype=torch.float32)
        start = 0
        for b, (n, prefix) in enumerate(zip(ctx.q_lens_cpu, ctx.prefix_lens_cpu, strict=True)):
            kp = iso.gather_rows(kc, ctx.page_table[b], ctx.page_size, prefix).cpu()
            vp = iso.gather_rows(vc, ctx.page_table[b], ctx.page_size, prefix).cpu()
            kk = torch.cat([iso.dequantize_ref(kp, self.fmt, self.head_dim),
                            k[start:start + n].float().cpu()])
            vv = torch.cat([iso.dequantize_ref(vp, self.fmt, self.head_dim),
                            v[start:start + n].float().cpu()])
            out[start:start + n] = iso.attention_oracle(q[start:start + n].cpu(), kk, vv,
                                                        prefix, scale)
            start += n
        return out.to(device=q.device, dtype=q.dtype)

"""ISO3/ISO4 paged KV backend: uint8 slabs of packed K/V rows for the full-attention layers.

Layout (specs/iso_kv.md §5.2): one slab [2 (K, V), layers, (num_pages + 1) * page_size,
num_kv_heads, row_bytes]; slot = page * page_size + offset, the last page is padding.

Ordering contract (§6.2):
- decode (every sequence has one new token and a cached prefix): store the new token's K/V
  first, then attend, so the token sees its own quantized K/V;
- extend (anything else): attend over the packed prefix plus the chunk's own K/V in the model
  dtype (causal), then store the chunk (deferred quantization).

On CUDA the store and extend run the kernels of `kernels.iso_cuda`; decode runs the
tensor-core Triton kernel (`kernels.iso_triton`), the CUDA SIMT kernel or the CUDA
tensor-core kernel (`kernels.iso_mma`, "mma": iso3, GQA group <= 8; other shapes use the
Triton kernel), as DECODE_IMPL says (TINYSERVE_ISO_DECODE overrides it).
Elsewhere (or with TINYSERVE_DISABLE_KERNELS=1) the references of `kernels.iso` run: quantize
on write, dequantize + fp32 attention.
"""

from __future__ import annotations

import torch

from tinyserve import envs
from tinyserve.core import ForwardContext
from tinyserve.kernels import iso
from tinyserve.kv.base import KVBackend
from tinyserve.log import get_logger

log = get_logger(__name__)

# The decode kernel ("triton", "cuda" or "mma"): the tensor-core kernel, the fastest of the
# three at every measured point (docs/RESULTS.md); iso4 and GQA groups over 8 fall back to
# Triton.
DECODE_IMPL = "mma"
DECODE_IMPLS = ("triton", "cuda", "mma")


def decode_impl() -> str:
    """The decode attention kernel in use: TINYSERVE_ISO_DECODE, else DECODE_IMPL."""
    impl = envs.ISO_DECODE.get().strip().lower() or DECODE_IMPL
    if impl not in DECODE_IMPLS:
        raise ValueError(f"TINYSERVE_ISO_DECODE must be one of {DECODE_IMPLS}, got {impl!r}")
    return impl


class ISOKVBackend(KVBackend):
    """Paged ISO3/ISO4 KV store and attention. Raises ValueError when head_dim % 128 != 0."""

    name = "iso"

    def __init__(self, *, layer_ids: list[int], num_kv_heads: int, head_dim: int,
                 num_pages: int, page_size: int, device: torch.device | str,
                 dtype: torch.dtype, fmt: str = "iso3") -> None:
        if fmt not in iso.FORMATS:
            raise ValueError(f"unknown ISO format {fmt!r}; expected one of {iso.FORMATS}")
        if head_dim % iso.BLOCK:
            raise ValueError(f"--kv {fmt} needs head_dim % {iso.BLOCK} == 0, but the model has "
                             f"head_dim={head_dim}; use --kv bf16")
        super().__init__(layer_ids=layer_ids, num_kv_heads=num_kv_heads, head_dim=head_dim,
                         num_pages=num_pages, page_size=page_size, device=device, dtype=dtype)
        self.fmt = fmt
        self.name = fmt
        self.row_bytes = iso.packed_row_bytes(head_dim, fmt)
        self._layer_index = {lid: i for i, lid in enumerate(self.layer_ids)}
        self.num_slots = (num_pages + 1) * page_size
        # [2, L, slots, Hkv, row_bytes]
        self.buffer = torch.zeros(2, len(self.layer_ids), self.num_slots, num_kv_heads,
                                  self.row_bytes, dtype=torch.uint8, device=self.device)
        self.use_kernels = self.device.type == "cuda" and not envs.DISABLE_KERNELS.get()
        self._triton_ok = True

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
            from tinyserve.kernels import iso_cuda

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
        if self.use_kernels:
            impl = decode_impl()
            if impl == "mma":
                from tinyserve.kernels import iso_mma

                if iso_mma.mma_supported(self.fmt, q.shape[1], self.num_kv_heads,
                                         self.head_dim):
                    return iso_mma.iso_decode_attention_mma(
                        q, kc, vc, ctx.page_table, ctx.seq_lens, ctx.page_size, self.fmt,
                        scale, max_seq_len=ctx.seq_len_bound)
                impl = "triton"
            if impl == "triton" and self._triton_ok:
                from tinyserve.kernels import iso_triton

                try:
                    return iso_triton.iso_decode_attention_triton(
                        q, kc, vc, ctx.page_table, ctx.seq_lens, ctx.page_size, self.fmt,
                        scale, max_seq_len=ctx.seq_len_bound)
                except Exception as exc:  # noqa: BLE001 - a compile failure: use the CUDA kernel
                    log.warning("ISO Triton decode failed (%s: %s); using the CUDA kernel",
                                type(exc).__name__, str(exc)[:300])
                    self._triton_ok = False
            from tinyserve.kernels import iso_cuda

            return iso_cuda.iso_decode_attention(q, kc, vc, ctx.page_table, ctx.seq_lens,
                                                 ctx.page_size, self.fmt, scale,
                                                 max_seq_len=ctx.seq_len_bound)
        out = iso.decode_attention_ref(q, kc.cpu(), vc.cpu(), ctx.page_table.cpu(),
                                       ctx.seq_lens.cpu(), ctx.page_size, self.fmt, scale)
        return out.to(device=q.device, dtype=q.dtype)

    def _extend(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                ctx: ForwardContext, scale: float) -> torch.Tensor:
        kc, vc = self.k_cache(layer_id), self.v_cache(layer_id)
        if self.use_kernels:
            from tinyserve.kernels import iso_extend

            return iso_extend.iso_extend_attention(
                q, k, v, kc, vc, ctx.page_table, ctx.cu_seqlens, ctx.q_lens_cpu,
                ctx.prefix_lens_cpu, ctx.page_size, self.fmt, scale)
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

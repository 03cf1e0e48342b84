"""The ISO decode kernel for a pool's shapes, chosen once when the pool is built."""

from __future__ import annotations

from collections.abc import Callable

import torch

# The decode kernels on CUDA, as `kernel_check.implementations` names them.
DECODE_KERNELS = {"mma": "CUDA tensor cores", "triton": "Triton tensor cores"}


def choose_decode(fmt: str, num_q_heads: int, num_kv_heads: int, head_dim: int,
                  aligned: bool = True) -> str:
    """The decode attention kernel on CUDA (a key of DECODE_KERNELS): "mma" where `mma` takes
    the shapes (iso3, GQA group <= 8, head_dim 128/256, caches `aligned` for its 16-byte
    copies), "triton" otherwise (iso4, wider groups, odd row strides)."""
    from tinyserve.kernels.iso.mma import mma_supported

    ok = aligned and mma_supported(fmt, num_q_heads, num_kv_heads, head_dim)
    return "mma" if ok else "triton"


def decode_launcher(name: str) -> Callable[..., torch.Tensor]:
    """The launcher of a DECODE_KERNELS key (the contract of `ref.decode_attention_ref`)."""
    if name == "mma":
        from tinyserve.kernels.iso.mma import iso_decode_attention_mma

        return iso_decode_attention_mma
    from tinyserve.kernels.iso.triton import iso_decode_attention_triton

    return iso_decode_attention_triton

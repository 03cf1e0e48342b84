"""Attention kernels of the bf16 KV cache and the chunk attention every backend shares.

`chunk`: causal attention of a prefill chunk over its prefix (cuDNN / SDPA); `paged_ref` and
`paged_triton`: the paged bf16/fp16 store and split-K decode (`decode_supported` picks the
kernel); `split` and `split_triton`: the split-K plan and pieces the decode kernels share."""

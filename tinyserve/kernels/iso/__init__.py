"""ISO3/ISO4 KV-cache quantization: store, dequantize, extend and decode attention.

`ref` holds the formats and the torch references; `cuda` the store and dequantize kernels,
`extend` the prefill attention over a packed prefix, `mma` (CUDA) and `triton` the decode
kernels, picked by `choose_decode`."""

from tinyserve.kernels.iso.ref import (
    BLOCK,
    BLOCK_BYTES,
    FORMATS,
    attention_oracle,
    centroid_table,
    decode_attention_ref,
    dequantize_ref,
    gather_rows,
    packed_row_bytes,
    quantize_ref,
    quat_table,
    rotate_ref,
)
from tinyserve.kernels.iso.select import DECODE_KERNELS, choose_decode, decode_launcher

__all__ = ["BLOCK", "BLOCK_BYTES", "DECODE_KERNELS", "FORMATS", "attention_oracle",
           "centroid_table", "choose_decode", "decode_attention_ref", "decode_launcher",
           "dequantize_ref", "gather_rows", "packed_row_bytes", "quantize_ref", "quat_table",
           "rotate_ref"]

"""FP8 (E4M3) linear layers of mixed checkpoints: `linear.fp8_linear` picks a Triton GEMV,
a tensor-core dot or dequantize + cuBLAS by `choose_path` (kernels in `triton`)."""

from tinyserve.kernels.fp8.linear import choose_path, describe, fp8_dequantize, fp8_linear

__all__ = ["choose_path", "describe", "fp8_dequantize", "fp8_linear"]

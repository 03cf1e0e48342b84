"""NVFP4 linear layers: `linear.nvfp4_linear` picks the CUDA GEMV (`cuda`), the Triton GEMV
(`triton`), a tensor-core dot (`dot_triton`) or dequantize + cuBLAS by `choose_path`; `ref`
holds the NVFP4 and FP8 formats' torch references."""

from tinyserve.kernels.nvfp4.linear import choose_path, describe, nvfp4_dequantize, nvfp4_linear

__all__ = ["choose_path", "describe", "nvfp4_dequantize", "nvfp4_linear"]

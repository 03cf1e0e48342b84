"""`linear(x, w)`: y = x @ W.T for every weight storage (dense, NVFP4, FP8): Triton kernels
on the packed bytes where `kernels_enabled`, else dequantize and matmul. `concat_rows` and
`SplitLinear` run same-input projections as one GEMM.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from tinyserve import envs
from tinyserve.core import DenseWeight, FP8Weight, LinearWeight, NVFP4Weight
from tinyserve.kernels.nvfp4.ref import dequantize


def linear(x: torch.Tensor, w: LinearWeight) -> torch.Tensor:
    """x [..., in] (model dtype) -> [..., out] in x.dtype. No bias (Qwen3.5 has none)."""
    if isinstance(w, DenseWeight):
        return F.linear(x, w.weight)
    if isinstance(w, FP8Weight) and kernels_enabled(x.device):
        from tinyserve.kernels import fp8

        return fp8.fp8_linear(x, w)
    if isinstance(w, NVFP4Weight) and kernels_enabled(x.device):
        from tinyserve.kernels.nvfp4 import nvfp4_linear

        return nvfp4_linear(x, w)
    return F.linear(x, dequantize(w, x.dtype))


def to_device(w: LinearWeight, device: torch.device | str,
              dtype: torch.dtype) -> LinearWeight:
    """Move a weight to `device`; dense weights are also cast to the model `dtype`."""
    if isinstance(w, DenseWeight):
        return DenseWeight(w.weight.to(device=device, dtype=dtype))
    if isinstance(w, NVFP4Weight):
        return NVFP4Weight(w.packed.to(device), w.block_scale.to(device), w.global_scale)
    if isinstance(w, FP8Weight):
        return FP8Weight(w.weight.to(device), w.scale.to(device))
    raise TypeError(f"unknown weight storage {type(w).__name__}")


def concat_rows(*ws: LinearWeight) -> LinearWeight | None:
    """One weight with `linear(x, concat_rows(a, b)) == [linear(x, a) | linear(x, b)]` (a new
    tensor), or None when they cannot share one storage (types, input dims, dense dtypes or
    NVFP4 global scales differ). FP8 keeps one scale when all are equal, else per-row [out, 1].
    """
    if len(ws) < 2 or any(type(w) is not type(ws[0]) or w.shape[1] != ws[0].shape[1]
                          for w in ws):
        return None
    a = ws[0]
    if isinstance(a, DenseWeight):
        if any(w.weight.dtype != a.weight.dtype for w in ws):
            return None
        return DenseWeight(torch.cat([w.weight for w in ws]))
    if isinstance(a, NVFP4Weight):
        if any(w.global_scale != a.global_scale for w in ws):
            return None
        return NVFP4Weight(torch.cat([w.packed for w in ws]),
                           torch.cat([w.block_scale for w in ws]), a.global_scale)
    if isinstance(a, FP8Weight):
        weight = torch.cat([w.weight for w in ws])
        if all(w.scale.numel() == 1 and torch.equal(w.scale, a.scale) for w in ws):
            return FP8Weight(weight, a.scale)
        scales = [w.scale.to(torch.float32).reshape(-1, 1).expand(w.shape[0], 1)
                  for w in ws]  # per-row [out, 1]
        return FP8Weight(weight, torch.cat(scales))
    return None


class SplitLinear:
    """Same-input projections: `split(x, sizes)` is `(linear(x, p) for p in parts)`, as
    row-strided views of one GEMM through `fused` (given, or `concat_rows` of the parts with
    `fuse`) when there is one, else projection by projection (`parts`)."""

    def __init__(self, parts: Sequence[LinearWeight], fused: LinearWeight | None = None, *,
                 fuse: bool = True) -> None:
        self.fused = fused if fused is not None or not fuse else concat_rows(*parts)
        self.parts = tuple(parts) if self.fused is None else ()

    @classmethod
    def of(cls, w: Mapping[str, Any], name: str, parts: tuple[str, ...]) -> SplitLinear:
        """From `w[name]` (fused by the loader) or else the weights `w[part]`."""
        return cls((), w[name]) if name in w else cls([w[p] for p in parts])

    def split(self, x: torch.Tensor, sizes: Sequence[int]) -> tuple[torch.Tensor, ...]:
        """x [N, in] -> one [N, size] per part (`sizes`: the parts' output dims)."""
        if self.fused is None:
            return tuple(linear(x, p) for p in self.parts)
        return linear(x, self.fused).split(list(sizes), dim=-1)


def kernels_enabled(device: torch.device) -> bool:
    """Whether GPU kernels run on `device`: CUDA, triton importable, and
    TINYSERVE_DISABLE_KERNELS unset (read at every call, so tests can flip it)."""
    return device.type == "cuda" and not envs.DISABLE_KERNELS.get() and _has_triton()


@functools.cache
def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True

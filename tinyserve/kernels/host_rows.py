"""Host memory a GPU kernel can read, and a row gather from it.

`register_mapped(t)` page-locks a CPU tensor's memory with the CUDA driver (cudaHostRegister,
portable + mapped): its pages become device-addressable, so a kernel reads them over PCIe with
no copy issued by the host (zero-copy). `gather_rows(table, ids)` is such a kernel: rows
`table[ids]` into a device tensor, `ids` on the device, so a CUDA graph can embed the tokens
it is given on the device from a table that lives in host RAM.
Triton is imported on the first gather, never at import time.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from tinyserve.log import get_logger

log = get_logger(__name__)

_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def register_mapped(t: torch.Tensor, what: str) -> bool:
    """Page-lock and map the memory of contiguous CPU tensor `t` for every device while `t`
    lives (unregistered when it is freed). False, with a warning naming `what`, when CUDA
    refuses (no driver, not enough lockable memory): `t` stays pageable."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"{what}: only a contiguous CPU tensor can be registered")
    ptr, size = t.data_ptr(), t.numel() * t.element_size()
    try:
        cudart = torch.cuda.cudart()
        res = cudart.cudaHostRegister(ptr, size, _PORTABLE_MAPPED)
        if int(res) != 0:
            raise RuntimeError(f"cudaHostRegister returned error {int(res)}")
    except Exception as exc:  # no CUDA, driver refusal, not enough lockable memory
        log.warning("could not pin the %.2f GiB %s (%s); it stays in pageable memory",
                    size / 2**30, what, exc)
        return False
    weakref.finalize(t, _unregister, cudart, ptr)
    return True


def _unregister(cudart: Any, ptr: int) -> None:
    try:
        cudart.cudaHostUnregister(ptr)
    except Exception:  # interpreter shutdown
        pass


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather_rows_kernel(table_ptr, ids_ptr, out_ptr, W, BLOCK: tl.constexpr):
        row = tl.load(ids_ptr + tl.program_id(0)).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < W
        v = tl.load(table_ptr + row * W + offs, mask=mask)
        tl.store(out_ptr + tl.program_id(0).to(tl.int64) * W + offs, v, mask=mask)

    return triton, gather_rows_kernel


def gather_rows(table: torch.Tensor, ids: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """`table[ids]` as a new tensor on `ids`' device: table [V, W] contiguous (on that device,
    or in host memory that `register_mapped` made device-addressable), ids [N] int32/int64 in
    [0, V) (not checked: the kernel reads them on the device)."""
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous [V, W] tensor, got {tuple(table.shape)}")
    if ids.dim() != 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"ids must be [N] int32/int64, got {ids.dtype} {tuple(ids.shape)}")
    n, width = ids.numel(), table.shape[1]
    out = torch.empty(n, width, dtype=table.dtype, device=ids.device)
    if n == 0:
        return out
    # NOTE: 4-byte words when a row allows it: fewer, wider PCIe reads
    word = torch.int32 if (width * table.element_size()) % 4 == 0 else table.dtype
    src, dst = table.view(word), out.view(word)
    triton, kernel = _kernel()
    w = src.shape[1]
    kernel[(n, triton.cdiv(w, block))](src, ids, dst, w, BLOCK=block, num_warps=4)
    return out

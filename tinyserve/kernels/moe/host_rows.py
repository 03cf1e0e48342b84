"""Host memory a GPU kernel can read, and row copies from it (no host sync, graph-capturable).

`register_mapped(t)` page-locks a CPU tensor (cudaHostRegister, portable + mapped) so kernels
read it over PCIe (zero-copy); `copy_rows` copies listed rows into listed rows (the expert
cache's misses) and `gather_rows` embeds tokens from a host table. Triton loads on first use."""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from tinyserve.log import get_logger

log = get_logger(__name__)

_PORTABLE_MAPPED = 0x01 | 0x02  # cudaHostRegisterPortable | cudaHostRegisterMapped


def register_mapped(t: torch.Tensor, what: str,
                    on_progress: Callable[[int], None] | None = None) -> bool:
    """Page-lock and map contiguous CPU tensor `t` for every device while it lives; False,
    with a warning naming `what`, when CUDA refuses (`t` stays pageable). NOTE: one
    registration of the whole range: a copy whose source spans two is refused."""
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
    if on_progress is not None:
        on_progress(size)
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
    def copy_rows_kernel(src_ptr, rows_ptr, dst_ptr, dst_rows_ptr, W, HAS_DST_ROWS: tl.constexpr,
                         BLOCK: tl.constexpr):
        i = tl.program_id(0)
        row = tl.load(rows_ptr + i).to(tl.int64)
        if HAS_DST_ROWS:
            dst_row = tl.load(dst_rows_ptr + i).to(tl.int64)
        else:
            dst_row = i.to(tl.int64)
        if row >= 0:
            offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < W
            v = tl.load(src_ptr + row * W + offs, mask=mask)
            tl.store(dst_ptr + dst_row * W + offs, v, mask=mask)

    return triton, copy_rows_kernel


def _index_list(t: torch.Tensor, name: str) -> None:
    if t.dim() != 1 or t.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name} must be [N] int32/int64, got {t.dtype} {tuple(t.shape)}")


def copy_rows(src: torch.Tensor, dst: torch.Tensor, rows: torch.Tensor,
              dst_rows: torch.Tensor | None = None, *, block: int = 1024) -> None:
    """dst[dst_rows[i]] = src[rows[i]] (dst[i] without `dst_rows`) for every rows[i] >= 0, in
    one launch on dst's device; src on that device or `register_mapped`; rows / dst_rows [N]
    int on the device, in range (not checked)."""
    if src.shape[1:] != dst.shape[1:] or src.dtype != dst.dtype:
        raise ValueError(f"rows differ: src {src.dtype} {tuple(src.shape)}, dst {dst.dtype} "
                         f"{tuple(dst.shape)}")
    if not (src.is_contiguous() and dst.is_contiguous()):
        raise ValueError("src and dst must be contiguous")
    _index_list(rows, "rows")
    if dst_rows is not None:
        _index_list(dst_rows, "dst_rows")
        if dst_rows.numel() != rows.numel():
            raise ValueError(f"{rows.numel()} rows but {dst_rows.numel()} destination rows")
    n = rows.numel()
    if n == 0 or src.numel() == 0:
        return
    # NOTE: 4-byte words when a row allows it: fewer, wider PCIe reads
    row_bytes = src[0].numel() * src.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else src.dtype
    a, b = src.view(src.shape[0], -1).view(word), dst.view(dst.shape[0], -1).view(word)
    triton, kernel = _kernel()
    w = a.shape[1]
    kernel[(n, triton.cdiv(w, block))](a, rows, b, dst_rows if dst_rows is not None else rows,
                                      w, HAS_DST_ROWS=dst_rows is not None, BLOCK=block,
                                      num_warps=4)


def gather_rows(table: torch.Tensor, ids: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """`table[ids]` as a new tensor on `ids`' device: table [V, W] contiguous (on that device,
    or in host memory that `register_mapped` made device-addressable), ids [N] int32/int64 in
    [0, V) (not checked: the kernel reads them on the device)."""
    if table.dim() != 2 or not table.is_contiguous():
        raise ValueError(f"table must be a contiguous [V, W] tensor, got {tuple(table.shape)}")
    _index_list(ids, "ids")
    out = torch.empty(ids.numel(), table.shape[1], dtype=table.dtype, device=ids.device)
    copy_rows(table, out, ids, block=block)
    return out

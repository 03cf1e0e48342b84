"""Launch arithmetic shared by the kernels: grid sizes, SM count, the split-K workspace of the
linear kernels and the launch options of the kernels that round like torch."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable

import torch

from tinyserve import envs

# Launch options of the elementwise kernels whose contract is torch's rounding points
# (`kernels.norm`, `kernels.glue`): no floating-point contraction. With it Triton turns
# dt(dt(a * b) + c) into one bf16 FMA and drops the inner rounding (sm_90 PTX `fma.rn.bf16`),
# and a few percent of the RMSNorm+RoPE outputs differ from torch by a rounding step.
ROUNDING_AS_TORCH = {"enable_fp_fusion": False}

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
SCRATCH_ELEMS = 1 << 24  # dequantize + cuBLAS: scratch cap (32 MiB in bf16)


def host_event(device: torch.device) -> torch.cuda.Event | None:
    """An event a host thread waits on for a copy into or out of pinned memory (None off
    CUDA). Blocking: the waiting thread sleeps instead of spinning on a core, which the CPU
    expert kernel's threads and the server's need (a laptop has few). The engine waits on
    a step while the next one is already queued, so the later wake-up costs no GPU time."""
    return torch.cuda.Event(blocking=True) if device.type == "cuda" else None


def check_pages(page_table: torch.Tensor, seq_lens: torch.Tensor, b: int) -> None:
    """The paged decode kernels' page table (int32 [B, P], rows contiguous) and lengths (int32
    [B]); ValueError otherwise."""
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("page_table and seq_lens must be int32")
    if page_table.dim() != 2 or page_table.shape[0] != b or seq_lens.shape != (b,) \
            or page_table.stride(1) != 1:
        raise ValueError(f"page_table [{b}, P] (rows contiguous) and seq_lens [{b}] expected")


def decode_output(out: torch.Tensor | None, q: torch.Tensor, b: int, hq: int,
                  d: int) -> torch.Tensor:
    """Where a decode kernel writes [B, Hq, D]: a new tensor in q's dtype, or `out` (a float
    tensor on q's device of that shape with contiguous rows, else ValueError)."""
    if out is None:
        return torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    if out.dtype not in FLOATS or out.device != q.device:
        raise ValueError(f"out must be a float tensor on {q.device}, got {out.dtype} on "
                         f"{out.device}")
    if out.shape != (b, hq, d) or out.stride(2) != 1 or out.stride(1) != d:
        raise ValueError(f"out must be [{b}, {hq}, {d}] with contiguous rows")
    return out


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(v: int) -> int:
    """The smallest power of two >= v (1 for v <= 1)."""
    return 1 << max(0, v - 1).bit_length()


@functools.cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: few programs
    return torch.cuda.get_device_properties(device).multi_processor_count


def target_arch(device: torch.device) -> int:
    """The architecture the kernels on `device` are built for (86 for sm_86):
    TINYSERVE_CUDA_ARCH when set, else the device's compute capability."""
    raw = envs.CUDA_ARCH.get().strip().lower()
    if raw:
        m = re.fullmatch(r"(?:sm_?)?(\d{2,3})", raw)
        if not m:
            raise ValueError(f"TINYSERVE_CUDA_ARCH={raw!r}: expected sm_80, sm_86, 89, ...")
        return int(m.group(1))
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def dependent_launch(device: torch.device) -> bool:
    """Whether kernels on `device` may be programmatic dependent launches (started while the
    previous kernel runs, waiting with `griddepcontrol.wait`): `target_arch` sm_90+."""
    return device.type == "cuda" and target_arch(device) >= 90


def dot_tiles(num_m: int, n: int, k: int, block_n: int, block_k: int,
              target: int) -> tuple[int, int, int]:
    """(block_n, split, k_split) of a tiled dot: halve block_n (down to 16), then double the K
    splits (of k_split inputs, a multiple of block_k) while there are fewer than `target`
    tiles."""
    while block_n > 16 and num_m * cdiv(n, block_n) < target:
        block_n //= 2
    split = 1
    while num_m * cdiv(n, block_n) * split < target and k // (split * 2) >= block_k:
        split *= 2
    k_split = cdiv(cdiv(k, split), block_k) * block_k
    return block_n, cdiv(k, k_split), k_split


def split_k_output(split: int, m: int, n: int, x: torch.Tensor) -> torch.Tensor:
    """The kernel's output: [M, N] in x's dtype, or the fp32 workspace [split, M, N]."""
    if split == 1:
        return torch.empty(m, n, device=x.device, dtype=x.dtype)
    return torch.empty(split, m, n, device=x.device, dtype=torch.float32)


def split_k_result(out: torch.Tensor, split: int, dtype: torch.dtype) -> torch.Tensor:
    """[M, N] in `dtype` from what `split_k_output` gave the kernel."""
    return out if split == 1 else out.sum(0).to(dtype)


def dequant_matmul(x: torch.Tensor, dequantize: Callable[..., torch.Tensor], n: int,
                   k: int) -> torch.Tensor:
    """x [M, K] @ W.T for an [N, K] weight that `dequantize(dtype, rows=(r0, r1))` expands to
    a scratch in x's dtype, in row chunks of at most SCRATCH_ELEMS elements (then cuBLAS)."""
    chunk = max(64, SCRATCH_ELEMS // k // 64 * 64)
    if chunk >= n:
        return x @ dequantize(x.dtype).T
    out = torch.empty(x.shape[0], n, device=x.device, dtype=x.dtype)
    for r0 in range(0, n, chunk):
        r1 = min(n, r0 + chunk)
        out[:, r0:r1] = x @ dequantize(x.dtype, rows=(r0, r1)).T
    return out

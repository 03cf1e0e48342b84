"""The GPU side of a CPU expert call (`offload.hybrid.CpuExperts`), read and written in place in
pinned host memory: no copy-engine transfer, one kernel each way.

`write_request` writes a decode layer's request row by row into the pinned stage the CPU worker
reads (float32 [N, H + 2k]: x | expert ids of the pairs whose slot is < 0, else -1, as int32
bits | weights) and returns the GPU part's pairs (those pairs at slot 0 with weight 0);
`add_answer` adds the worker's float32 answer [N, H], read from pinned memory with
system-scope (volatile) loads so no cached line of an earlier answer is seen, to the GPU part's
output (float32: the layer's sum is rounded once) in fp32 and rounds to the layer's dtype.
Triton (the interpreter on CPU tensors); the `_ref` functions are the torch references."""

from __future__ import annotations

import functools

import torch

BLOCK = 256  # elements per program: several programs per row read the answer in parallel


def gpu_part_ref(slot_ids: torch.Tensor, weights: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The GPU part's pairs: where(slot_ids < 0, 0, slot_ids), where(slot_ids < 0, 0, weights)."""
    on_cpu = slot_ids < 0
    return torch.where(on_cpu, 0, slot_ids), torch.where(on_cpu, 0, weights)


def write_request_ref(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor,
                      weights: torch.Tensor, stage: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """stage[:] = x | where(slot_ids < 0, ids, -1) (int32 bits) | weights, in float32;
    returns `gpu_part_ref(slot_ids, weights)`."""
    rel = torch.where(slot_ids < 0, ids.to(torch.int32), -1)
    stage.copy_(torch.cat([x.float(), rel.view(torch.float32), weights.float()], dim=1))
    return gpu_part_ref(slot_ids, weights)


def add_answer_ref(out: torch.Tensor, answer: torch.Tensor,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """(out + answer) in fp32, rounded to `dtype` (None: out's)."""
    return (out.float() + answer.to(out.device)).to(dtype or out.dtype)


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def write_request_kernel(x_ptr, ids_ptr, slot_ptr, w_ptr, stage_ptr, stage_bits_ptr,
                             gpu_slot_ptr, gpu_w_ptr, H, K, BLOCK: tl.constexpr,
                             BLOCK_K: tl.constexpr):
        n = tl.program_id(0)
        part = tl.program_id(1)
        W = H + 2 * K
        offs = part * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        v = tl.load(x_ptr + n * H + offs, mask=mask).to(tl.float32)
        tl.store(stage_ptr + n * W + offs, v, mask=mask)
        if part == 0:
            offs_k = tl.arange(0, BLOCK_K)
            kmask = offs_k < K
            ids = tl.load(ids_ptr + n * K + offs_k, mask=kmask, other=0).to(tl.int32)
            slot = tl.load(slot_ptr + n * K + offs_k, mask=kmask, other=0)
            on_cpu = slot < 0
            tl.store(stage_bits_ptr + n * W + H + offs_k, tl.where(on_cpu, ids, -1), mask=kmask)
            w = tl.load(w_ptr + n * K + offs_k, mask=kmask, other=0.0)
            tl.store(stage_ptr + n * W + H + K + offs_k, w.to(tl.float32), mask=kmask)
            tl.store(gpu_slot_ptr + n * K + offs_k, tl.where(on_cpu, 0, slot), mask=kmask)
            tl.store(gpu_w_ptr + n * K + offs_k, tl.where(on_cpu, 0.0, w), mask=kmask)

    @triton.jit
    def add_answer_kernel(out_ptr, answer_ptr, res_ptr, H, BLOCK: tl.constexpr):
        n = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < H
        a = tl.load(out_ptr + n * H + offs, mask=mask).to(tl.float32)
        b = tl.load(answer_ptr + n * H + offs, mask=mask, volatile=True)
        tl.store(res_ptr + n * H + offs, (a + b).to(res_ptr.dtype.element_ty), mask=mask)

    return triton, write_request_kernel, add_answer_kernel


def _check_pairs(x: torch.Tensor, *pairs: torch.Tensor) -> tuple[int, int, int]:
    if x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [N, H] tensor, got {tuple(x.shape)}")
    n, h = x.shape
    k = pairs[0].shape[-1]
    for t in pairs:
        if t.shape != (n, k) or not t.is_contiguous():
            raise ValueError(f"ids, slot_ids and weights must be contiguous [{n}, k], got "
                             f"{tuple(t.shape)}")
    return n, h, k


def write_request(x: torch.Tensor, ids: torch.Tensor, slot_ids: torch.Tensor,
                  weights: torch.Tensor, stage: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the request of x [N, H] float and the pairs ids (int), slot_ids (int32), weights
    (float) [N, k] (all contiguous, on one device) into `stage` (float32 [N, H + 2k],
    contiguous: on the CPU, or pinned host memory a kernel on x's device writes), in stream
    order. Returns the GPU part's (slot_ids, weights), new tensors on x's device: the CPU's
    pairs at slot 0 with weight 0. ValueError on other shapes."""
    n, h, k = _check_pairs(x, ids, slot_ids, weights)
    if stage.shape != (n, h + 2 * k) or stage.dtype != torch.float32 or not stage.is_contiguous():
        raise ValueError(f"stage must be contiguous float32 [{n}, {h + 2 * k}], got "
                         f"{stage.dtype} {tuple(stage.shape)}")
    if slot_ids.dtype != torch.int32:
        raise ValueError(f"slot_ids must be int32, got {slot_ids.dtype}")
    triton, kernel, _ = _kernels()
    gpu_slots, gpu_weights = torch.empty_like(slot_ids), torch.empty_like(weights)
    kernel[(n, triton.cdiv(h, BLOCK))](x, ids, slot_ids, weights, stage,
                                       stage.view(torch.int32), gpu_slots, gpu_weights, h, k,
                                       BLOCK=BLOCK, BLOCK_K=triton.next_power_of_2(k),
                                       num_warps=4)
    return gpu_slots, gpu_weights


def add_answer(out: torch.Tensor, answer: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """(out + answer) in fp32 rounded to `dtype` (None: out's), as a new tensor on out's
    device: out [N, H] float, contiguous; answer float32 [N, H] contiguous, on the CPU (pinned,
    when out is on a GPU: the kernel reads it in place, in stream order). ValueError
    otherwise."""
    if out.dim() != 2 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [N, H] tensor, got {tuple(out.shape)}")
    if answer.shape != out.shape or answer.dtype != torch.float32 or not answer.is_contiguous():
        raise ValueError(f"answer must be contiguous float32 {list(out.shape)}, got "
                         f"{answer.dtype} {tuple(answer.shape)}")
    triton, _, kernel = _kernels()
    n, h = out.shape
    res = torch.empty_like(out, dtype=dtype or out.dtype)
    kernel[(n, triton.cdiv(h, BLOCK))](out, answer, res, h, BLOCK=BLOCK, num_warps=4)
    return res

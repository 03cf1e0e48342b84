"""MoE router in one Triton kernel (one program per token): fp32 softmax, top-k, renormalise,
cast to the model dtype (reference: `model.moe.topk_softmax_ref`). Ties take the lower expert
id first; a row with a NaN or +inf logit gets k distinct ids (lowest first) and NaN weights,
so the ids can always index expert slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def topk_softmax_kernel(logits_ptr, ids_ptr, w_ptr, E, stride_l, K: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    m = cols < E
    x = tl.load(logits_ptr + row * stride_l + cols, mask=m, other=float("-inf")).to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))  # masked columns: exp(-inf) = 0
    p = e / tl.sum(e, axis=0)
    # NOTE: a NaN or +inf logit makes the whole row NaN; NaN ranks above every probability
    # (as in torch.topk) so the k ids stay distinct real experts, and the weights come out NaN
    is_nan = m & (p != p)
    row_nan = tl.max(is_nan.to(tl.int32), axis=0)
    p = tl.where(m, tl.where(is_nan, 2.0, p), -1.0)  # masked columns: never chosen
    kk = tl.arange(0, BLOCK_K)
    top_p = tl.zeros([BLOCK_K], dtype=tl.float32)
    top_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, axis=0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), axis=0)  # lowest id among ties
        top_p = tl.where(kk == j, best, top_p)
        top_i = tl.where(kk == j, idx, top_i)
        p = tl.where(cols == idx, -1.0, p)
    w = top_p / tl.sum(top_p, axis=0)  # entries past K are 0
    w = tl.where(row_nan > 0, float("nan"), w)
    mk = kk < K
    tl.store(ids_ptr + row * K + kk, top_i.to(tl.int64), mask=mk)
    tl.store(w_ptr + row * K + kk, w.to(w_ptr.dtype.element_ty), mask=mk)


def topk_softmax(logits: torch.Tensor, top_k: int,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [N, E] (unit column stride; any row stride, e.g. the first E columns of
    a wider projection) -> (ids [N, k] int64, weights [N, k] in `dtype`, summing to 1)."""
    if logits.dim() != 2 or logits.stride(-1) != 1:
        raise ValueError(f"logits must be [N, E] with unit column stride, got "
                         f"{list(logits.shape)} strides {logits.stride()}")
    n, e = logits.shape
    if not 0 < top_k <= e:
        raise ValueError(f"top_k {top_k} must be in (0, {e}]")
    ids = torch.empty(n, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(n, top_k, dtype=dtype, device=logits.device)
    if n:
        block_e = triton.next_power_of_2(e)
        topk_softmax_kernel[(n,)](logits, ids, weights, e, logits.stride(0), K=top_k,
                                  BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
                                  num_warps=max(1, min(4, block_e // 128)))
    return ids, weights

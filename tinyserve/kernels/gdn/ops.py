"""Gated DeltaNet entry points over the GDN state pool (read and written IN PLACE by slot).

Each runs Triton on CUDA tensors, the references of `ref.py` otherwise (`backend=` forces one):
`causal_conv1d_update` / `causal_conv1d_prefill` (varlen), `gdn_decode` (one token per
sequence), `gdn_prefill` (varlen, chunked form, or recurrent with `method="recurrent"` and as
the fallback when the chunk kernel fails to build). The kernels fuse the l2norm of q and k,
q * dk**-0.5, g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b) and the GQA grouping;
state math is fp32. Sequences without `has_initial_state` start from zeros."""

from __future__ import annotations

import torch

from tinyserve import envs
from tinyserve.kernels.gdn import chunk as _gdn_chunk
from tinyserve.kernels.gdn import config as _gdn_config
from tinyserve.kernels.gdn import ref as gdn_ref
from tinyserve.kernels.gdn.config import check, last_contig, strides
from tinyserve.kernels.launch import cdiv, next_pow2
from tinyserve.log import get_logger

log = get_logger(__name__)

_CONV_BLOCK_C = 256
_CONV_BLOCK_T = 16
_chunk_broken = False  # the chunk kernel failed to build: the recurrent one runs from then on


def _use_triton(backend: str, *tensors: torch.Tensor) -> bool:
    if backend == "auto":
        return all(t.is_cuda for t in tensors) and not envs.DISABLE_KERNELS.get()
    if backend not in ("triton", "torch"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch', not {backend!r}")
    return backend == "triton"


def _one_device(*ts: torch.Tensor) -> None:
    # the Triton kernels read every tensor by pointer
    dev = ts[0].device
    check(all(t.device == dev for t in ts), f"GDN kernel inputs must all be on {dev}, got "
           f"{sorted({str(t.device) for t in ts})}")


def _out(out: torch.Tensor | None, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    check(tuple(out.shape) == tuple(shape) and out.dtype == like.dtype
           and out.is_contiguous(), f"out must be contiguous {shape} {like.dtype}")
    return out


def _check_conv(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor) -> int:
    """The conv width K of weight [C, K] for x [*, C] and conv_pool [slots, C, K-1]."""
    C, K = x.shape[1], weight.shape[1]
    check(weight.shape == (C, K), f"weight {tuple(weight.shape)} != ({C}, {K})")
    check(conv_pool.dim() == 3 and conv_pool.shape[1:] == (C, K - 1),
           f"conv_pool {tuple(conv_pool.shape)} != [slots, {C}, {K - 1}]")
    return K


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                         slots: torch.Tensor, *, out: torch.Tensor | None = None,
                         backend: str = "auto") -> torch.Tensor:
    """One decode step of the depthwise causal conv + SiLU, the conv state updated in place.
    x [B, C], weight [C, K], conv_pool [slots, C, K-1] (oldest first), slots [B] (distinct).
    Returns y [B, C] in x.dtype (into `out` when given)."""
    B, C = x.shape
    K = _check_conv(x, weight, conv_pool)
    check(slots.shape == (B,), f"slots {tuple(slots.shape)} != ({B},)")
    y = _out(out, (B, C), x)
    if not _use_triton(backend, x, conv_pool):
        for i, s in enumerate(slots.tolist()):
            yi, st = gdn_ref.causal_conv1d_ref(x[i:i + 1], weight, conv_pool[s])
            y[i] = yi[0]
            conv_pool[s] = st
        return y
    check(conv_pool.stride(2) == 1, "conv_pool needs a contiguous last dim")
    _one_device(x, weight, conv_pool, slots, y)
    x, weight = last_contig(x), weight.contiguous()
    from tinyserve.kernels.gdn import triton as gdn_triton

    grid = (B, cdiv(C, _CONV_BLOCK_C))
    gdn_triton.conv1d_update_kernel[grid](
        x, weight, conv_pool, slots, y, C,
        x.stride(0), conv_pool.stride(0), conv_pool.stride(1), y.stride(0),
        K=K, KP=next_pow2(K - 1), BLOCK_C=_CONV_BLOCK_C, num_warps=4)
    return y


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_pool: torch.Tensor,
                          slots: torch.Tensor, cu_seqlens: torch.Tensor,
                          has_initial_state: torch.Tensor, *, out: torch.Tensor | None = None,
                          backend: str = "auto") -> torch.Tensor:
    """Depthwise causal conv + SiLU over a varlen batch x [T, C] (cu_seqlens [B+1] int32),
    each slot's state read (where has_initial_state) and left holding its last K-1 inputs."""
    T, C = x.shape
    K = _check_conv(x, weight, conv_pool)
    B = slots.shape[0]
    check(cu_seqlens.shape == (B + 1,) and has_initial_state.shape == (B,),
           "cu_seqlens must be [B+1] and has_initial_state [B]")
    y = _out(out, (T, C), x)
    if not _use_triton(backend, x, conv_pool):
        cu = cu_seqlens.tolist()
        for i, (s, init) in enumerate(zip(slots.tolist(), has_initial_state.tolist(), strict=True)):
            st = conv_pool[s] if init else torch.zeros_like(conv_pool[s])
            y[cu[i]:cu[i + 1]], conv_pool[s] = gdn_ref.causal_conv1d_ref(
                x[cu[i]:cu[i + 1]], weight, st)
        return y
    check(conv_pool.stride(2) == 1, "conv_pool needs a contiguous last dim")
    _one_device(x, weight, conv_pool, slots, cu_seqlens, has_initial_state, y)
    x, weight = last_contig(x), weight.contiguous()
    cu = cu_seqlens.to(torch.int32)
    init = has_initial_state.to(torch.int32)
    # [T] sequence of each token, without a host synchronisation
    seq_ids = torch.searchsorted(cu[1:], torch.arange(T, dtype=torch.int32, device=x.device),
                                 right=True).to(torch.int32)
    from tinyserve.kernels.gdn import triton as gdn_triton

    if T > 0:
        grid = (cdiv(T, _CONV_BLOCK_T), cdiv(C, _CONV_BLOCK_C))
        gdn_triton.conv1d_varlen_kernel[grid](
            x, weight, conv_pool, slots, cu, init, seq_ids, y, T, C,
            x.stride(0), conv_pool.stride(0), conv_pool.stride(1), y.stride(0),
            K=K, BLOCK_T=_CONV_BLOCK_T, BLOCK_C=_CONV_BLOCK_C, num_warps=4)
    # NOTE: a second launch, so no program overwrites a state another one still reads.
    grid = (B, cdiv(C, _CONV_BLOCK_C))
    gdn_triton.conv1d_state_writeback_kernel[grid](
        x, conv_pool, slots, cu, init, C,
        x.stride(0), conv_pool.stride(0), conv_pool.stride(1),
        K=K, KP=next_pow2(K - 1), BLOCK_C=_CONV_BLOCK_C, num_warps=4)
    return y


def _prep_qk(q: torch.Tensor, k: torch.Tensor, Hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """l2norm (eps 1e-6), q * dk**-0.5, key heads repeated to Hv; fp32 [N, Hv, dk]."""
    def l2(u: torch.Tensor) -> torch.Tensor:
        u = u.float()
        return u * torch.rsqrt((u * u).sum(-1, keepdim=True) + 1e-6)

    G = Hv // q.shape[1]
    qn = l2(q) * q.shape[-1] ** -0.5
    return qn.repeat_interleave(G, dim=1), l2(k).repeat_interleave(G, dim=1)


def _check_gdn(q, k, v, a, b, A_log, dt_bias, pool, slots) -> tuple[int, int, int, int, int]:
    N, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    check(k.shape == q.shape, f"k {tuple(k.shape)} != q {tuple(q.shape)}")
    check(v.shape[0] == N and Hv % Hk == 0, f"v {tuple(v.shape)} does not fit q {(N, Hk)}")
    check(a.shape == (N, Hv) and b.shape == (N, Hv), f"a, b must be [{N}, {Hv}]")
    check(A_log.shape == (Hv,) and dt_bias.shape == (Hv,), f"A_log, dt_bias must be [{Hv}]")
    check(pool.dim() == 4 and pool.shape[1:] == (Hv, dk, dv),
           f"recurrent_pool {tuple(pool.shape)} != [slots, {Hv}, {dk}, {dv}]")
    check(pool.dtype == torch.float32, f"recurrent_pool must be float32, not {pool.dtype}")
    check(slots.dim() == 1, "slots must be 1-D")
    return N, Hk, Hv, dk, dv


def _gdn_torch(q, k, v, a, b, A_log, dt_bias, pool, slots, cu, init, y, chunked) -> None:
    g = -A_log.float().exp() * torch.nn.functional.softplus(a.float() + dt_bias.float())
    beta = b.float().sigmoid()  # g and beta fp32 [N, Hv]
    qn, kn = _prep_qk(q, k, v.shape[1])
    fn = gdn_ref.chunk_gated_delta_rule_ref if chunked else gdn_ref.recurrent_gated_delta_rule_ref
    for i, (s, has) in enumerate(zip(slots.tolist(), init, strict=True)):
        lo, hi = cu[i], cu[i + 1]
        st = pool[s] if has else torch.zeros_like(pool[s])
        if hi == lo:  # an empty sequence keeps (or zeroes) its state, like the kernels
            pool[s] = st
            continue
        o, new = fn(qn[lo:hi], kn[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], st)
        y[lo:hi] = o.to(y.dtype)
        pool[s] = new


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               recurrent_pool: torch.Tensor, slots: torch.Tensor, *,
               out: torch.Tensor | None = None, backend: str = "auto",
               block_v: int = 32) -> torch.Tensor:
    """One gated-delta-rule step per sequence, its state updated in place in its slot.

    Args:
        q, k: [B, Hk, dk] raw post-conv; v: [B, Hv, dv]; a, b: [B, Hv] raw gate projections;
        A_log, dt_bias: [Hv]; recurrent_pool: [slots, Hv, dk, dv] fp32; slots: [B] distinct.
    Returns o [B, Hv, dv] in v.dtype.
    """
    B, Hk, Hv, dk, dv = _check_gdn(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots)
    check(slots.shape == (B,), f"slots {tuple(slots.shape)} != ({B},)")
    y = _out(out, (B, Hv, dv), v)
    if not _use_triton(backend, q, recurrent_pool):
        _gdn_torch(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots,
                   list(range(B + 1)), [True] * B, y, chunked=False)
        return y
    _one_device(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots, y)
    return _launch_recurrent(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots,
                             None, None, y, block_v)


def _launch_recurrent(q, k, v, a, b, A_log, dt_bias, pool, slots, cu, init, y, block_v):
    from tinyserve.kernels.gdn import triton as gdn_triton

    B = slots.shape[0]
    Hk, dk = q.shape[1], q.shape[2]
    Hv, dv = v.shape[1], v.shape[2]
    q, k, v, a, b = (last_contig(t) for t in (q, k, v, a, b))
    check(pool.stride(3) == 1 and pool.stride(2) == dv, "recurrent_pool slots must be contiguous")
    BV = min(next_pow2(dv), block_v)
    grid = (B, Hv, cdiv(dv, BV))
    varlen = cu is not None
    gdn_triton.gdn_recurrent_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, pool, slots,
        cu if varlen else slots, init if varlen else slots, y,
        *strides(q, k, v, a, b, y), pool.stride(0), pool.stride(1),
        dk ** -0.5, Hv // Hk, dk, dv,
        IS_VARLEN=varlen, BK=next_pow2(dk), BV=BV, num_warps=4 if BV <= 32 else 8)
    return y


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                recurrent_pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
                has_initial_state: torch.Tensor, *, out: torch.Tensor | None = None,
                backend: str = "auto", method: str = "chunk", chunk_size: int = 64,
                block_v: int | None = None, dot_precision: str = "tf32x3",
                fallback: bool = True,
                chunk_config: _gdn_config.ChunkConfig | None = None) -> torch.Tensor:
    """Gated delta rule over a varlen batch (prefill chunks and decode rows mixed).

    Args: as `gdn_decode` over T tokens, plus cu_seqlens [B+1] int32 and has_initial_state
        [B] bool (false: a zero initial state, the slot not read).
        method: "chunk" (`chunk_size` a power of two >= 16; an fp32 workspace of
            T * Hv * chunk_size * 8 bytes) or "recurrent".
        block_v: dv tile (None: the chunk form picks one that fits shared memory).
        chunk_config: exactly this chunk config (benchmarks: no fallback).
        fallback: when no chunk config builds, log once and use the recurrent kernel from
            then on (False: raise).
        dot_precision: "tf32x3" (tensor cores, fp32-level accuracy), "ieee" or "tf32".
    Returns o [T, Hv, dv] in v.dtype; each final state is written to its slot.
    """
    T, Hk, Hv, dk, dv = _check_gdn(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots)
    B = slots.shape[0]
    check(cu_seqlens.shape == (B + 1,) and has_initial_state.shape == (B,),
           "cu_seqlens must be [B+1] and has_initial_state [B]")
    check(method in ("chunk", "recurrent"), "method must be 'chunk' or 'recurrent'")
    y = _out(out, (T, Hv, dv), v)
    if not _use_triton(backend, q, recurrent_pool):
        _gdn_torch(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots,
                   cu_seqlens.tolist(), has_initial_state.tolist(), y, method == "chunk")
        return y
    _one_device(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots, cu_seqlens,
                has_initial_state, y)
    cu = cu_seqlens.to(torch.int32)
    init = has_initial_state.to(torch.int32)
    global _chunk_broken
    if method == "chunk" and not _chunk_broken:
        try:
            return _gdn_chunk.launch_chunk(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots,
                                           cu, init, y, chunk_size, block_v, dot_precision,
                                           chunk_config)
        except Exception as e:  # noqa: BLE001 - a build failure falls back to the recurrence
            if not (fallback and _gdn_chunk.is_build_error(e)):
                raise
            log.warning("GDN chunk kernel failed to build (%s); using the recurrent kernel", e)
            _chunk_broken = True
    return _launch_recurrent(q, k, v, a, b, A_log, dt_bias, recurrent_pool, slots, cu, init,
                             y, block_v or 32)

"""The chunked-prefill launcher of the GDN kernels (called by `ops.gdn_prefill`): the device
chunk table and fp32 workspace, `gdn_chunk_prep_kernel` + `gdn_chunk_kernel`, walking down
`config.chunk_configs` when one does not fit the device (remembered per shape)."""

from __future__ import annotations

import os

import torch

from tinyserve.kernels.gdn import config as _gdn_config
from tinyserve.kernels.gdn.config import check, last_contig, strides
from tinyserve.kernels.launch import cdiv, next_pow2
from tinyserve.log import get_logger

log = get_logger(__name__)

# (device, chunk, dk, dv, block_v, precision, dtype) -> index of the first config that launched
_CHOSEN: dict[tuple, int] = {}


def chunk_configs_chosen() -> list[tuple[tuple, _gdn_config.ChunkConfig]]:
    """(launch key, config) of every chunk-kernel shape launched so far (for benchmarks)."""
    out = []
    for key, i in _CHOSEN.items():
        dev, BT, dk, dv, block_v, _, _ = key
        cfgs = _gdn_config.chunk_configs(dv, BT, max(next_pow2(dk), 16), block_v=block_v,
                                         smem_limit=smem_limit(dev))
        out.append((key, cfgs[i]))
    return out


def is_build_error(e: Exception) -> bool:
    """Whether `e` is triton failing to build or fit a kernel (not a bad argument)."""
    name = type(e).__name__
    mod = type(e).__module__ or ""
    return "triton" in mod or name in ("CompilationError", "OutOfResources",
                                       "CompileTimeAssertionFailure")


def smem_limit(device: torch.device) -> int:
    """Opt-in shared memory per block of `device` (bytes; the sm_90 limit without CUDA)."""
    try:
        props = torch.cuda.get_device_properties(device)
        return int(getattr(props, "shared_memory_per_block_optin", 0)
                   or _gdn_config.SM90_SMEM_BYTES)
    except Exception:  # noqa: BLE001 - no CUDA: the sm_90 limit
        return _gdn_config.SM90_SMEM_BYTES


def launch_chunk(q, k, v, a, b, A_log, dt_bias, pool, slots, cu, init, y, BT, block_v,
                 precision, forced=None):
    """Run the first config of `chunk_configs` that launches; an OutOfResources at launch
    (nothing has run then) moves to the next smaller one, logged once per shape."""
    dk, dv = q.shape[2], v.shape[2]
    check(BT >= 16 and BT == next_pow2(BT), f"chunk_size must be a power of two >= 16, not {BT}")
    check(precision in ("ieee", "tf32x3", "tf32"), f"bad dot precision {precision!r}")
    BK = max(next_pow2(dk), 16)
    cfgs = _gdn_config.chunk_configs(dv, BT, BK, block_v=block_v,
                                     smem_limit=smem_limit(q.device))
    key = (q.device, BT, dk, dv, block_v, precision, q.dtype)
    if forced is not None:
        cfgs, key = [forced], None
    i = _CHOSEN.get(key, 0)
    while True:
        cfg = cfgs[i]
        try:
            run_chunk(q, k, v, a, b, A_log, dt_bias, pool, slots, cu, init, y, cfg, BK,
                      precision)
            if key is not None:
                _CHOSEN[key] = i
            return y
        except Exception as e:  # noqa: BLE001 - only a resource error moves down the list
            size = _gdn_config.chunk_smem_bytes(cfg, BK)
            nxt = [j for j in range(i + 1, len(cfgs))
                   if _gdn_config.chunk_smem_bytes(cfgs[j], BK) < size]
            if type(e).__name__ != "OutOfResources" or not nxt:
                raise
            log.warning("GDN chunk config %s does not fit (%s); trying %s", cfg, e, cfgs[nxt[0]])
            i = nxt[0]


def run_chunk(q, k, v, a, b, A_log, dt_bias, pool, slots, cu, init, y, cfg, BK, precision):
    B = slots.shape[0]
    T, Hk, dk = q.shape
    Hv, dv = v.shape[1], v.shape[2]
    BT, BV = cfg.chunk, cfg.block_v
    q, k, v, a, b = (last_contig(t) for t in (q, k, v, a, b))
    check(pool.stride(3) == 1 and pool.stride(2) == dv, "recurrent_pool slots must be contiguous")
    from tinyserve.kernels.gdn import triton as gdn_triton

    # chunk table on the device (no host sync): chunk c -> (sequence, first token)
    max_chunks = cdiv(T, BT) + B
    nch = (cu[1:] - cu[:-1] + BT - 1) // BT  # [B]
    ccu = torch.cumsum(nch, 0).to(torch.int32)  # [B] end of each sequence's chunks
    ids = torch.arange(max_chunks, dtype=torch.int32, device=q.device)
    cseq = torch.searchsorted(ccu, ids, right=True).clamp_(max=B - 1).to(torch.int32)
    first = ccu[cseq] - nch[cseq]  # index of the sequence's first chunk
    cstart = torch.where(ids < ccu[-1], cu[cseq] + (ids - first) * BT, cu[cseq + 1])
    cstart = cstart.to(torch.int32)
    # [2, T, Hv, BT] fp32: row t of [0] holds Ti[t - chunk start, :] of its chunk, of [1] att
    ws = torch.empty(2, T, Hv, BT, dtype=torch.float32, device=q.device)
    ti, att = ws[0], ws[1]
    gdn_triton.gdn_chunk_prep_kernel[(max_chunks, Hv)](
        q, k, a, b, A_log, dt_bias, cseq, cstart, cu, ti, att,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), a.stride(0), b.stride(0),
        ti.stride(0), ti.stride(1), dk ** -0.5, Hv // Hk, dk,
        BT=BT, BK=BK, PREC=precision, NATIVE_QK=native_qk(q),
        NLEVELS=max((BT // 16).bit_length() - 1, 1), BLOCKED=cfg.blocked_inverse,
        num_warps=cfg.prep_warps, num_stages=1)
    grid = (B, Hv, cdiv(dv, BV))
    gdn_triton.gdn_chunk_kernel[grid](
        q, k, v, a, b, A_log, dt_bias, pool, slots, cu, init, ti, att, y,
        *strides(q, k, v, a, b, y), ti.stride(0), ti.stride(1), pool.stride(0),
        pool.stride(1), dk ** -0.5, Hv // Hk, dk, dv,
        BT=BT, BK=BK, BV=BV, PREC=precision, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)


def native_qk(q: torch.Tensor) -> bool:
    """16-bit q/k go into the prep kernel's dots as they are (not under the interpreter)."""
    return q.dtype in (torch.bfloat16, torch.float16) and os.environ.get("TRITON_INTERPRET") != "1"

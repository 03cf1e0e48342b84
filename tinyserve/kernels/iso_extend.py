"""ISO3/ISO4 extend attention: the queries of a prefill chunk over their packed prefix plus the
chunk's own bf16 K/V (causal). The prefix is dequantized once per layer into a scratch
(`iso_cuda.iso_dequant_rows`, bit-exact), attended with cuDNN / flash attention (GQA heads
stacked on the query axis, so the prefix is never repeated per head), and the two parts are
merged by their log-sum-exp; an fp32 fallback in query blocks when no backend runs.
"""

from __future__ import annotations

import torch

from tinyserve.kernels import iso_cuda
from tinyserve.log import get_logger

log = get_logger(__name__)


# Attention backends for the extend path, fastest first; one that fails is dropped for good.
EXTEND_BACKENDS = ["cudnn", "flash"]


def _lse_of(lse: torch.Tensor, heads: int, length: int) -> torch.Tensor:
    return lse.reshape(heads, -1)[:, :length].float()  # flash pads L; cuDNN may add a dim


_CHECKED: set[tuple] = set()


def _backend_call(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    if name == "cudnn":
        res = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q[None], k[None], v[None], None, True, 0.0, causal, False, scale=scale)
    else:
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q[None], k[None], v[None], 0.0, causal, False, scale=scale)
    return res[0][0], _lse_of(res[1], q.shape[0], q.shape[1])


def _check_backend(name: str, q: torch.Tensor, scale: float) -> None:
    """Once per (backend, device, dtype, head_dim): the output and LSE of a small causal and
    non-causal problem against fp32 math; raises RuntimeError on a mismatch."""
    key = (name, q.device, q.dtype, q.shape[-1])
    if key in _CHECKED:
        return
    gen = torch.Generator(device=q.device).manual_seed(0)
    for causal, (lq, lk) in ((True, (48, 48)), (False, (40, 72))):
        qq = torch.randn(2, lq, q.shape[-1], device=q.device, generator=gen).to(q.dtype)
        kk = torch.randn(2, lk, q.shape[-1], device=q.device, generator=gen).to(q.dtype)
        vv = torch.randn(2, lk, q.shape[-1], device=q.device, generator=gen).to(q.dtype)
        o, lse = _backend_call(name, qq, kk, vv, causal, scale)
        sc = (qq.float() @ kk.float().transpose(1, 2)) * scale
        if causal:
            sc = sc.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=q.device)
                                .triu(1), float("-inf"))
        ref_lse = torch.logsumexp(sc, -1)
        ref_o = torch.softmax(sc, -1) @ vv.float()
        if not (torch.allclose(lse, ref_lse, atol=2e-2, rtol=1e-2)
                and torch.allclose(o.float(), ref_o, atol=3e-2, rtol=3e-2)):
            raise RuntimeError(f"{name}: output or LSE differs from fp32 math "
                               f"(max LSE error {(lse - ref_lse).abs().max().item():.3g})")
    _CHECKED.add(key)


def _attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                scale: float, prefer: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, L, D], k/v [H, S, D] (same H) -> (out [H, L, D] in q's dtype, natural-log LSE
    fp32 [H, L]). Tries `prefer`, then EXTEND_BACKENDS in order (each checked once against
    fp32 math), then an fp32 fallback in query blocks."""
    length = q.shape[1]
    order = sorted(EXTEND_BACKENDS, key=lambda n: n != prefer)
    for name in order:
        try:
            if q.is_cuda:
                _check_backend(name, q, scale)
            return _backend_call(name, q, k, v, causal, scale)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            log.info("extend attention backend %s unavailable (%s); dropping it", name,
                     str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__)
            EXTEND_BACKENDS.remove(name)
    outs, lses = [], []
    kf, vf = k.float(), v.float()
    for s in range(0, length, 64):  # fp32 fallback in query blocks
        qb = q[:, s:s + 64].float()
        sc = (qb @ kf.transpose(1, 2)) * scale
        if causal:
            rows = torch.arange(s, s + qb.shape[1], device=q.device)[:, None]
            sc = sc.masked_fill(torch.arange(k.shape[1], device=q.device)[None] > rows,
                                float("-inf"))
        lse = torch.logsumexp(sc, dim=-1)
        outs.append(torch.exp(sc - lse[..., None]) @ vf)
        lses.append(lse)
    return torch.cat(outs, 1).to(q.dtype), torch.cat(lses, 1)


def iso_extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                         cu_seqlens: torch.Tensor, q_lens: list[int], prefix_lens: list[int],
                         page_size: int, fmt: str, scale: float) -> torch.Tensor:
    """Prefill chunks: q [N, Hq, D] over each sequence's packed prefix and its own k, v
    [N, Hkv, D] (causal). Does not store anything. Returns [N, Hq, D] in q's dtype.

    Without a prefix this is one SDPA call (GQA, causal: the same kernel as the bf16 path).
    With one, the prefix is dequantized once per layer straight into head-major [Hkv, P, D]
    rows, attended non-causally with the group's query heads stacked on the query axis (no
    per-head copy of the prefix), the chunk attends causally to itself, and the two results
    are merged by their log-sum-exp (one lerp)."""
    iso_cuda.format_bits(fmt)  # (checks the format)
    n_tok, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    out = torch.empty_like(q)
    start = 0
    for b, (n, prefix) in enumerate(zip(q_lens, prefix_lens, strict=True)):
        if n == 0:
            continue
        qs = q[start:start + n].transpose(0, 1)  # [Hq, n, D] view
        ks = k[start:start + n].transpose(0, 1).to(q.dtype)  # [Hkv, n, D]
        vs = v[start:start + n].transpose(0, 1).to(q.dtype)
        if prefix == 0:
            o = torch.nn.functional.scaled_dot_product_attention(
                qs[None], ks[None], vs[None], is_causal=True, scale=scale,
                enable_gqa=group > 1)[0]
        else:
            ke = ks.repeat_interleave(group, 0) if group > 1 else ks
            ve = vs.repeat_interleave(group, 0) if group > 1 else vs
            # a chunk as long as its prefix (same key length in both cuDNN calls) ran 3x
            # slower on the H200 (prefix 2048: 0.59 ms vs 0.22 ms of parts; a plan rebuilt
            # per call?): then the chunk goes to flash
            o_new, lse_new = _attend_lse(qs, ke, ve, True, scale,
                                         prefer="flash" if n == prefix else None)
            t = torch.arange(prefix, device=q.device)
            slots = page_table[b].long()[t // page_size] * page_size + t % page_size
            kp = iso_cuda.iso_dequant_rows(k_cache, slots, fmt, d, q.dtype, head_major=True)
            vp = iso_cuda.iso_dequant_rows(v_cache, slots, fmt, d, q.dtype, head_major=True)
            qg = qs.reshape(hkv, group * n, d)  # the group's heads stacked on the query axis
            o_pre, lse_pre = _attend_lse(qg, kp, vp, False, scale)
            o_pre, lse_pre = o_pre.reshape(hq, n, d), lse_pre.reshape(hq, n)
            w = torch.sigmoid(lse_pre - lse_new).to(o_new.dtype)[..., None]
            o = torch.lerp(o_new, o_pre.to(o_new.dtype), w)
        out[start:start + n] = o.transpose(0, 1)
        start += n
    return out

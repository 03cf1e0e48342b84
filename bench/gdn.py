"""Gated DeltaNet kernels on one CUDA GPU, Qwen3.5-35B-A3B shapes, one GDN layer.

Decode (batch 1 and 8): time per layer per token of `causal_conv1d_update` + `gdn_decode`
(CUDA graph, median) against the state bytes they must read and write, as a fraction of the
device copy bandwidth measured in the same run. Prefill (4k and 30k tokens, one sequence, and a
mixed batch): tokens/s of the chunked and the recurrent Triton kernels. Baseline: the pure-torch
references (`backend="torch"`) on the same GPU in the same run (the recurrent reference on a
1k-token prefix only: it is one Python step per token). Each case records its own failure and
the rest go on.

    python bench/gdn.py [--quick]      -> bench/results/gdn.json
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import Recorder, median_ms, run_meta  # noqa: E402  (bench/ is on sys.path as a script)

from tinyserve.kernels import gdn  # noqa: E402

Hk, Hv, DK, DV, C, K = 16, 32, 128, 128, 8192, 4
DTYPE = torch.bfloat16
NUM_SLOTS = 16
OUT = Path(__file__).resolve().parent / "results" / "gdn.json"


def _bench(fn, graph: bool = False) -> float:
    """Median milliseconds."""
    import triton.testing

    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median")
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")





def _copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in GB/s (read + write bytes)."""
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = _bench(lambda: dst.copy_(src))

    return 2 * n / ms / 1e6


def _inputs(T: int):
    q = torch.randn(T, Hk, DK, device="cuda", dtype=DTYPE)
    k = torch.randn(T, Hk, DK, device="cuda", dtype=DTYPE)
    v = torch.randn(T, Hv, DV, device="cuda", dtype=DTYPE)
    a = torch.randn(T, Hv, device="cuda", dtype=DTYPE)
    b = torch.randn(T, Hv, device="cuda", dtype=DTYPE)
    A_log = torch.rand(Hv, device="cuda") * 2 - 1
    dt_bias = torch.randn(Hv, device="cuda")
    return q, k, v, a, b, A_log, dt_bias


def _pools():
    rec = torch.randn(NUM_SLOTS, Hv, DK, DV, device="cuda") * 0.1
    conv = torch.randn(NUM_SLOTS, C, K - 1, device="cuda", dtype=DTYPE)
    return rec, conv


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def bench_decode(B: int, copy_gbps: float) -> dict:
    rec, conv = _pools()
    slots = torch.randperm(NUM_SLOTS, device="cuda")[:B]
    q, k, v, a, b, A_log, dt_bias = _inputs(B)
    x = torch.randn(B, C, device="cuda", dtype=DTYPE)
    w = torch.randn(C, K, device="cuda", dtype=DTYPE)
    rec_bytes = B * Hv * DK * DV * 4 * 2
    conv_bytes = B * C * (K - 1) * 2 * 2
    out: dict = {"batch": B, "state_bytes_read_write": rec_bytes + conv_bytes}
    per_bv = {}
    for bv in (16, 32, 64):
        ms = _bench(lambda bv=bv: gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, rec, slots,
                                                 block_v=bv), graph=True)
        per_bv[bv] = ms * 1e3
    best_bv = min(per_bv, key=per_bv.get)
    conv_us = _bench(lambda: gdn.causal_conv1d_update(x, w, conv, slots), graph=True) * 1e3
    gdn_us = per_bv[best_bv]
    total = gdn_us + conv_us
    out.update(
        gdn_decode_us_by_block_v=per_bv, best_block_v=best_bv, gdn_decode_us=gdn_us,
        conv_update_us=conv_us, layer_us_per_token=total,
        recurrent_bandwidth_fraction=rec_bytes / (gdn_us * 1e-6) / 1e9 / copy_gbps,
        layer_bandwidth_fraction=(rec_bytes + conv_bytes) / (total * 1e-6) / 1e9 / copy_gbps,
        gdn_decode_us_eager=_bench(lambda: gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, rec,
                                                          slots, block_v=best_bv)) * 1e3,
    )
    ref_rec = rec.clone()
    out["torch_ref_gdn_decode_us"] = median_ms(
        lambda: gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, ref_rec, slots,
                               backend="torch"), reps=5) * 1e3
    # correctness of one step against the reference, from identical states
    r1, r2 = rec.clone(), rec.clone()
    o1 = gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, r1, slots)
    o2 = gdn.gdn_decode(q, k, v, a, b, A_log, dt_bias, r2, slots, backend="torch")
    out["rel_err_out"], out["rel_err_state"] = _rel(o1, o2), _rel(r1[slots], r2[slots])
    return out


DEFAULT_VARIANTS = (("chunk", None, "tf32x3"), ("chunk", 16, "tf32x3"), ("chunk", 32, "tf32x3"),
                    ("recurrent", 32, "ieee"))


def bench_prefill(lens: list[int], init: list[bool], ref_prefix: int | None,
                  variants=DEFAULT_VARIANTS) -> dict:
    T = sum(lens)
    rec, conv = _pools()
    slots = torch.randperm(NUM_SLOTS, device="cuda")[:len(lens)]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                      device="cuda")
    has = torch.tensor(init, device="cuda")
    args = _inputs(T)
    x = torch.randn(T, C, device="cuda", dtype=DTYPE)
    w = torch.randn(C, K, device="cuda", dtype=DTYPE)
    out: dict = {"lens": lens if len(lens) <= 16 else f"{len(lens)} seqs", "tokens": T}
    # the torch chunk reference on the same input: baseline time and the accuracy target
    rec0 = rec.clone()  # pristine states; timing runs below update `rec` in place
    r_ref = rec0.clone()
    t_ref = median_ms(lambda: gdn.gdn_prefill(*args, rec0.clone(), slots, cu, has,
                                          backend="torch"), reps=1)
    o_ref = gdn.gdn_prefill(*args, r_ref, slots, cu, has, backend="torch")
    out["torch_chunk_ref_ms"] = t_ref
    out["torch_chunk_ref_tokens_per_s"] = T / t_ref * 1e3
    for method, bv, prec in variants:
        name = f"{method}_bv{bv or 'auto'}" + (f"_{prec}" if method == "chunk" else "")
        try:
            def run(r, m=method, bv=bv, prec=prec):
                return gdn.gdn_prefill(*args, r, slots, cu, has, method=m, block_v=bv,
                                       dot_precision=prec, fallback=False)
            r1 = rec0.clone()
            o1 = run(r1)
            out[f"{name}_rel_err_out"] = _rel(o1, o_ref)
            out[f"{name}_rel_err_state"] = _rel(r1[slots], r_ref[slots])
            ms = _bench(lambda run=run: run(rec))
            out[f"{name}_ms"] = ms
            out[f"{name}_tokens_per_s"] = T / ms * 1e3
            out[f"{name}_configs"] = {str(k): str(v) for k, v in gdn.chunk_configs_chosen()}
        except Exception as e:  # noqa: BLE001 - record and go on
            out[f"{name}_error"] = repr(e)[:500]
    out["conv_prefill_ms"] = _bench(lambda: gdn.causal_conv1d_prefill(x, w, conv, slots, cu,
                                                                      has))
    if ref_prefix:
        n = min(ref_prefix, lens[0])
        one = [t[:n] for t in args[:5]] + list(args[5:])
        cu1 = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        s1, h1 = slots[:1], torch.tensor([False], device="cuda")
        t_rec = median_ms(lambda: gdn.gdn_prefill(*one, rec, s1, cu1, h1, backend="torch",
                                              method="recurrent"), reps=1)
        out["torch_recurrent_ref_prefix_tokens"] = n
        out["torch_recurrent_ref_tokens_per_s"] = n / t_rec * 1e3
    return out


SWEEP = [  # (chunk, dv tile, warps, stages, prep warps[, blocked inverse])
    (64, 16, 4, 1, 4), (64, 16, 8, 1, 4), (64, 32, 8, 1, 4), (64, 32, 4, 1, 4),
    (64, 16, 4, 2, 4), (64, 16, 4, 1, 8), (64, 16, 4, 1, 2), (32, 16, 4, 1, 4),
    (32, 32, 4, 1, 4), (32, 16, 4, 1, 2), (64, 16, 4, 1, 4, False), (32, 16, 4, 1, 4, False),
]


def bench_chunk_configs(T: int) -> dict:
    """Each chunk-kernel launch config on one T-token sequence (bf16 inputs): time, error."""
    from tinyserve.kernels.gdn.config import ChunkConfig

    rec, _ = _pools()
    slots = torch.tensor([3], device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    has = torch.tensor([True], device="cuda")
    args = _inputs(T)
    r_ref = rec.clone()
    o_ref = gdn.gdn_prefill(*args, r_ref, slots, cu, has, backend="torch")
    out: dict = {"tokens": T}
    for c in SWEEP:
        cfg = ChunkConfig(*c)
        name = "bt{}_bv{}_w{}_s{}_pw{}".format(*c) + ("" if cfg.blocked_inverse else "_rows")
        try:
            def run(r, cfg=cfg):
                return gdn.gdn_prefill(*args, r, slots, cu, has, chunk_config=cfg,
                                       fallback=False)
            r1 = rec.clone()
            o1 = run(r1)
            ms = _bench(lambda run=run: run(rec))
            out[name] = {"ms": ms, "tokens_per_s": T / ms * 1e3,
                         "rel_err_out": _rel(o1, o_ref), "rel_err_state": _rel(r1[3], r_ref[3])}
        except Exception as e:  # noqa: BLE001 - record and go on
            out[name] = {"error": repr(e)[:500]}
    ok = {k: v["tokens_per_s"] for k, v in out.items() if isinstance(v, dict) and "ms" in v}
    out["best"] = max(ok, key=ok.get) if ok else None
    return out


def bench_kernel_split(T: int) -> dict:
    """Device time per kernel (torch profiler) of one T-token chunked prefill: prep vs the
    sequential chunk kernel vs the small torch ops of the chunk table."""
    from torch.profiler import ProfilerActivity, profile

    rec, _ = _pools()
    slots = torch.tensor([3], device="cuda")
    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    has = torch.tensor([True], device="cuda")
    args = _inputs(T)
    for _ in range(2):
        gdn.gdn_prefill(*args, rec, slots, cu, has, fallback=False)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            gdn.gdn_prefill(*args, rec, slots, cu, has, fallback=False)
        torch.cuda.synchronize()
    us: dict = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            us[ev.key[:80]] = round(t / 5, 1)
    return {"tokens": T, "device_us_per_call_by_kernel": us}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="skip the 30k-token prefill")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    rec = Recorder(args.out, run_meta(
        "gdn", bench="gdn",
        shapes={"Hk": Hk, "Hv": Hv, "dk": DK, "dv": DV, "conv_dim": C, "conv_kernel": K,
                "dtype": str(DTYPE), "state": "fp32"},
        baseline="pure-torch references (kernels/gdn/ref.py) on the same GPU, same run"))
    res = rec.data

    def case(name: str, fn, *a) -> None:
        rec.run(name, fn, *a)
        torch.cuda.empty_cache()

    try:
        res["copy_bandwidth_GBps"] = _copy_bandwidth()
    except Exception:  # noqa: BLE001
        res["errors"]["copy_bandwidth"] = traceback.format_exc()[-3000:]
        res["copy_bandwidth_GBps"] = float("nan")
    print(f"device copy bandwidth: {res['copy_bandwidth_GBps']:.0f} GB/s", flush=True)
    for B in (1, 8):
        case(f"decode_b{B}", bench_decode, B, res["copy_bandwidth_GBps"])
    case("prefill_4k", bench_prefill, [4096], [False], 1024)
    case("prefill_4k_kernel_split", bench_kernel_split, 4096)
    case("prefill_4k_chunk_configs", bench_chunk_configs, 4096)
    if not args.quick:
        case("prefill_30k", bench_prefill, [30720], [False], None)
    case("prefill_mixed_2k_plus_7_decodes", bench_prefill, [2048] + [1] * 7,
         [False] + [True] * 7, None)
    # last: fp32 FMA dots compile slowly (spills on sm_90); for comparison only
    case("prefill_4k_ieee_dots", bench_prefill, [4096], [False], None, [("chunk", 16, "ieee")])
    print(f"wrote {args.out}")
    return 0 if not res["errors"] else 2


if __name__ == "__main__":
    sys.exit(main())

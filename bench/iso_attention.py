"""ISO3/ISO4 paged decode and extend attention against bf16 SDPA, one layer of Qwen3.5-35B-A3B
(16 query heads, 2 KV heads, head_dim 256), measured side by side in one run.

Decode: batch 1 and 8, context 4k / 32k / 128k; iso3 and iso4 with both decode kernels (the
CUDA SIMT kernel of kernels.iso_cuda and the tensor-core Triton kernel of kernels.iso_triton)
vs bf16 torch SDPA with GQA (`enable_gqa=True`) over a contiguous bf16 K/V (the baseline).
Each timed call runs over several distinct layer caches (so nothing stays in L2 between
layers, as in a real step) inside a CUDA graph; the per-layer time is the graph time / calls.
Bytes read and achieved bandwidth are recorded; `decode_choice` says which kernel won (the
value for kv/iso_pool.DECODE_IMPL). A sweep times Triton tile / split settings.
Extend: tokens/s of a 2k-token chunk over prefixes 0..30k, the ratio to bf16 SDPA at the same
prefix, and a breakdown (prefix dequantization, prefix attention, chunk attention).

Writes bench/results/iso_attention.json. A failing case is recorded and the rest still run.
Usage: python bench/iso_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tinyserve.kernels import iso, iso_cuda, iso_triton  # noqa: E402

HQ, HKV, D = 16, 2, 256
PAGE = 16
RESULTS = ROOT / "bench" / "results" / "iso_attention.json"


def _time_us(fn, calls_per_run: int) -> tuple[float, str]:
    """Median time of one `fn()` in us, from a CUDA graph of 10 runs (do_bench fallback)."""
    fn()
    torch.cuda.synchronize()
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(10):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(15):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000 / 10)
        return statistics.median(times) / calls_per_run, "cuda_graph"
    except Exception:  # noqa: BLE001
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=200) * 1000 / calls_per_run, "do_bench"


def _layers_needed(bytes_per_layer: int) -> int:
    l2 = getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 50 << 20)
    return max(2, min(10, math.ceil(2 * l2 / max(1, bytes_per_layer))))


def _iso_state(fmt: str, batch: int, ctx: int) -> dict:
    """Packed caches for several layers (random bf16 K/V stored through the kernel)."""
    rb = iso.packed_row_bytes(D, fmt)
    bytes_layer = 2 * batch * ctx * HKV * rb
    n_layers = _layers_needed(bytes_layer)
    pages_per = ctx // PAGE
    table = torch.randperm(batch * pages_per, device="cuda").int().reshape(batch, pages_per)
    caches = []
    slots = torch.arange(batch * ctx, device="cuda")
    for _ in range(n_layers):
        kc = torch.empty(batch * ctx, HKV, rb, dtype=torch.uint8, device="cuda")
        vc = torch.empty_like(kc)
        for s in range(0, batch * ctx, 1 << 18):
            e = min(batch * ctx, s + (1 << 18))
            k = torch.randn(e - s, HKV, D, device="cuda").bfloat16()
            iso_cuda.iso_store(kc, vc, slots[s:e], k, k, fmt)
        caches.append((kc, vc))
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return dict(fmt=fmt, batch=batch, ctx=ctx, caches=caches, table=table, q=q, lens=lens,
                out=torch.empty_like(q), bytes=bytes_layer, n_layers=n_layers)


def bench_decode_iso(st: dict, impl: str, **cfg) -> dict:
    """Time one decode kernel ("cuda" or "triton", with optional settings) on a state."""
    fmt, ctx = st["fmt"], st["ctx"]
    q, table, lens, out = st["q"], st["table"], st["lens"], st["out"]
    if impl == "cuda":
        def call(kc, vc):
            iso_cuda.iso_decode_attention(q, kc, vc, table, lens, PAGE, fmt, D ** -0.5,
                                          max_seq_len=ctx, out=out, **cfg)
    else:
        if impl == "triton_interleave":
            cfg = dict(cfg, variant="interleave")

        def call(kc, vc):
            iso_triton.iso_decode_attention_triton(q, kc, vc, table, lens, PAGE, fmt,
                                                   D ** -0.5, max_seq_len=ctx, out=out, **cfg)

    def run():
        for kc, vc in st["caches"]:
            call(kc, vc)

    us, method = _time_us(run, st["n_layers"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if impl == "cuda":
        chunk, splits = iso_cuda.plan_splits(st["batch"], HKV, ctx, sms)
    else:
        chunk, splits = iso_triton.plan_splits(
            st["batch"], HKV, ctx, sms, ctas_per_sm=cfg.get("ctas_per_sm", iso_triton.CTAS_PER_SM),
            tile=cfg.get("block_t", iso_triton.BLOCK_T))
    if cfg.get("split_tokens"):
        chunk = cfg["split_tokens"]
        splits = math.ceil(ctx / chunk)
    return dict(us=us, bytes=st["bytes"], GBps=st["bytes"] / us / 1e3, method=method,
                layers_in_rotation=st["n_layers"], split_tokens=chunk, splits=splits)


def bench_decode_bf16(batch: int, ctx: int) -> dict:
    bytes_layer = 2 * batch * ctx * HKV * D * 2
    n_layers = _layers_needed(bytes_layer)
    kvs = [(torch.randn(batch, HKV, ctx, D, device="cuda").bfloat16(),
            torch.randn(batch, HKV, ctx, D, device="cuda").bfloat16()) for _ in range(n_layers)]
    q = torch.randn(batch, HQ, 1, D, device="cuda").bfloat16()

    def run():
        for k, v in kvs:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    us, method = _time_us(run, n_layers)
    return dict(us=us, bytes=bytes_layer, GBps=bytes_layer / us / 1e3, method=method,
                layers_in_rotation=n_layers)


def bench_extend(fmt: str, prefix: int, chunk: int = 2048) -> dict:
    from triton.testing import do_bench

    total = prefix + chunk
    pages = math.ceil(total / PAGE)
    rb = iso.packed_row_bytes(D, fmt)
    kc = torch.empty(pages * PAGE, HKV, rb, dtype=torch.uint8, device="cuda")
    vc = torch.empty_like(kc)
    if prefix:
        k = torch.randn(prefix, HKV, D, device="cuda").bfloat16()
        iso_cuda.iso_store(kc, vc, torch.arange(prefix, device="cuda"), k, k, fmt)
    table = torch.arange(pages, device="cuda", dtype=torch.int32)[None]
    q = torch.randn(chunk, HQ, D, device="cuda").bfloat16()
    k = torch.randn(chunk, HKV, D, device="cuda").bfloat16()
    cu = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
    ms = do_bench(lambda: iso_cuda.iso_extend_attention(q, k, k, kc, vc, table, cu, [chunk],
                                                        [prefix], PAGE, fmt, D ** -0.5),
                  warmup=5, rep=100)
    kb = torch.randn(1, HKV, total, D, device="cuda").bfloat16()
    qb = q.transpose(0, 1)[None]
    ms_bf16 = do_bench(lambda: F.scaled_dot_product_attention(qb, kb, kb, enable_gqa=True,
                                                              is_causal=prefix == 0),
                       warmup=5, rep=100)
    row = dict(ms=ms, tokens_per_s=chunk / ms * 1e3, bf16_sdpa_ms=ms_bf16,
               bf16_tokens_per_s=chunk / ms_bf16 * 1e3, iso_over_bf16=ms / ms_bf16,
               attention_backends=list(iso_cuda.EXTEND_BACKENDS))
    if prefix:  # where the time goes
        slots = torch.arange(prefix, device="cuda")
        row["dequant_kv_ms"] = 2 * do_bench(lambda: iso_cuda.iso_dequant_rows(
            kc, slots, fmt, D, torch.bfloat16, head_major=True), warmup=5, rep=50)
        kp = iso_cuda.iso_dequant_rows(kc, slots, fmt, D, torch.bfloat16, head_major=True)
        qg = q.transpose(0, 1).reshape(HKV, HQ // HKV * chunk, D)
        row["prefix_attention_ms"] = do_bench(
            lambda: iso_cuda._attend_lse(qg, kp, kp, False, D ** -0.5), warmup=5, rep=50)
        ke = k.transpose(0, 1).repeat_interleave(HQ // HKV, 0)
        row["chunk_attention_ms"] = do_bench(
            lambda: iso_cuda._attend_lse(q.transpose(0, 1), ke, ke, True, D ** -0.5),
            warmup=5, rep=50)
    return row


def _sweep(res: dict, st: dict) -> None:
    """Decode settings on one state (32k): CUDA split sizes, Triton tile / split / warp /
    register-cap settings. Rows land in res["split_sweep"]."""
    configs = [("cuda", dict(split_tokens=t)) for t in (256, 512)]
    configs += [("triton", dict(block_t=bt, ctas_per_sm=c, num_warps=w, maxnreg=None))
                for bt, c, w in ((64, 4, 8), (128, 4, 8), (64, 4, 4))]
    # register caps (several programs per SM, some spilling)
    configs += [("triton", dict(block_t=bt, ctas_per_sm=c, num_warps=w, maxnreg=r))
                for bt, c, w, r in ((64, 8, 8, 128), (32, 16, 4, 128), (32, 8, 4, 96),
                                    (32, 8, 4, 168), (16, 8, 4, 128), (32, 8, 2, 128),
                                    (64, 8, 4, 128))]
    configs += [("triton_interleave", dict(block_t=32, ctas_per_sm=8, num_warps=4,
                                           maxnreg=128))]
    for impl, cfg in configs:
        row = dict(fmt=st["fmt"], impl=impl, batch=st["batch"], context=st["ctx"], config=cfg)
        try:
            row.update(bench_decode_iso(st, impl, **cfg))
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
        print(json.dumps(row), flush=True)
        res.setdefault("split_sweep", []).append(row)


def _choose(rows: list[dict]) -> dict:
    """Which decode kernel is faster: geometric mean of triton/cuda time over the 32k and
    128k rows of both formats and batches."""
    t = {(r["fmt"], r["batch"], r["context"], r.get("impl")): r["us"] for r in rows
         if "us" in r and r["fmt"] != "bf16"}
    logs = [math.log(t[(f, b, c, "triton")] / t[(f, b, c, "cuda")])
            for (f, b, c, impl) in t if impl == "cuda" and c >= 32768
            and (f, b, c, "triton") in t]
    if not logs:
        return dict(impl=None, reason="no comparable rows")
    ratio = math.exp(sum(logs) / len(logs))
    return dict(impl="triton" if ratio < 1 else "cuda", triton_over_cuda_geomean=ratio,
                rows=len(logs))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4k and 32k only")
    args = parser.parse_args()
    import triton

    props = torch.cuda.get_device_properties(0)
    res: dict = dict(
        device=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        date=datetime.datetime.now(datetime.timezone.utc).isoformat(),
        shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PAGE),
        baseline="torch SDPA bf16, enable_gqa=True, contiguous K/V", decode=[], extend=[],
        targets="iso3 <= 0.5x bf16 at 32k and 128k; extend iso/bf16 within 1.3x at every "
                "prefix")
    contexts = [4096, 32768] if args.quick else [4096, 32768, 131072]
    for batch in (1, 8):
        for ctx in contexts:
            base = None
            row = dict(fmt="bf16", batch=batch, context=ctx)
            try:
                row.update(bench_decode_bf16(batch, ctx))
                base = row["us"]
            except Exception as exc:  # noqa: BLE001
                row["error"] = f"{type(exc).__name__}: {exc}"
                traceback.print_exc()
            print(json.dumps(row), flush=True)
            res["decode"].append(row)
            torch.cuda.empty_cache()
            for fmt in ("iso3", "iso4"):
                try:
                    st = _iso_state(fmt, batch, ctx)
                except Exception as exc:  # noqa: BLE001
                    res["decode"].append(dict(fmt=fmt, batch=batch, context=ctx,
                                              error=f"{type(exc).__name__}: {exc}"))
                    traceback.print_exc()
                    continue
                for impl in ("cuda", "triton", "triton_interleave"):
                    row = dict(fmt=fmt, impl=impl, batch=batch, context=ctx)
                    try:
                        row.update(bench_decode_iso(st, impl))
                        if base:
                            row["ratio_vs_bf16"] = row["us"] / base
                    except Exception as exc:  # noqa: BLE001
                        row["error"] = f"{type(exc).__name__}: {exc}"
                        traceback.print_exc()
                    print(json.dumps(row), flush=True)
                    res["decode"].append(row)
                if ctx == 32768:
                    _sweep(res, st)
                del st
                torch.cuda.empty_cache()
    res["decode_choice"] = _choose(res["decode"])
    print(json.dumps(dict(decode_choice=res["decode_choice"])), flush=True)
    for prefix in (0, 2048, 8192, 16384, 30720):
        row = dict(fmt="iso3", chunk=2048, prefix=prefix)
        try:
            row.update(bench_extend("iso3", prefix))
        except Exception as exc:  # noqa: BLE001
            row["error"] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
        print(json.dumps(row), flush=True)
        res["extend"].append(row)
    tps = [r["tokens_per_s"] for r in res["extend"] if "tokens_per_s" in r]
    if tps:
        res["extend_flatness_min_over_max"] = min(tps) / max(tps)
    ratios = [r["iso_over_bf16"] for r in res["extend"] if "iso_over_bf16" in r]
    if ratios:
        res["extend_iso_over_bf16_max"] = max(ratios)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {RESULTS}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

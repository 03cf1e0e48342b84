"""ISO3/ISO4 paged decode and extend attention against bf16 SDPA, one layer of Qwen3.5-35B-A3B
(16 query heads, 2 KV heads, head_dim 256), measured side by side in one run.

Decode: batch 1 and 8, context 4k / 32k / 128k; iso3 with both decode kernels (the Triton
tensor-core kernel "triton", the CUDA tensor-core kernel "mma" of csrc/iso_decode_mma.cu,
the one the engine runs for iso3 at GQA groups <= 8) and a sweep of the mma kernel's settings
(warps per CTA, CTAs per SM, which set the split count; at 4k the minimum tokens per split),
iso4 at 32k (triton), vs bf16 torch SDPA with GQA (`enable_gqa=True`) over a contiguous bf16 K/V
(the baseline). Each timed call runs over several distinct layer caches (so nothing stays in
L2 between layers, as in a real step) inside a CUDA graph; the per-layer time is the graph
time / calls. Every timed config also records its cosine against an fp32 oracle (dequantized
rows, fp32 softmax attention) on the same cache. `decode_choice` says which kernel won,
`mma_best` the mma settings per batch (the rows for iso_mma.MMA_CONFIG).
Extend: tokens/s of a 2k-token chunk over prefixes 0..30k, the ratio to the bf16 cache's
attention of the same sequence (`attention.chunk_causal_attention` over contiguous bf16 K/V),
and the time of the prefix's dequantization, the one part the bf16 cache does not pay.

Writes bench/results/iso_attention.json (bench/common.py Recorder: a failing case is recorded and
the rest still run). Usage: python bench/iso_attention.py [--quick] [--no-extend] [--warps |
--extend] (--extend: the extend
cases only, prefixes 0 / 2k / 8k / 16k / 30k, each also timed inside CUDA graphs (the GPU time
without the host's launch overhead), < 60 s, written to bench/results/iso_extend.json; --warps:
bf16, the mma kernel's MMA_CONFIG row and WARPS_SWEEP (4 and 16 warps per CTA at one wave),
iso3 decode at the six points, < 60 s, written to bench/results/iso_attention_warps.json with
`mma_warps`: the best row per point and the best setting per batch)
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Recorder, run_meta  # noqa: E402

from tinyserve.kernels import (  # noqa: E402
    attention,
    decode_split,
    iso,
    iso_cuda,
    iso_extend,
    iso_mma,
    iso_triton,
)

HQ, HKV, D = 16, 2, 256
PAGE = 16
RESULTS_DIR = ROOT / "bench" / "results"
# The result file of each mode: the sweep flag given (the first of them in this order), "full"
# without one
RESULTS_OF_MODE = {
    "warps": RESULTS_DIR / "iso_attention_warps.json",
    "extend": RESULTS_DIR / "iso_extend.json",
    "full": RESULTS_DIR / "iso_attention.json",
}


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


# ctas_per_sm 0: one wave from the kernel's occupancy (the MMA_CONFIG default)
MMA_SWEEP = [dict(warps=w, ctas_per_sm=c) for w, cs in ((4, (0, 2, 3, 4)), (16, (0, 1)))
             for c in cs]
MIN_SPLIT_SWEEP = (32, 64, 128, 256)  # at 4k, with the batch's default warps / CTAs per SM
# --warps: warps per CTA (iso_mma.WARPS) at about ctas_per_sm CTAs per SM (0: one wave from
# the occupancy: 3 CTAs of 4 warps, 1 of 16 on sm_90), at least one sub-tile per warp and
# split (min_split_tokens = 16 x warps), beside the batch's MMA_CONFIG row ("default").
WARPS_SWEEP = [dict(warps=w, ctas_per_sm=c, min_split_tokens=16 * w)
               for w, c in ((4, 0), (16, 0))]
def _oracle(st: dict) -> torch.Tensor:
    """fp32 attention over the dequantized rows of the first layer cache: [B, HQ, D]."""
    kc, vc = st["caches"][0]
    out = torch.empty(st["batch"], HQ, D, device="cuda")
    t = torch.arange(st["ctx"], device="cuda")
    for b in range(st["batch"]):
        slots = st["table"][b].long()[t // PAGE] * PAGE + t % PAGE
        k = iso_cuda.iso_dequant_rows(kc, slots, st["fmt"], D, torch.float32)  # [T, HKV, D]
        v = iso_cuda.iso_dequant_rows(vc, slots, st["fmt"], D, torch.float32)
        qg = st["q"][b].float().reshape(HKV, HQ // HKV, D)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qg, k) * D ** -0.5, dim=-1)
        out[b] = torch.einsum("hgt,thd->hgd", p, v).reshape(HQ, D)
        del k, v, p
    return out


def _call(st: dict, impl: str, cfg: dict):
    fmt, ctx = st["fmt"], st["ctx"]
    q, table, lens = st["q"], st["table"], st["lens"]
    if impl in ("mma", "mma_min", "mma_warps"):
        return lambda kc, vc, out: iso_mma.iso_decode_attention_mma(
            q, kc, vc, table, lens, PAGE, fmt, D ** -0.5, max_seq_len=ctx, out=out, **cfg)
    return lambda kc, vc, out: iso_triton.iso_decode_attention_triton(
        q, kc, vc, table, lens, PAGE, fmt, D ** -0.5, max_seq_len=ctx, out=out, **cfg)


def bench_decode_iso(st: dict, impl: str, cfg: dict, base_us: float | None) -> dict:
    """Time one decode kernel ("triton" or "mma", with optional settings) on a
    state, and its cosine against the fp32 oracle on the first layer cache."""
    call = _call(st, impl, cfg)
    check = torch.full_like(st["q"], float("nan"))
    call(*st["caches"][0], check)
    ref = st["oracle"]
    cos = torch.nn.functional.cosine_similarity(check.float().flatten(), ref.flatten(),
                                                dim=0).item()
    rel = ((check.float() - ref).abs().max() / ref.abs().max()).item()
    out = st["out"]

    def run():
        for kc, vc in st["caches"]:
            call(kc, vc, out)

    us, method = _time_us(run, st["n_layers"])
    row = dict(us=us, cos_vs_oracle=cos, max_rel_err=rel, cos_ok=cos >= 0.999,
               GBps=st["bytes"] / us / 1e3, bytes=st["bytes"], method=method,
               layers_in_rotation=st["n_layers"], config=cfg)
    if base_us:
        row["ratio_vs_bf16"] = us / base_us
    if impl.startswith("mma"):
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        c = iso_mma.mma_config(st["batch"], st["ctx"])
        ctas = cfg.get("ctas_per_sm", c["ctas_per_sm"])
        fit = iso_mma.ctas_per_sm_fit(st["q"].device, D, cfg.get("warps", c["warps"]))
        row["ctas_per_sm_fit"] = fit
        row["split_tokens"], row["splits"] = decode_split.plan_splits(
            st["batch"], HKV, st["ctx"], sms,
            min_tokens=cfg.get("min_split_tokens", c["min_split_tokens"]),
            ctas_per_sm=ctas or fit, tile=16, one_wave=not ctas)
    return row


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
    """A 2k-token chunk over a packed prefix vs the bf16 cache's attention of the same
    sequence (`attention.chunk_causal_attention` over contiguous bf16 K/V, the call the bf16
    backend makes after its gather), eagerly and inside CUDA graphs."""
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
    kb = torch.randn(HKV, total, D, device="cuda").bfloat16()
    qh = q.transpose(0, 1)

    def iso_call():
        return iso_extend.iso_extend_attention(q, k, k, kc, vc, table, cu, [chunk], [prefix],
                                               PAGE, fmt, D ** -0.5)

    def bf16_call():
        return attention.chunk_causal_attention(qh, kb, kb, D ** -0.5)

    ms = do_bench(iso_call, warmup=3, rep=40)
    ms_bf16 = do_bench(bf16_call, warmup=3, rep=40)
    row = dict(ms=ms, tokens_per_s=chunk / ms * 1e3, bf16_sdpa_ms=ms_bf16,
               bf16_tokens_per_s=chunk / ms_bf16 * 1e3, iso_over_bf16=ms / ms_bf16)
    # The same two calls inside CUDA graphs: GPU time without the host's launch overhead
    # (eager prefill pays that overhead too; the graph time is what the kernels cost).
    us, method = _time_us(iso_call, 1)
    us_bf16, method_bf16 = _time_us(bf16_call, 1)
    row.update(graph_ms=us / 1e3, bf16_graph_ms=us_bf16 / 1e3, iso_over_bf16_graph=us / us_bf16,
               graph_tokens_per_s=chunk / us * 1e6, graph_timing=(method, method_bf16))
    if prefix:  # the part the bf16 cache does not pay: the prefix's K and V dequantized
        slots = torch.arange(prefix, device="cuda")
        row["dequant_kv_ms"] = 2 * do_bench(lambda: iso_cuda.iso_dequant_rows(
            kc, slots, fmt, D, torch.bfloat16, head_major=True), warmup=3, rep=25)
    return row


def _choose(cases: dict) -> dict:
    """Fastest correct iso3 decode kernel: geometric mean over the 32k and 128k rows (batch 1
    and 8) of each kernel's time (mma: its best sweep setting per row) over the bf16 time."""
    ratios: dict[str, list[float]] = {}
    for name, row in cases.items():
        parts = name.split("/")  # decode/b{B}/{ctx}/iso3/{impl}[/{cfg}]
        if len(parts) < 5 or parts[0] != "decode" or parts[3] != "iso3" \
                or parts[4] not in ("triton", "mma") or int(parts[2]) < 32768 \
                or not row.get("cos_ok") or "ratio_vs_bf16" not in row:
            continue
        key = (parts[4], parts[1], parts[2])
        ratios.setdefault(key, []).append(row["ratio_vs_bf16"])
    best: dict[str, list[float]] = {}
    for (impl, _, _), vals in ratios.items():
        best.setdefault(impl, []).append(math.log(min(vals)))
    geo = {impl: math.exp(sum(v) / len(v)) for impl, v in best.items() if v}
    if not geo:
        return dict(impl=None, reason="no comparable rows")
    return dict(impl=min(geo, key=geo.get), iso_over_bf16_geomean=geo)


def _mma_best(cases: dict) -> dict:
    """Per batch: the mma sweep setting that passed at the most contexts, lowest geometric-mean
    time among those (the row for iso_mma.MMA_CONFIG)."""
    logs: dict[tuple, list[float]] = {}
    for name, row in cases.items():
        parts = name.split("/")
        if len(parts) == 6 and parts[4] == "mma" and row.get("cos_ok"):
            logs.setdefault((parts[1], parts[5]), []).append(math.log(row["us"]))
    out: dict = {}
    for (batch, cfg), vals in logs.items():
        geo = math.exp(sum(vals) / len(vals))
        cur = out.get(batch)
        if cur is None or (-len(vals), geo) < (-cur["contexts"], cur["geomean_us"]):
            warps, ctas = cfg[1:].split("c")
            out[batch] = dict(config=cfg, warps=int(warps), ctas_per_sm=int(ctas),
                              geomean_us=geo, contexts=len(vals))
    return out


def _warps_name(cfg: dict) -> str:
    return f"w{cfg['warps']}c{cfg['ctas_per_sm']}" if cfg else "default"


def _sweep_points(cases: dict, kind: str) -> tuple[dict, dict]:
    """(points, per batch) of a decode sweep's rows `decode/b{B}/{ctx}/iso3/{kind}/{setting}`:
    per point the correct rows' us by setting, the fastest (us, / bf16); per batch the setting
    with the lowest geometric-mean time over the contexts it passed at all of, as
    {batch: (setting, geomean us)}."""
    points: dict = {}
    per_batch: dict[tuple, list[float]] = {}
    ctxs: dict[str, set] = {}
    for name, row in cases.items():
        parts = name.split("/")
        if len(parts) != 6 or parts[4] != kind or "us" not in row:
            continue
        ctxs.setdefault(parts[1], set()).add(parts[2])
        if not row.get("cos_ok"):
            continue
        point = points.setdefault(f"{parts[1]}/{parts[2]}", {"rows": {}})
        point["rows"][parts[5]] = row["us"]
        per_batch.setdefault((parts[1], parts[5]), []).append(math.log(row["us"]))
    for key, point in points.items():
        rows = point["rows"]
        best = min(rows, key=rows.get)
        bf16 = cases.get(f"decode/{key}/bf16", {}).get("us")
        point.update(best=best, best_us=rows[best],
                     best_over_bf16=rows[best] / bf16 if bf16 else None)
    batches: dict = {}
    for (batch, setting), vals in per_batch.items():
        if len(vals) < len(ctxs.get(batch, ())):
            continue  # failed somewhere
        geo = math.exp(sum(vals) / len(vals))
        if batch not in batches or geo < batches[batch][1]:
            batches[batch] = (setting, geo)
    return points, batches


def _config_row(cfg: dict) -> dict | str:
    """A sweep setting as the MMA_CONFIG row to take ("keep": the row as it is)."""
    if not cfg:
        return "keep"
    return dict(warps=cfg["warps"], ctas_per_sm=cfg["ctas_per_sm"] or None,
                min_split_tokens=cfg["min_split_tokens"])


def _vs_default(cases: dict, key: str, point: dict, default: str) -> dict:
    """The point's default row over bf16, and its best row over the default."""
    base = point["rows"].get(default)
    bf16 = cases.get(f"decode/{key}/bf16", {}).get("us")
    return dict(default_over_bf16=base / bf16 if bf16 and base else None,
                best_over_default=point["best_us"] / base if base else None)


def _warps_best(cases: dict) -> dict:
    """--warps: per decode point the fastest correct mma_warps row (us, / bf16, / the default
    row), and per batch the setting with the lowest geometric-mean time over the contexts it
    passed at all of (the MMA_CONFIG row to take)."""
    points, best = _sweep_points(cases, "mma_warps")
    for key, point in points.items():
        point.update(_vs_default(cases, key, point, "default"))
    batches = {}
    for batch, (setting, geo) in best.items():
        cfg = next((c for c in WARPS_SWEEP if _warps_name(c) == setting), None)
        batches[batch] = dict(setting=setting, geomean_us=geo, mma_config=_config_row(cfg))
    return dict(points=points, per_batch=batches)


def _summary(cases: dict) -> None:
    print("\ndecode (us per layer, ratio vs bf16, cosine vs oracle):")
    for name, row in cases.items():
        if name.startswith("decode/") and "us" in row:
            extra = (f" x{row['ratio_vs_bf16']:.2f} cos {row['cos_vs_oracle']:.5f}"
                     if "ratio_vs_bf16" in row else "")
            print(f"  {name:44s} {row['us']:9.1f}{extra}")
    ext = {n: r for n, r in cases.items() if n.startswith("extend/") and "ms" in r}
    if ext:
        print("extend, 2k chunk (ms; eager | in a CUDA graph; iso3 / bf16 SDPA):")
    for name, r in ext.items():
        graph = (f" | {r['graph_ms']:.3f} vs {r['bf16_graph_ms']:.3f} "
                 f"x{r['iso_over_bf16_graph']:.2f}" if "graph_ms" in r else "")
        print(f"  {name:28s} {r['ms']:.3f} vs {r['bf16_sdpa_ms']:.3f} "
              f"x{r['iso_over_bf16']:.2f}{graph}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="4k and 32k only")
    parser.add_argument("--no-extend", action="store_true", help="decode only")
    parser.add_argument("--warps", action="store_true",
                        help="bf16 and the mma decode's warps-per-CTA sweep only (iso3, no "
                             "extend; < 60 s)")
    parser.add_argument("--extend", action="store_true",
                        help="the extend cases only (prefixes 0 .. 30k, eager and in CUDA "
                             "graphs; < 60 s)")
    args = parser.parse_args()
    props = torch.cuda.get_device_properties(0)
    mode = next(m for m in RESULTS_OF_MODE if m == "full" or getattr(args, m))
    only = mode == "warps"  # a decode-only sweep
    rec = Recorder(RESULTS_OF_MODE[mode], run_meta(
        "iso_attention", sms=props.multi_processor_count, cuda=torch.version.cuda,
        shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PAGE),
        baseline="decode: torch SDPA bf16, enable_gqa=True, contiguous K/V; extend: "
                 "attention.chunk_causal_attention over contiguous bf16 K/V",
        mma_config=list(iso_mma.MMA_CONFIG), mode=mode, mma_warps=list(iso_mma.WARPS),
        triton_block_t=iso_triton.BLOCK_T,
        targets="iso3 <= 0.5x bf16 at 32k and 128k (batch 1); extend iso/bf16 within 1.3x"))
    contexts = [4096, 32768] if args.quick else [4096, 32768, 131072]
    for batch in () if args.extend else (1, 8):
        for ctx in contexts:
            tag = f"decode/b{batch}/{ctx}"
            row = rec.run(f"{tag}/bf16", bench_decode_bf16, batch, ctx)
            base = row["us"] if row else None
            torch.cuda.empty_cache()
            fmts = ("iso3", "iso4") if ctx == 32768 and not only else ("iso3",)
            for fmt in fmts:
                holder: dict = {}

                def make(fmt=fmt, batch=batch, ctx=ctx, holder=holder) -> dict:
                    holder["st"] = st = _iso_state(fmt, batch, ctx)
                    st["oracle"] = _oracle(st)
                    return dict(n_layers=st["n_layers"], bytes=st["bytes"])

                if rec.run(f"{tag}/{fmt}/state", make) is None:
                    continue
                st = holder.pop("st")
                impls = ["triton"] + (["mma"] if fmt == "iso3" else [])
                for impl in ([] if only else impls):
                    rec.run(f"{tag}/{fmt}/{impl}", bench_decode_iso, st, impl, {}, base)
                for cfg in [{}, *WARPS_SWEEP] if args.warps else ():
                    rec.run(f"{tag}/{fmt}/mma_warps/{_warps_name(cfg)}", bench_decode_iso, st,
                            "mma_warps", cfg, base)
                if fmt == "iso3" and not only:
                    for cfg in MMA_SWEEP:
                        cname = f"w{cfg['warps']}c{cfg['ctas_per_sm']}"
                        rec.run(f"{tag}/{fmt}/mma/{cname}", bench_decode_iso, st, "mma", cfg,
                                base)
                    for m in MIN_SPLIT_SWEEP if ctx == 4096 else ():
                        rec.run(f"{tag}/{fmt}/mma_min/m{m}", bench_decode_iso, st, "mma",
                                dict(min_split_tokens=m), base)
                del st
                torch.cuda.empty_cache()
    cases = rec.data["cases"]
    rec.data["decode_choice"] = _choose(cases)
    rec.data["mma_best"] = _mma_best(cases)
    if args.warps:
        rec.data["mma_warps"] = _warps_best(cases)
    if not (args.no_extend or only):
        for prefix in (0, 2048, 8192, 16384, 30720) if args.extend else (0, 2048, 8192, 30720):
            rec.run(f"extend/iso3/prefix{prefix}", bench_extend, "iso3", prefix)
        ext = [r for n, r in cases.items() if n.startswith("extend/")]
        if ext:
            tps = [r["tokens_per_s"] for r in ext]
            rec.data["extend_flatness_min_over_max"] = min(tps) / max(tps)
            rec.data["extend_iso_over_bf16_max"] = max(r["iso_over_bf16"] for r in ext)
            graph = [r["iso_over_bf16_graph"] for r in ext if "iso_over_bf16_graph" in r]
            if graph:
                rec.data["extend_iso_over_bf16_graph_max"] = max(graph)
    rec.save()
    _summary(cases)
    print(f"decode_choice: {rec.data['decode_choice']}")
    print(f"mma_best: {rec.data['mma_best']}")
    if args.warps:
        print("mma warps per CTA (us per layer; best row, x bf16, x default):")
        for point, r in rec.data["mma_warps"]["points"].items():
            cells = " ".join(f"{k} {v:.1f}" for k, v in r["rows"].items())
            print(f"  {point}: {cells} | best {r['best']} x{r['best_over_bf16'] or 0:.2f} bf16, "
                  f"x{r['best_over_default'] or 0:.2f} default "
                  f"(default x{r['default_over_bf16'] or 0:.2f} bf16)")
        print(f"  per batch (MMA_CONFIG candidate): {rec.data['mma_warps']['per_batch']}")
    print(f"wrote {RESULTS_OF_MODE[mode]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

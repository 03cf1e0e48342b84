"""ISO3/ISO4 extend attention against the bf16 cache's, one layer of Qwen3.5-35B-A3B (16 query
heads, 2 KV heads, head_dim 256): a 2k-token chunk over packed prefixes of 0 .. 30k tokens.

Per prefix: the chunk's tokens/s, the ratio to the bf16 cache's attention of the same sequence
(`attention.chunk_causal_attention` over contiguous bf16 K/V), eagerly and inside CUDA graphs
(the GPU time without the host's launch overhead), and the time of the prefix's
dequantization, the one part the bf16 cache does not pay. Target: iso / bf16 within 1.3x.
Decode attention is measured by bench/kv_decode.py.

Writes bench/results/iso_extend.json (bench/common.py Recorder: a failing case is recorded and
the rest still run; < 60 s).

    python bench/iso_attention.py [--fmt iso3] [--out PATH]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import Recorder, graph_us, run_meta  # noqa: E402
from tinyserve.kernels import iso  # noqa: E402
from tinyserve.kernels.attention import chunk as attention  # noqa: E402
from tinyserve.kernels.iso import cuda as iso_cuda  # noqa: E402
from tinyserve.kernels.iso import extend as iso_extend  # noqa: E402

HQ, HKV, D = 16, 2, 256
PAGE = 16
PREFIXES = (0, 2048, 8192, 16384, 30720)
OUT = ROOT / "bench" / "results" / "iso_extend.json"


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
    kb = torch.randn(HKV, total, D, device="cuda").bfloat16()
    qh = q.transpose(0, 1)

    def iso_call():
        return iso_extend.iso_extend_attention(q, k, k, kc, vc, table, [chunk], [prefix], PAGE,
                                               fmt, D ** -0.5)

    def bf16_call():
        return attention.chunk_causal_attention(qh, kb, kb, D ** -0.5)

    ms = do_bench(iso_call, warmup=3, rep=40)
    ms_bf16 = do_bench(bf16_call, warmup=3, rep=40)
    row = dict(ms=ms, tokens_per_s=chunk / ms * 1e3, bf16_sdpa_ms=ms_bf16,
               bf16_tokens_per_s=chunk / ms_bf16 * 1e3, iso_over_bf16=ms / ms_bf16)
    # The same two calls inside CUDA graphs: GPU time without the host's launch overhead
    # (eager prefill pays that overhead too; the graph time is what the kernels cost).
    us, method = graph_us(iso_call)
    us_bf16, method_bf16 = graph_us(bf16_call)
    row.update(graph_ms=us / 1e3, bf16_graph_ms=us_bf16 / 1e3, iso_over_bf16_graph=us / us_bf16,
               graph_tokens_per_s=chunk / us * 1e6, graph_timing=(method, method_bf16))
    if prefix:  # the part the bf16 cache does not pay: the prefix's K and V dequantized
        slots = torch.arange(prefix, device="cuda")
        row["dequant_kv_ms"] = 2 * do_bench(lambda: iso_cuda.iso_dequant_rows(
            kc, slots, fmt, D, torch.bfloat16, head_major=True), warmup=3, rep=25)
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fmt", choices=("iso3", "iso4"), default="iso3")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rec = Recorder(args.out, run_meta(
        "iso_extend", shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PAGE),
        baseline="attention.chunk_causal_attention over contiguous bf16 K/V",
        target="iso / bf16 within 1.3x at every prefix"))
    print("extend, 2k chunk (ms; eager | in a CUDA graph; iso / bf16):")
    for prefix in PREFIXES:
        r = rec.run(f"extend/{args.fmt}/prefix{prefix}", bench_extend, args.fmt, prefix)
        if r:
            graph = (f" | {r['graph_ms']:.3f} vs {r['bf16_graph_ms']:.3f} "
                     f"x{r['iso_over_bf16_graph']:.2f}" if "graph_ms" in r else "")
            print(f"  prefix {prefix:6d} {r['ms']:.3f} vs {r['bf16_sdpa_ms']:.3f} "
                  f"x{r['iso_over_bf16']:.2f}{graph}")
    ext = [r for r in rec.data["cases"].values() if "ms" in r]
    if ext:
        tps = [r["tokens_per_s"] for r in ext]
        rec.data["extend_flatness_min_over_max"] = min(tps) / max(tps)
        rec.data["extend_iso_over_bf16_max"] = max(r["iso_over_bf16"] for r in ext)
        graph = [r["iso_over_bf16_graph"] for r in ext if "iso_over_bf16_graph" in r]
        if graph:
            rec.data["extend_iso_over_bf16_graph_max"] = max(graph)
    rec.save()
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Decode attention of the KV formats side by side, one layer of Qwen3.5-35B-A3B (16 query
heads, 2 KV heads, head_dim 256, 16-token pages), batch 1 and 8, context 1k / 4k / 32k / 128k:

- `sdpa`: torch SDPA with GQA over contiguous bf16 K/V (the design targets' baseline);
- `paged`: the bf16 cache's paged split-K Triton kernel (`kernels.attention.paged_triton`), its
  split grid sized by the context (`paged_bound2x`: by twice the context, the widest grid a
  decode graph gives it: its capacity is the next power of two >= the longest sequence);
- `gather`: the bf16 cache's previous decode path and today's reference
  (`kernels.attention.paged_ref.paged_decode_ref`: gather the pages, zero past the
  length, SDPA with a boolean mask), up to 32k;
- `iso3_mma`: the ISO3 tensor-core CUDA kernel (`kernels.iso.mma`) with its shipped settings.

Each timed call runs over several distinct layer caches (nothing stays in L2 between layers,
as in a real step) inside a CUDA graph of 10 such runs; the per-layer time is the graph time
/ calls (bench/common.py `graph_us`). Every row records its error against an fp32
oracle on its first cache. At 1k every path's kernels are listed once from a profiled eager
call (`kernels`: name, launches, GPU us, grid), which shows what a decode step launches per
attention layer. `--sweep` adds the paged kernel's settings (tile, warps, stages, CTAs per SM)
and `paged_best` the best per batch (the values for paged_kv_triton's constants).

    python bench/kv_decode.py [--quick] [--sweep] -> bench/results/kv_decode.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import Recorder, graph_us, run_meta  # noqa: E402

from tinyserve.kernels import iso  # noqa: E402
from tinyserve.kernels.attention import paged_ref as paged_kv  # noqa: E402
from tinyserve.kernels.attention import paged_triton as paged_kv_triton  # noqa: E402
from tinyserve.kernels.iso import cuda as iso_cuda  # noqa: E402
from tinyserve.kernels.iso import mma as iso_mma  # noqa: E402

HQ, HKV, D = 16, 2, 256
PAGE = 16
OUT = ROOT / "bench" / "results" / "kv_decode.json"
CONTEXTS = (1024, 4096, 32768, 131072)
GATHER_MAX_CONTEXT = 32768  # the gather path's copies grow with the context
SWEEP = [dict(block_t=bt, num_warps=w, num_stages=st, ctas_per_sm=c)
         for bt, w, st in ((16, 4, 2), (32, 4, 2), (32, 4, 3), (32, 8, 2), (64, 8, 2))
         for c in (2, 4, 8)]


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


def _oracle(st: dict) -> torch.Tensor:
    """fp32 attention over the first layer cache's rows of each sequence (dequantized for an
    ISO state): [B, HQ, D]."""
    kc, vc = st["caches"][0]
    fmt = st.get("fmt")

    def rows(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:  # [T, HKV, D] fp32
        if fmt is None:
            return cache[slots].float()
        return iso_cuda.iso_dequant_rows(cache, slots, fmt, D, torch.float32)

    out = torch.empty(st["batch"], HQ, D, device="cuda")
    t = torch.arange(st["ctx"], device="cuda")
    for b in range(st["batch"]):
        slots = st["table"][b].long()[t // PAGE] * PAGE + t % PAGE
        k, v = rows(kc, slots), rows(vc, slots)
        qg = st["q"][b].float().reshape(HKV, HQ // HKV, D)
        p = torch.softmax(torch.einsum("hgd,thd->hgt", qg, k) * D ** -0.5, dim=-1)
        out[b] = torch.einsum("hgt,thd->hgd", p, v).reshape(HQ, D)
        del k, v, p
    return out


def bench_decode_bf16(batch: int, ctx: int) -> dict:
    bytes_layer = 2 * batch * ctx * HKV * D * 2
    n_layers = _layers_needed(bytes_layer)
    kvs = [(torch.randn(batch, HKV, ctx, D, device="cuda").bfloat16(),
            torch.randn(batch, HKV, ctx, D, device="cuda").bfloat16()) for _ in range(n_layers)]
    q = torch.randn(batch, HQ, 1, D, device="cuda").bfloat16()

    def run():
        for k, v in kvs:
            F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    us, method = graph_us(run, n_layers)
    return dict(us=us, bytes=bytes_layer, GBps=bytes_layer / us / 1e3, method=method,
                layers_in_rotation=n_layers)


def _iso_call(st: dict):
    """The ISO3 decode kernel the engine runs (the tensor-core kernel, its shipped settings)."""
    q, table, lens = st["q"], st["table"], st["lens"]
    return lambda kc, vc, out: iso_mma.iso_decode_attention_mma(
        q, kc, vc, table, lens, PAGE, st["fmt"], D ** -0.5, max_seq_len=st["ctx"], out=out)


def _paged_state(batch: int, ctx: int) -> dict:
    """bf16 caches [slots, HKV, D] for several layers, a shuffled page table with room for
    twice the context (the columns past it are never read), lengths = ctx."""
    bytes_layer = 2 * batch * ctx * HKV * D * 2
    n_layers = _layers_needed(bytes_layer)
    pages = ctx // PAGE
    table = torch.zeros(batch, 2 * pages, dtype=torch.int32, device="cuda")
    table[:, :pages] = torch.randperm(batch * pages, device="cuda").int().reshape(batch, pages)
    caches = [(torch.randn(batch * ctx, HKV, D, device="cuda").bfloat16(),
               torch.randn(batch * ctx, HKV, D, device="cuda").bfloat16())
              for _ in range(n_layers)]
    q = torch.randn(batch, HQ, D, device="cuda").bfloat16()
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    return dict(batch=batch, ctx=ctx, caches=caches, table=table, q=q, lens=lens,
                out=torch.empty_like(q), bytes=bytes_layer, n_layers=n_layers)


def _paged_call(st: dict, impl: str, cfg: dict):
    q, table, lens, ctx = st["q"], st["table"], st["lens"], st["ctx"]
    if impl == "gather":
        return lambda kc, vc, out: out.copy_(paged_kv.paged_decode_ref(
            q, kc, vc, table, lens, PAGE, D ** -0.5, max_seq_len=ctx))
    bound = 2 * ctx if impl == "paged_bound2x" else ctx
    return lambda kc, vc, out: paged_kv_triton.paged_decode_attention(
        q, kc, vc, table, lens, PAGE, D ** -0.5, max_seq_len=bound, out=out, **cfg)


def bench_paged(st: dict, impl: str, cfg: dict, base_us: float | None) -> dict:
    """Time one bf16 paged path ("paged", "paged_bound2x" or "gather") on a state."""
    return bench_call(st, _paged_call(st, impl, cfg), base_us) | {"config": cfg}


def bench_call(st: dict, call, base_us: float | None) -> dict:
    """Time call(k_cache, v_cache, out) over the state's layer caches, with its error against
    the fp32 oracle on the first layer cache."""
    check = torch.full_like(st["q"], float("nan"))
    call(*st["caches"][0], check)
    ref = st["oracle"]
    rel = ((check.float() - ref).abs().max() / ref.abs().max()).item()
    cos = torch.nn.functional.cosine_similarity(check.float().flatten(), ref.flatten(),
                                                dim=0).item()
    out = st["out"]

    def run():
        for kc, vc in st["caches"]:
            call(kc, vc, out)

    us, method = graph_us(run, st["n_layers"])
    row = dict(us=us, max_rel_err=rel, cos_vs_oracle=cos, ok=rel < 1e-2,
               GBps=st["bytes"] / us / 1e3, bytes=st["bytes"], method=method,
               layers_in_rotation=st["n_layers"])
    if base_us:
        row["ratio_vs_sdpa"] = us / base_us
    return row


def profile_kernels(fn) -> dict:
    """The GPU kernels of one eager fn(): per name its launches, GPU us and grid."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    kernels: dict[str, dict] = {}
    for ev in events:
        if ev.get("cat") != "kernel":
            continue
        k = kernels.setdefault(ev["name"][:160], dict(launches=0, us=0.0))
        k["launches"] += 1
        k["us"] = round(k["us"] + float(ev.get("dur", 0.0)), 2)
        args = ev.get("args", {})
        if "grid" in args:
            k["grid"], k["block"] = args["grid"], args.get("block")
    return dict(launches=sum(k["launches"] for k in kernels.values()),
                gpu_us=round(sum(k["us"] for k in kernels.values()), 2), kernels=kernels)


def _profile_point(rec: Recorder, tag: str, st_paged: dict, st_iso: dict | None) -> None:
    """At one point: the kernels each path launches for one layer (eager, first cache)."""
    kc, vc = st_paged["caches"][0]
    out = st_paged["out"]
    kvs = (torch.randn(st_paged["batch"], HKV, st_paged["ctx"], D, device="cuda").bfloat16(),
           torch.randn(st_paged["batch"], HKV, st_paged["ctx"], D, device="cuda").bfloat16())
    q4 = st_paged["q"][:, :, None]
    calls = {
        "sdpa": lambda: F.scaled_dot_product_attention(q4, *kvs, enable_gqa=True),
        "paged": lambda: _paged_call(st_paged, "paged", {})(kc, vc, out),
        "gather": lambda: _paged_call(st_paged, "gather", {})(kc, vc, out),
    }
    if st_iso is not None:
        ikc, ivc = st_iso["caches"][0]
        calls["iso3_mma"] = lambda: _iso_call(st_iso)(ikc, ivc, st_iso["out"])
    for name, fn in calls.items():
        rec.run(f"{tag}/kernels/{name}", profile_kernels, fn)


def _points(cases: dict) -> dict:
    """Per point: each path's us and the ratios the acceptance asks for."""
    points: dict = {}
    for name, row in cases.items():
        parts = name.split("/")  # decode/b{B}/{ctx}/{impl}
        if len(parts) == 4 and parts[0] == "decode" and "us" in row:
            points.setdefault(f"{parts[1]}/{parts[2]}", {})[parts[3]] = row["us"]
    for p in points.values():
        sdpa, paged = p.get("sdpa"), p.get("paged")
        if sdpa and paged:
            p["paged_over_sdpa"] = paged / sdpa
        if p.get("iso3_mma") and paged:
            p["paged_over_iso3"] = paged / p["iso3_mma"]
        if p.get("iso3_mma") and sdpa:
            p["iso3_over_sdpa"] = p["iso3_mma"] / sdpa
        if p.get("gather") and paged:
            p["gather_over_paged"] = p["gather"] / paged
    return points


def _paged_best(cases: dict) -> dict:
    """--sweep: per batch the setting with the lowest geometric-mean time over the contexts
    it passed at all of."""
    logs: dict[tuple, list[float]] = {}
    ctxs: dict[str, set] = {}
    for name, row in cases.items():
        parts = name.split("/")  # decode/b{B}/{ctx}/paged_sweep/{cfg}
        if len(parts) == 5 and parts[3] == "paged_sweep" and "us" in row:
            ctxs.setdefault(parts[1], set()).add(parts[2])
            if row.get("ok"):
                logs.setdefault((parts[1], parts[4]), []).append(math.log(row["us"]))
    best: dict = {}
    for (batch, cfg), vals in logs.items():
        if len(vals) < len(ctxs[batch]):
            continue
        geo = math.exp(sum(vals) / len(vals))
        if batch not in best or geo < best[batch]["geomean_us"]:
            best[batch] = dict(setting=cfg, geomean_us=geo)
    return best


def _cfg_name(cfg: dict) -> str:
    return "t{block_t}w{num_warps}s{num_stages}c{ctas_per_sm}".format(**cfg)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="1k and 32k only")
    ap.add_argument("--sweep", action="store_true", help="also the paged kernel's settings")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    rec = Recorder(args.out, run_meta(
        "kv_decode", sms=props.multi_processor_count,
        shapes=dict(q_heads=HQ, kv_heads=HKV, head_dim=D, page_size=PAGE),
        baseline="torch SDPA bf16, enable_gqa=True, contiguous K/V",
        paged_defaults=dict(block_t=paged_kv_triton.BLOCK_T, num_warps=paged_kv_triton.NUM_WARPS,
                            num_stages=paged_kv_triton.NUM_STAGES,
                            ctas_per_sm=paged_kv_triton.CTAS_PER_SM,
                            min_split_tokens=paged_kv_triton.MIN_SPLIT_TOKENS),
        mma_config=list(iso_mma.MMA_CONFIG)))
    contexts = (1024, 32768) if args.quick else CONTEXTS
    for batch in (1, 8):
        for ctx in contexts:
            tag = f"decode/b{batch}/{ctx}"
            row = rec.run(f"{tag}/sdpa", bench_decode_bf16, batch, ctx)
            base = row["us"] if row else None
            torch.cuda.empty_cache()
            held: dict = {}

            def make_paged(batch=batch, ctx=ctx, held=held) -> dict:
                held["paged"] = st = _paged_state(batch, ctx)
                st["oracle"] = _oracle(st)
                return dict(n_layers=st["n_layers"], bytes=st["bytes"])

            if rec.run(f"{tag}/paged_state", make_paged) is not None:
                st = held["paged"]
                rec.run(f"{tag}/paged", bench_paged, st, "paged", {}, base)
                rec.run(f"{tag}/paged_bound2x", bench_paged, st, "paged_bound2x", {}, base)
                if ctx <= GATHER_MAX_CONTEXT:
                    rec.run(f"{tag}/gather", bench_paged, st, "gather", {}, base)
                for cfg in SWEEP if args.sweep else ():
                    rec.run(f"{tag}/paged_sweep/{_cfg_name(cfg)}", bench_paged, st, "paged",
                            cfg, base)

            def make_iso(batch=batch, ctx=ctx, held=held) -> dict:
                held["iso"] = st = _iso_state("iso3", batch, ctx)
                st["oracle"] = _oracle(st)
                return dict(n_layers=st["n_layers"], bytes=st["bytes"])

            if rec.run(f"{tag}/iso3_state", make_iso) is not None:
                rec.run(f"{tag}/iso3_mma", bench_call, held["iso"], _iso_call(held["iso"]), base)
            if ctx == 1024 and "paged" in held:
                _profile_point(rec, tag, held["paged"], held.get("iso"))
            held.clear()
            torch.cuda.empty_cache()
    cases = rec.data["cases"]
    rec.data["points"] = _points(cases)
    if args.sweep:
        rec.data["paged_best"] = _paged_best(cases)
    rec.save()
    print("\nus per layer (sdpa | paged | paged_bound2x | gather | iso3_mma); paged / sdpa, "
          "paged / iso3:")
    for point, p in rec.data["points"].items():
        cells = " | ".join(f"{p[k]:.1f}" if k in p else "-"
                           for k in ("sdpa", "paged", "paged_bound2x", "gather", "iso3_mma"))
        print(f"  {point:10s} {cells}   x{p.get('paged_over_sdpa', 0):.2f} sdpa, "
              f"x{p.get('paged_over_iso3', 0):.2f} iso3")
    for name, row in cases.items():
        if "/kernels/" in name and "launches" in row:
            print(f"  {name}: {row['launches']} launches, {row['gpu_us']} us")
    if args.sweep:
        print(f"paged_best: {rec.data['paged_best']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

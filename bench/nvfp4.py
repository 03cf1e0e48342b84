"""NVFP4 decode kernels at M = 1, a sweep of gemv and fused-MoE variants -> results/nvfp4.json.

One unattended run on one GPU (< 120 s, most of it Triton compiles), everything beside its
baseline from the same run:
1. bandwidth: a 1 GiB device copy (read + written) and a bf16 cuBLAS GEMV over a 1 GiB
   weight (read only); the larger is the reference `bw` for every fraction below;
2. gemv M = 1 on the 35B-A3B shapes (qkvz, lm_head, o_proj, gate_up, down): bf16 cuBLAS,
   the shape's current tiles (`default_gemv_config`) and every candidate of `GEMV_SWEEP`
   (decode "f32" / "h2", rows, blocks, warps, load width, stages, split-K);
3. fused MoE, one decode token x 8 of 256 experts: the current tiles and `MOE_SWEEP`, against
   the time to read the 8 experts' bytes at `bw` (target <= 2x).
Every variant is first checked against the torch reference on the GPU (relative Frobenius
and max errors recorded; a variant over 1e-2 is not timed). Timing: the median of 10 replays
of a CUDA graph that cycles through enough weight copies (>= 256 MB) to miss L2. The winners
per shape are printed as `nvfp4_tiles.py` table entries. A failing case is recorded and the
rest still run; past TIME_BUDGET_S the remaining variants are skipped (recorded as such).

Usage: python bench/nvfp4.py [--smoke]  (--smoke: tiny shapes, any device, no timing; checks
the script itself, e.g. on CPU with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from bench.common import Recorder, rand_nvfp4, run_meta  # noqa: E402
from tinyserve.kernels.fused_moe import (  # noqa: E402
    MoEGemvConfig,
    allocate_expert_slots,
    default_moe_gemv_config,
    fused_moe,
    fused_moe_ref,
)
from tinyserve.kernels.nvfp4 import GemvConfig, default_gemv_config, nvfp4_linear  # noqa: E402
from tinyserve.kernels.nvfp4_ref import dequantize_nvfp4  # noqa: E402
from tinyserve.kernels.nvfp4_tiles import PERSISTENT_CANDIDATES  # noqa: E402

SHAPES = {  # name: (N, K), most important first
    "qkvz_2048_8192": (8192, 2048), "lm_head_2048_248320": (248320, 2048),
    "o_4096_2048": (2048, 4096), "gate_up_2048_1024": (1024, 2048),
    "down_512_2048": (2048, 512),
}
SMOKE_SHAPES = {"qkvz": (64, 1024), "down": (48, 512)}
G = GemvConfig
GEMV_SWEEP = [  # K >= 1024 (a block_b past K/16 is masked)
    G(8, 128, 4), G(16, 128, 4), G(32, 32, 4), G(16, 128, 4, vec=4),
    G(8, 128, 4, 4),  # split-K up to 4 programs per SM
    G(8, 128, 4, decode="h2"), G(16, 128, 4, decode="h2"), G(16, 128, 4, vec=4, decode="h2"),
    G(16, 256, 8, decode="h2"), G(32, 128, 8, decode="h2"), G(64, 128, 8, decode="h2"),
    G(8, 128, 4, 4, decode="h2"),
]
GEMV_SWEEP += PERSISTENT_CANDIDATES  # persistent gemv: fixed grid, next tile's loads in flight
GEMV_SWEEP_SMALL_K = [  # K = 512 (32 blocks)
    G(32, 32, 4), G(16, 32, 2), G(64, 32, 8), G(32, 32, 4, decode="h2"),
    G(16, 32, 2, decode="h2"), G(64, 32, 8, decode="h2"),
]
M_ = MoEGemvConfig  # gate_up rows, blocks; down rows, blocks; warps; prefetch; down warps
MOE_SWEEP = [  # + decode, down_expert_split
    M_(8, 128, 8, 32, 4, False, 2), M_(4, 128, 16, 32, 4, False, 4),
    M_(4, 128, 8, 32, 4, False, 2, "h2"), M_(8, 128, 8, 32, 4, False, 2, "h2"),
    M_(4, 128, 16, 32, 4, False, 4, "h2"),
    M_(4, 128, 8, 32, 4, False, 2, "f32", 4), M_(4, 128, 8, 32, 4, False, 2, "h2", 2),
    M_(4, 128, 8, 32, 4, False, 2, "h2", 4), M_(4, 128, 16, 32, 4, False, 4, "h2", 8),
]
ROTATE_BYTES = 256 << 20  # cycle weight copies until this many bytes (> L2)
MAX_REL_ERR = 1e-2
TIME_BUDGET_S = 100.0
T0 = time.perf_counter()
SMOKE = False  # --smoke: no timing, no time budget


def time_graph(fns: list, reps: int = 10, stat=statistics.median) -> float:
    """Median (or `stat`) microseconds per call of the calls in `fns`, replayed in one CUDA
    graph (launch overhead amortised; the calls run back to back)."""
    for fn in fns[:2]:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for fn in fns:
            fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(fns))
    return stat(times)


def errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    d = y.float() - ref
    return {"rel_err": float(d.norm() / ref.norm()),
            "max_rel_err": float(d.abs().max() / ref.abs().max())}


def over_budget() -> bool:
    return not SMOKE and time.perf_counter() - T0 > TIME_BUDGET_S


def bandwidth(dev: str) -> dict:
    """20 copies of 1 GiB per graph replay (best replay), and a bf16 cuBLAS GEMV over a
    1 GiB weight (read only)."""
    n = 1 << 30
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    copy = time_graph([lambda: b.copy_(a)] * 20, reps=5, stat=min)
    w = a.view(torch.bfloat16).view(1 << 15, 1 << 14)
    v = torch.randn(1 << 14, 1, device=dev, dtype=torch.bfloat16)
    read = time_graph([lambda: w @ v] * 20, reps=5, stat=min)
    out = {"copy_GBps": 2 * n / copy / 1e3, "gemv_read_GBps": n / read / 1e3}
    out["GBps"] = max(out["copy_GBps"], out["gemv_read_GBps"])
    return out


def nvfp4_bytes(n: int, k: int) -> int:
    return n * k // 2 + n * k // 16


def copies(nbytes: int, smoke: bool) -> int:
    return 1 if smoke else max(1, min(32, -(-ROTATE_BYTES // nbytes)))


def gemv_key(c: GemvConfig) -> str:
    return (f"{c.decode}_bn{c.block_n}_bb{c.block_b}_w{c.num_warps}_v{c.vec}_s{c.num_stages}"
            f"_pps{c.programs_per_sm}{'_pf' if c.prefetch else ''}"
            f"{f'_persist{c.persistent}' if c.persistent else ''}"
            f"{'' if c.hoist_x else '_xtile'}")


def gemv_table_entry(c: GemvConfig) -> str:
    extra = (", prefetch=True" if c.prefetch else "") + (
        f", persistent={c.persistent}" if c.persistent else "") + (
        "" if c.hoist_x else ", hoist_x=False")
    return (f"GemvConfig({c.block_n}, {c.block_b}, {c.num_warps}, {c.programs_per_sm}, "
            f"vec={c.vec}, num_stages={c.num_stages}, decode={c.decode!r}{extra})")


def gemv_m4(x1: torch.Tensor, ws: list, cands: list, variants: dict) -> dict:
    """M = 4 on a large weight: the `dot` path (today's choice) vs the fastest persistent
    candidate at M = 1 (it decodes a tile once for all 4 rows of x)."""
    timed = [c for c in cands if c.persistent and "us" in variants.get(gemv_key(c), {})]
    if not timed:
        return {"skipped": "no persistent candidate timed at M = 1"}
    cfg = min(timed, key=lambda c: variants[gemv_key(c)]["us"])
    x = torch.randn(4, x1.shape[1], device=x1.device, dtype=x1.dtype)
    ref = x.float() @ dequantize_nvfp4(ws[0]).to(x.device).T
    out: dict = {"persistent_config": gemv_key(cfg)}
    for name, kw in (("dot", {"path": "dot"}), ("persistent", {"path": "gemv",
                                                                "gemv_config": cfg})):
        try:
            res = errors(nvfp4_linear(x, ws[0], **kw), ref)
            if res["rel_err"] <= MAX_REL_ERR:
                res["us"] = time_graph([lambda w=w, kw=kw: nvfp4_linear(x, w, **kw) for w in ws])
        except Exception as exc:  # noqa: BLE001
            res = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        out[name] = res
    return out


def bench_gemv(n: int, k: int, bw: float, dev: str, smoke: bool) -> dict:
    """bf16 cuBLAS, the current tiles and the sweep at M = 1 on one [N, K] shape."""
    wb = nvfp4_bytes(n, k)
    ws = [rand_nvfp4(n, k, dev) for _ in range(copies(wb, smoke))]
    x = torch.randn(1, k, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    ref = x.float() @ dequantize_nvfp4(ws[0]).to(dev).T
    out: dict = {"N": n, "K": k, "weight_bytes": wb}
    if not smoke:
        dense = [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
                 for _ in range(copies(2 * n * k, smoke))]
        us = time_graph([lambda d=d: x @ d.T for d in dense])
        out["bf16_cublas"] = {"us": us, "frac_bw": 2 * n * k / us / 1e3 / bw}
        del dense
    default = default_gemv_config(n, k)
    cands = GEMV_SWEEP if k // 16 > 32 else GEMV_SWEEP_SMALL_K
    # persistent tiles cover K: past 2048 inputs they only grow (o_proj: builds, no gain)
    cands = [c for c in cands if not (c.persistent and k > 2048)]
    variants: dict = {}
    for cfg in [default] + [c for c in cands if c != default]:
        key = gemv_key(cfg)
        if over_budget():
            variants[key] = {"skipped": "time budget"}
            continue
        try:
            y = nvfp4_linear(x, ws[0], path="gemv", gemv_config=cfg)
            res = errors(y, ref)
            if res["rel_err"] <= MAX_REL_ERR and not smoke:
                us = time_graph([lambda w=w, c=cfg: nvfp4_linear(x, w, path="gemv",
                                                                 gemv_config=c) for w in ws])
                res.update(us=us, frac_bw=wb / us / 1e3 / bw)
            elif res["rel_err"] > MAX_REL_ERR:
                res["wrong"] = True
        except Exception as exc:  # noqa: BLE001 - one failed variant must not stop the sweep
            res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        variants[key] = res
    out["default"] = gemv_key(default)
    out["variants"] = variants
    timed = {kk: v for kk, v in variants.items() if "us" in v}
    if timed:
        best = min(timed, key=lambda kk: timed[kk]["us"])
        cfg = next(c for c in [default, *cands] if gemv_key(c) == best)
        out["best"] = {"config": best, "us": timed[best]["us"],
                       "frac_bw": timed[best]["frac_bw"],
                       "vs_default": variants[out["default"]].get("us", float("nan"))
                       / timed[best]["us"],
                       "table_entry": f"({n}, {k}): {gemv_table_entry(cfg)},"}
    if n * k > (1 << 23) and not smoke and not over_budget():
        out["M4"] = gemv_m4(x, ws, cands, variants)
        print(f"M=4 N={n}: " + ", ".join(f"{kk} {v.get('us', float('nan')):.2f} us"
                                          for kk, v in out["M4"].items() if isinstance(v, dict)))
    return out


def expert_slots_fp4(num: int, h: int, f: int, dev: str):
    slots = allocate_expert_slots(num, h, f, fp4=True, device=dev)
    slots.w13.random_(0, 256)
    slots.w2.random_(0, 256)
    slots.w13_scale.random_(0x30, 0x48)
    slots.w2_scale.random_(0x30, 0x48)
    slots.w13_global.fill_(0.5 / h**0.5)
    slots.w2_global.fill_(0.5 / f**0.5)
    return slots


def moe_key(c: MoEGemvConfig) -> str:
    return (f"{c.decode}_gu{c.gate_up_block_n}x{c.gate_up_block_b}_dn{c.down_block_n}x"
            f"{c.down_block_b}_w{c.num_warps}_dw{c.down_num_warps}_es{c.down_expert_split}"
            f"{'_pf' if c.prefetch else ''}")


def bench_moe_decode(bw: float, dev: str, smoke: bool, h: int = 2048, f: int = 512,
                     e: int = 256) -> dict:
    """One token x 8 of `e` experts: the current tiles and MOE_SWEEP vs the byte-read time."""
    k = 8
    slots = expert_slots_fp4(e, h, f, dev)
    x = torch.randn(1, h, device=dev, dtype=torch.bfloat16 if dev == "cuda" else torch.float32)
    w = torch.softmax(torch.randn(1, k, device=dev), -1)
    # 20 different routings per graph: 160 expert reads, ~280 MB, more than L2
    routes = [torch.randperm(e, device=dev)[:k].reshape(1, k) for _ in range(1 if smoke else 20)]
    ref = fused_moe_ref(x.float(), routes[0], w, slots)
    expert_bytes = 3 * nvfp4_bytes(f, h)
    read_us = k * expert_bytes / bw / 1e3
    out: dict = {"H": h, "F": f, "experts": e, "bytes_8_experts": k * expert_bytes,
                 "read_at_bw_us": read_us}
    default = default_moe_gemv_config(h, f)
    variants: dict = {}
    for cfg in [default] + [c for c in MOE_SWEEP if c != default]:
        key = moe_key(cfg)
        if over_budget():
            variants[key] = {"skipped": "time budget"}
            continue
        try:
            y = fused_moe(x, routes[0], w, slots, path="gemv", gemv_config=cfg)
            res = errors(y, ref)
            if res["rel_err"] <= MAX_REL_ERR and not smoke:
                us = time_graph([lambda r=r, c=cfg: fused_moe(x, r, w, slots, path="gemv",
                                                              gemv_config=c) for r in routes])
                res.update(us=us, ratio_to_read_time=us / read_us)
            elif res["rel_err"] > MAX_REL_ERR:
                res["wrong"] = True
        except Exception as exc:  # noqa: BLE001
            res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        variants[key] = res
    out["default"] = moe_key(default)
    out["variants"] = variants
    timed = {kk: v for kk, v in variants.items() if "us" in v}
    if timed:
        best = min(timed, key=lambda kk: timed[kk]["us"])
        c = next(c for c in [default, *MOE_SWEEP] if moe_key(c) == best)
        out["best"] = {"config": best, "us": timed[best]["us"],
                       "ratio_to_read_time": timed[best]["ratio_to_read_time"],
                       "table_entry": f"({h}, {f}): MoEGemvConfig({c.gate_up_block_n}, "
                       f"{c.gate_up_block_b}, {c.down_block_n}, {c.down_block_b}, "
                       f"{c.num_warps}, {c.prefetch}, {c.down_num_warps}, {c.decode!r}, "
                       f"{c.down_expert_split}),"}
    return out


def summary(rec: Recorder) -> None:
    print("\n== NVFP4 decode sweep ==")
    for name, case in rec.data["cases"].items():
        best = case.get("best")
        if not best:
            continue
        if "frac_bw" in best:
            base = case.get("bf16_cublas", {}).get("us", float("nan"))
            dflt = case["variants"][case["default"]].get("us", float("nan"))
            print(f"{name:28s} default {dflt:8.2f} us | best {best['us']:8.2f} us "
                  f"({best['frac_bw']:.0%} of bw) {best['config']} | bf16 cuBLAS {base:8.2f} us")
        else:
            print(f"{name:28s} best {best['us']:.2f} us = {best['ratio_to_read_time']:.2f}x "
                  f"read time ({case['read_at_bw_us']:.2f} us) {best['config']}")
        ranked = sorted((v["us"], kk) for kk, v in case["variants"].items() if "us" in v)
        print("    " + ", ".join(f"{kk} {us:.2f}" for us, kk in ranked))
        bad = [kk for kk, v in case["variants"].items() if "us" not in v]
        if bad:
            print("    not timed (wrong / error / skipped):", ", ".join(bad))
    print("\ntable entries (tinyserve/kernels/nvfp4_tiles.py):")
    for case in rec.data["cases"].values():
        if case.get("best"):
            print("   ", case["best"]["table_entry"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (any device)")
    ap.add_argument("--out", default=str(ROOT / "bench/results/nvfp4.json"))
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev != "cuda" and not args.smoke:
        print("needs a CUDA GPU (or --smoke)")
        return 1
    out = Path(args.out if not args.smoke else "/tmp/nvfp4_smoke.json")
    rec = Recorder(out, run_meta("nvfp4", timing="median of 10 CUDA-graph replays, weights "
                                 "rotated past L2", budget_s=TIME_BUDGET_S))
    bw = 4000.0
    if not args.smoke:
        res = rec.run("bandwidth", bandwidth, dev)
        bw = (res or {}).get("GBps", bw)
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = list(shapes)
    rec.run(f"gemv_M1_{names[0]}", bench_gemv, *shapes[names[0]], bw, dev, args.smoke)
    if args.smoke:
        rec.run("moe_decode_1tok_8of256", bench_moe_decode, bw, dev, True, 32, 32, 10)
    else:
        rec.run("moe_decode_1tok_8of256", bench_moe_decode, bw, dev, False)
    for name in names[1:]:
        rec.run(f"gemv_M1_{name}", bench_gemv, *shapes[name], bw, dev, args.smoke)
    rec.data["seconds"] = round(time.perf_counter() - T0, 1)
    rec.save()
    summary(rec)
    print(f"wrote {out} in {rec.data['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""NVFP4 decode kernels at M = 1 -> results/nvfp4.json.

One unattended run on one GPU, everything beside its baseline from the same run:
1. bandwidth: a 1 GiB device copy (read + written) and a bf16 cuBLAS GEMV over a 1 GiB
   weight (read only); the larger is the reference `bw` for every fraction below, and the
   fractions of the copy bandwidth alone (the targets' reference) are recorded beside them;
2. gemv M = 1 on the 35B-A3B shapes (qkvz, lm_head, o_proj, gate_up, down): bf16 cuBLAS,
   the default path (`default_path`: what the model runs) and the CUDA gemv at each rows per
   warp (`cuda_r*`, K in 1024 / 2048 / 4096);
3. fused MoE decode, 1, 4 and 8 tokens x 8 of 256 experts: the default "fused" path (the CUDA
   kernels of `nvfp4_cuda.moe_decode`), routed only and for the whole layer (+ the shared
   expert: in the fused launches, vs the model's separate gate_up GEMV, silu_mul, down GEMV
   and gated_add), against the time to read the experts' bytes at `bw` and at the device
   copy bandwidth (the target's reference: <= 2x; the copy is the slower of the two).
Every variant is first checked against the torch reference on the GPU (relative Frobenius
and max errors recorded; a variant over 1e-2 is not timed). Timing: the median of 10 replays
of a CUDA graph that cycles through enough weight copies (>= 256 MB) to miss L2. A failing
case is recorded and the rest still run; past TIME_BUDGET_S the remaining variants are
skipped (recorded as such).

Usage: python bench/nvfp4.py [--smoke] [--only moe|gemv] [--shape NAME]  (--smoke: tiny
shapes, any device, no timing; checks the script itself, e.g. on CPU with TRITON_INTERPRET=1;
--only moe: the bandwidth and the MoE rows only, into results/nvfp4_moe.json; --shape: the
gemv rows of one shape of SHAPES).
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
from tinyserve.core import NVFP4Weight  # noqa: E402
from tinyserve.kernels import nvfp4_cuda  # noqa: E402
from tinyserve.kernels.fused_moe import (  # noqa: E402
    allocate_expert_slots,
    fused_moe,
    fused_moe_ref,
    single_expert_slots,
)
from tinyserve.kernels.nvfp4 import nvfp4_linear  # noqa: E402
from tinyserve.kernels.nvfp4_ref import dequantize_nvfp4  # noqa: E402

SHAPES = {  # name: (N, K), most important first
    "qkvz_2048_8192": (8192, 2048), "lm_head_2048_248320": (248320, 2048),
    "o_4096_2048": (2048, 4096), "gate_up_2048_1024": (1024, 2048),
    "down_512_2048": (2048, 512),
}
SMOKE_SHAPES = {"qkvz": (64, 1024), "down": (48, 512)}
ROTATE_BYTES = 256 << 20  # cycle weight copies until this many bytes (> L2)
MAX_REL_ERR = 1e-2
TIME_BUDGET_S = 100.0
MOE_BUDGET_S = 62.0  # --only moe: the run stays under ~70 s
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


def bench_gemv(n: int, k: int, bw: float, dev: str, smoke: bool,
               copy_bw: float | None = None) -> dict:
    """bf16 cuBLAS, the default path and the CUDA gemv's tiles at M = 1 on one [N, K] shape;
    fractions of `bw` (and of the device copy bandwidth `copy_bw`, where given)."""
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
    calls = {"default_path": lambda w: nvfp4_linear(x, w)}  # what the model runs
    if dev == "cuda" and k in nvfp4_cuda.KS and x.dtype != torch.float32:
        for r in nvfp4_cuda.allowed_rows_per_warp(k):
            calls[f"cuda_r{r}"] = lambda w, r=r: nvfp4_cuda.gemv_one_row(x, w, rows_per_warp=r)
    variants: dict = {}
    for key, call in calls.items():
        if over_budget():
            variants[key] = {"skipped": "time budget"}
            continue
        try:
            res = errors(call(ws[0]), ref)
            if res["rel_err"] <= MAX_REL_ERR and not smoke:
                us = time_graph([lambda w=w, f=call: f(w) for w in ws])
                res.update(us=us, frac_bw=wb / us / 1e3 / bw)
                if copy_bw:
                    res["frac_copy"] = wb / us / 1e3 / copy_bw
            elif res["rel_err"] > MAX_REL_ERR:
                res["wrong"] = True
        except Exception as exc:  # noqa: BLE001 - one failed variant must not stop the sweep
            res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        variants[key] = res
    out["variants"] = variants
    timed = {kk: v for kk, v in variants.items() if "us" in v}
    if timed:
        best = min(timed, key=lambda kk: timed[kk]["us"])
        out["best"] = {"config": best, "us": timed[best]["us"],
                       "frac_bw": timed[best]["frac_bw"],
                       "frac_copy": timed[best].get("frac_copy")}
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


def _shared_path(x, sh, logit, routed):
    """The model's shared expert outside the MoE launch (SparseMoE before the fused path):
    gate_up GEMV, silu_mul, down GEMV, gated_add (4 launches)."""
    from tinyserve.kernels import glue
    from tinyserve.kernels.nvfp4 import nvfp4_linear

    gu = nvfp4_linear(x, sh[1])
    f = gu.shape[1] // 2
    return glue.gated_add(routed, logit, nvfp4_linear(glue.silu_mul(gu[:, :f], gu[:, f:]),
                                                      sh[2]))


def bench_moe_decode(bw: float, dev: str, smoke: bool, n: int = 1, h: int = 2048,
                     f: int = 512, e: int = 256, copy_bw: float | None = None) -> dict:
    """n tokens x 8 of `e` experts (+ the shared expert): the default fused path with the
    shared expert in its launches and beside the model's separate shared-expert GEMVs, each
    vs the byte-read time at `bw` (and at the device copy bandwidth `copy_bw`, the target's
    reference, where given)."""
    k = 8
    slots = expert_slots_fp4(e, h, f, dev)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    x = torch.randn(n, h, device=dev, dtype=dt)
    w = torch.softmax(torch.randn(n, k, device=dev), -1).to(dt)
    reps = 1 if smoke else 20
    # 20 routings (and shared experts, one per "layer") per graph: more bytes than L2
    routes = [torch.stack([torch.randperm(e, device=dev)[:k] for _ in range(n)])
              for _ in range(reps)]
    logits = [torch.randn(n, 1, device=dev, dtype=dt) for _ in range(reps)]
    shared = []
    for _ in range(reps):
        sh = single_expert_slots(rand_nvfp4(f, h, dev), rand_nvfp4(f, h, dev),
                                 rand_nvfp4(h, f, dev))
        g = float(sh.w13_global[0, 0])  # rand_nvfp4: one global scale per shape
        shared.append((sh, NVFP4Weight(sh.w13[0], sh.w13_scale[0], g),
                       NVFP4Weight(sh.w2[0], sh.w2_scale[0], float(sh.w2_global[0]))))
    expert_bytes = 3 * nvfp4_bytes(f, h)
    distinct = statistics.mean(len(torch.unique(r)) for r in routes)
    read_routed = distinct * expert_bytes / bw / 1e3
    read_layer = (distinct + 1) * expert_bytes / bw / 1e3
    out: dict = {"H": h, "F": f, "experts": e, "tokens": n, "distinct_experts": distinct,
                 "bytes_per_expert": expert_bytes, "read_routed_us": read_routed,
                 "read_layer_us": read_layer}
    ref_routed = fused_moe_ref(x, routes[0], w, slots).float()
    ref_layer = fused_moe_ref(x, routes[0], w, slots, shared_slots=shared[0][0],
                              shared_logit=logits[0]).float()

    def routed(i):
        return fused_moe(x, routes[i], w, slots)

    def layer(i):
        return fused_moe(x, routes[i], w, slots, shared_slots=shared[i][0],
                         shared_logit=logits[i])

    def separate(i):
        return _shared_path(x, shared[i], logits[i], routed(i))

    cases = [("fused_layer", layer, ref_layer, read_layer),
             ("separate_shared_layer", separate, ref_layer, read_layer),
             ("fused_routed", routed, ref_routed, read_routed)]
    variants: dict = {}
    for key, fn, ref, read_us in cases:
        if over_budget():
            variants[key] = {"skipped": "time budget"}
            continue
        try:
            res = errors(fn(0), ref)
            if res["rel_err"] <= MAX_REL_ERR and not smoke:
                us = time_graph([lambda i=i, fn=fn: fn(i) for i in range(reps)])
                res.update(us=us, ratio_to_read_time=us / read_us)
                if copy_bw:
                    res["ratio_to_copy_read_time"] = us / (read_us * bw / copy_bw)
            elif res["rel_err"] > MAX_REL_ERR:
                res["wrong"] = True
        except Exception as exc:  # noqa: BLE001 - one failed variant must not stop the rest
            res = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        variants[key] = res
    out["variants"] = variants
    timed = {kk: v for kk, v in variants.items() if "us" in v}
    if timed:
        best = min(timed, key=lambda kk: timed[kk]["us"])
        out["best"] = {"config": best, "us": timed[best]["us"],
                       "ratio_to_read_time": timed[best]["ratio_to_read_time"]}
    return out


def summary(rec: Recorder) -> None:
    print("\n== NVFP4 decode sweep ==")
    for name, case in rec.data["cases"].items():
        best = case.get("best")
        if not best:
            continue
        if "read_layer_us" in case:
            v = case["variants"]
            row = " | ".join(f"{kk} {v[kk]['us']:.2f} us ({v[kk]['ratio_to_read_time']:.2f}x, "
                             f"{v[kk].get('ratio_to_copy_read_time', float('nan')):.2f}x copy)"
                             for kk in v if "us" in v[kk])
            print(f"{name:28s}\n    {row}"
                  f"\n    read time: routed {case['read_routed_us']:.2f} us, layer "
                  f"{case['read_layer_us']:.2f} us")
        elif "frac_bw" in best:
            base = case.get("bf16_cublas", {}).get("us", float("nan"))
            path = case["variants"].get("default_path", {}).get("us", float("nan"))
            print(f"{name:28s} default path {path:8.2f} us | best {best['us']:8.2f} us "
                  f"({best['frac_bw']:.0%} of bw) {best['config']} | bf16 cuBLAS {base:8.2f} us")
        ranked = sorted((v["us"], kk) for kk, v in case["variants"].items() if "us" in v)
        print("    " + ", ".join(f"{kk} {us:.2f}" for us, kk in ranked))
        bad = [kk for kk, v in case["variants"].items() if "us" not in v]
        if bad:
            print("    not timed (wrong / error / skipped):", ", ".join(bad))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, no timing (any device)")
    ap.add_argument("--only", choices=("all", "moe", "gemv"), default="all",
                    help="moe / gemv: the bandwidth and those rows only")
    ap.add_argument("--shape", choices=tuple(SHAPES), default=None,
                    help="the gemv rows of this shape only")
    ap.add_argument("--out", default=None, help="default: bench/results/nvfp4.json "
                    "(--only moe: nvfp4_moe.json)")
    args = ap.parse_args()
    global SMOKE, TIME_BUDGET_S
    SMOKE = args.smoke
    if args.only == "moe":
        TIME_BUDGET_S = MOE_BUDGET_S
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if dev != "cuda" and not args.smoke:
        print("needs a CUDA GPU (or --smoke)")
        return 1
    name = "nvfp4_moe.json" if args.only == "moe" else "nvfp4.json"
    out = Path(args.out or ROOT / "bench/results" / name)
    if args.smoke:
        out = Path("/tmp/nvfp4_smoke.json")
    rec = Recorder(out, run_meta("nvfp4", timing="median of 10 CUDA-graph replays, weights "
                                 "rotated past L2", budget_s=TIME_BUDGET_S))
    bw, copy_bw = 4000.0, None
    if not args.smoke:
        res = rec.run("bandwidth", bandwidth, dev)
        bw = (res or {}).get("GBps", bw)
        copy_bw = (res or {}).get("copy_GBps")
    shapes = SMOKE_SHAPES if args.smoke else SHAPES
    names = list(shapes) if args.only != "moe" else []
    if args.shape and not args.smoke:
        names = [args.shape]
    size = (64, 32, 10) if args.smoke else (2048, 512, 256)
    for name in names[:1]:
        rec.run(f"gemv_M1_{name}", bench_gemv, *shapes[name], bw, dev, args.smoke, copy_bw)
    if args.only != "gemv":
        for n in (1, 4, 8):
            rec.run(f"moe_decode_{n}tok_8of256", bench_moe_decode, bw, dev, args.smoke, n,
                    *size, copy_bw)
    for name in names[1:]:
        rec.run(f"gemv_M1_{name}", bench_gemv, *shapes[name], bw, dev, args.smoke, copy_bw)
    rec.data["seconds"] = round(time.perf_counter() - T0, 1)
    rec.save()
    summary(rec)
    print(f"wrote {out} in {rec.data['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""FP8 W8A16 linear (kernels/fp8/linear.py) vs the old convert + cuBLAS path and bf16 cuBLAS, on the
FP8 projections of Qwen3.5-35B-A3B -> bench/results/fp8_linear.json.

Measured in one run on one CUDA device:
1. device bandwidth: a 1 GiB device-to-device copy ((read + written) / time) and a bf16
   cuBLAS GEMV streaming a 1 GiB weight (read / time): bench/common.py `bandwidth`;
2. per shape, M = 1, 4, 16: every fp8 path (gemv, dot, dequant; bit decode, and native
   float8e4nv at M = 1, 16, 2048) and the default, the old path (native e4m3 -> bf16
   conversion of the whole weight, F.linear, fp32 scale: what model.linear did before), bf16
   cuBLAS on a bf16 weight; weight bytes / time as a fraction of the copy and of the read
   bandwidth (target: M = 1 on 8192 x 2048 >= 0.6 of copy bandwidth);
3. M = 512, 2048: TFLOP/s of dot and dequant vs the old path and bf16 cuBLAS;
4. a sweep of gemv tiles at M = 1 (`gemv_sweep_*`, best marked).
Every case is timed inside a CUDA graph over enough weight copies to miss L2 (bench/common.py
`time_graph`: median of 10 replays). Cases run most important first; after BUDGET_S seconds
the rest are skipped (recorded as such), so the run stays under 90 s.
Usage: python bench/fp8_linear.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout
sys.path.insert(0, str(ROOT / "bench"))

from common import Recorder, bandwidth, run_meta, time_graph  # noqa: E402

from tinyserve.core import FP8Weight  # noqa: E402
from tinyserve.kernels.fp8.linear import (  # noqa: E402
    choose_path,
    fp8_linear,
)

SHAPES = {  # name: (N, K); q_proj shares in_proj_qkv's shape, o_proj out_proj's
    "in_proj_qkv|q_proj_8192x2048": (8192, 2048),
    "in_proj_z_4096x2048": (4096, 2048),
    "out_proj|o_proj_2048x4096": (2048, 4096),
    "k_proj|v_proj_512x2048": (512, 2048),
}
DECODE_M = (1, 4, 16)
PREFILL_M = (512, 2048)
VARIANTS = [("gemv", False), ("gemv", True), ("dot", False), ("dot", True), ("dequant", False),
            ("dequant", True)]
NATIVE_M = (1, 16, 2048)  # native float8e4nv decode measured at these M only (compile time)
ROTATE_BYTES = 256 << 20  # cycle weight copies until this many bytes (> the 50 MB L2)
BUDGET_S = 70.0
START = time.perf_counter()


def copies(nbytes: int, m: int) -> int:
    return 2 if m >= 512 else max(1, min(32, -(-ROTATE_BYTES // nbytes)))


def rand_fp8(n: int, k: int) -> FP8Weight:
    bits = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, device="cuda")
    bits |= torch.randint(0, 2, (n, k), dtype=torch.uint8, device="cuda") << 7
    return FP8Weight(bits, torch.tensor(0.5 / k**0.5, device="cuda"))


def old_path(x: torch.Tensor, w: FP8Weight) -> torch.Tensor:
    """model.linear.fp8_linear before the kernel: convert the whole weight every call."""
    wt = w.weight.view(torch.float8_e4m3fn).to(x.dtype)
    y = F.linear(x, wt)
    return (y.float() * w.scale.reshape(-1)).to(x.dtype)


def timed(fn, ws: list, x: torch.Tensor) -> float:
    return time_graph([lambda w=w: fn(x, w) for w in ws])


def bench_shape(name: str, m: int, bw: dict) -> dict:
    n, k = SHAPES[name]
    wb = n * k
    ws = [rand_fp8(n, k) for _ in range(copies(wb, m))]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    out: dict = {"N": n, "K": k, "M": m, "weight_bytes": wb,
                 "default_path": choose_path(m, n, k)}

    def entry(us: float, nbytes: int) -> dict:
        return {"us": round(us, 2), "frac_copy_bw": round(nbytes / us / 1e3 / bw["copy"], 3),
                "frac_read_bw": round(nbytes / us / 1e3 / bw["read"], 3),
                "TFLOPs": round(2 * m * n * k / us / 1e6, 2)}

    variants = [("default", None, None)] + [(f"{p}{'_native' if nat else ''}", p, nat)
                                             for p, nat in VARIANTS]
    for key, path, nat in variants:
        if (path == "gemv" and m > 16) or (nat and m not in NATIVE_M):
            continue
        try:
            us = timed(lambda xx, w, p=path, a=nat: fp8_linear(xx, w, path=p, native=a), ws, x)
            out[key] = entry(us, wb)
        except Exception as exc:  # noqa: BLE001 - one failed variant must not stop the case
            out[key] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    out["old_convert_cublas"] = entry(timed(old_path, ws, x), wb)
    del ws
    dense = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
             for _ in range(copies(2 * wb, m))]
    out["bf16_cublas"] = entry(time_graph([lambda d=d: x @ d.T for d in dense]), 2 * wb)
    fp8 = {kk: v["us"] for kk, v in out.items() if isinstance(v, dict) and "us" in v
           and kk not in ("old_convert_cublas", "bf16_cublas")}
    best = min((kk for kk in fp8 if kk != "default"), key=fp8.get)
    out["best_fp8"] = best
    if "default" in fp8:
        out["speedup_default_vs_old"] = round(out["old_convert_cublas"]["us"] / fp8["default"],
                                              2)
        out["speedup_default_vs_bf16"] = round(out["bf16_cublas"]["us"] / fp8["default"], 2)
    return out


def run(rec: Recorder, name: str, fn, *args) -> None:
    if time.perf_counter() - START > BUDGET_S:
        rec.data["cases"][name] = {"skipped": f"time budget {BUDGET_S:.0f} s spent"}
        return
    rec.run(name, fn, *args)


def summary(rec: Recorder) -> None:
    print(f"\n{'case':44s} {'default':>14s} {'best fp8':>22s} {'old':>9s} {'bf16':>9s} "
          f"{'frac copy':>9s}")
    for case, v in rec.data["cases"].items():
        if "default_path" not in v or not isinstance(v.get("default"), dict):
            continue
        d = v["default"]
        b = v.get(v.get("best_fp8", ""), {})
        print(f"{case:44s} {v['default_path']:>6s} {d.get('us', float('nan')):7.1f} "
              f"{v.get('best_fp8', '-'):>14s} {b.get('us', float('nan')):7.1f} "
              f"{v['old_convert_cublas']['us']:9.1f} {v['bf16_cublas']['us']:9.1f} "
              f"{d.get('frac_copy_bw', float('nan')):9.2f}")


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    out_path = ROOT / "bench/results/fp8_linear.json"
    rec = Recorder(out_path, run_meta(
        "fp8_linear", timing="median of 10 CUDA-graph replays, weights rotated past L2",
        capability=list(torch.cuda.get_device_capability())))
    bw_case = rec.run("bandwidth", bandwidth, "cuda") or {}
    bw = {"copy": bw_case.get("copy_GBps", 3000.0), "read": bw_case.get("GBps", 4000.0)}
    for m in DECODE_M:  # NOTE: most important first; a cut-short run keeps those
        for name in SHAPES:
            run(rec, f"{name}_M{m}", bench_shape, name, m, bw)
    for m in PREFILL_M:
        for name in SHAPES:
            run(rec, f"{name}_M{m}", bench_shape, name, m, bw)
    rec.data["complete"] = True
    rec.data["seconds"] = round(time.perf_counter() - START, 1)
    rec.save()
    summary(rec)
    print(f"wrote {out_path} in {rec.data['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What fraction of the bandwidth reference a decode GEMV can reach at a given weight size, on
this GPU, timed as every kernel benchmark times (bench/common.py `time_graph`: a CUDA graph of
back-to-back calls over weight copies rotated past L2) -> results/gemv_floor.json.

At each size (NVFP4 weights of 4.7 .. 286 MB, K = 2048): the NVFP4 GEMV (M = 1), a bf16
cuBLAS GEMV over a bf16 weight of the same bytes, and a device-to-device copy of the same
bytes (read and written). The bandwidth reference `bw` is bench/common.py `bandwidth` (the
larger of a 1 GiB copy and a 1 GiB bf16 GEMV). A small weight cannot reach the reference:
every call pays a launch, a ramp-up of the first loads and a tail, whoever wrote the kernel;
cuBLAS at the same bytes says how much of a miss is that floor.

Usage: python bench/gemv_floor.py  (< 60 s)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import common  # noqa: E402
from tinyserve.kernels.nvfp4.linear import nvfp4_linear  # noqa: E402

# NVFP4 rows at K = 2048: 4.7 .. 286 MB; 8192 is the qkvz projection and 248320 the lm_head
ROWS = (4096, 8192, 16384, 32768, 65536, 248320)
K = 2048


def bench_size(n: int, bw: float) -> dict:
    wb = common.nvfp4_bytes(n, K)
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    ws = [common.rand_nvfp4(n, K, "cuda") for _ in range(common.copies(wb, False))]
    us_fp4 = common.time_graph([lambda w=w: nvfp4_linear(x, w) for w in ws])
    del ws
    kb = wb // (2 * n) // 64 * 64  # bf16 columns with the same bytes per row
    xb = torch.randn(1, kb, device="cuda", dtype=torch.bfloat16)
    dense = [torch.randn(n, kb, device="cuda", dtype=torch.bfloat16)
             for _ in range(common.copies(2 * n * kb, False))]
    us_bf16 = common.time_graph([lambda d=d: xb @ d.T for d in dense])
    del dense
    src = [torch.empty(wb, dtype=torch.uint8, device="cuda")
           for _ in range(common.copies(wb, False))]
    dst = torch.empty(wb, dtype=torch.uint8, device="cuda")
    us_copy = common.time_graph([lambda s=s: dst.copy_(s) for s in src])
    return dict(N=n, K=K, weight_bytes=wb, nvfp4_us=us_fp4, nvfp4_frac_bw=wb / us_fp4 / 1e3 / bw,
                bf16_cublas_bytes=2 * n * kb, bf16_cublas_us=us_bf16,
                bf16_cublas_frac_bw=2 * n * kb / us_bf16 / 1e3 / bw,
                copy_us=us_copy, copy_frac_bw=2 * wb / us_copy / 1e3 / bw)


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    rec = common.Recorder(ROOT / "bench/results/gemv_floor.json", common.run_meta(
        "gemv_floor", timing="median of 10 CUDA-graph replays, weights rotated past L2",
        baseline="bf16 cuBLAS GEMV and a device copy at the same bytes, same run"))
    bw = (rec.run("bandwidth", common.bandwidth, "cuda") or {}).get("GBps", 4000.0)
    for n in ROWS:
        rec.run(f"rows_{n}", bench_size, n, bw)
        torch.cuda.empty_cache()
    rec.save()
    print("fraction of the bandwidth reference (NVFP4 gemv | bf16 cuBLAS | copy):")
    for name, r in rec.data["cases"].items():
        if name.startswith("rows_") and "nvfp4_us" in r:
            print(f"  {r['weight_bytes'] / 1e6:7.1f} MB: {r['nvfp4_frac_bw']:.2f} "
                  f"({r['nvfp4_us']:.1f} us) | {r['bf16_cublas_frac_bw']:.2f} "
                  f"({r['bf16_cublas_us']:.1f} us) | {r['copy_frac_bw']:.2f} "
                  f"({r['copy_us']:.1f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

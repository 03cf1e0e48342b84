"""The decode GEMVs as programmatic dependent launches (`nvfp4.GEMV_PDL`, `fp8.GEMV_PDL`,
modes in `launch.PDL_MODES`) -> results/gemv_pdl.json.

For each 35B-A3B GEMV shape at M = 1 with the shipped tiles (NVFP4: qkvz, the lm_head, and
the o_proj / gate_up / down sizes; FP8: the attention and GatedDeltaNet projections), in each
mode ("off": an ordinary launch, "wait_first", "weights_first"), one run:
1. `chain`: a CUDA graph of back-to-back GEMVs over weight copies rotated past L2, as
   bench/nvfp4.py times them: each call can start under the previous call's tail.
2. `after_producer`: each GEMV right after the kernel that writes its x (one bf16 multiply of
   a source row, standing in for a decode step's RMSNorm), the pair timed in a graph, the
   producer alone too; `gemv_us` is the difference.
Fractions: of the bandwidth reference `bw` (the larger of a 1 GiB copy and a 1 GiB bf16
GEMV, bench/nvfp4.py) and of the device copy bandwidth alone (`copy_GBps`).

Usage: python bench/gemv_pdl.py  (< 90 s on an H200)
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import Recorder, rand_nvfp4, run_meta  # noqa: E402
from bench.nvfp4 import bandwidth, copies, nvfp4_bytes, time_graph  # noqa: E402
from tinyserve.core import FP8Weight  # noqa: E402
from tinyserve.kernels import fp8, nvfp4  # noqa: E402
from tinyserve.kernels.launch import PDL_MODES  # noqa: E402

NVFP4_SHAPES = {"qkvz": (8192, 2048), "lm_head": (248320, 2048), "o_4096_2048": (2048, 4096),
                "gate_up_2048_1024": (1024, 2048), "down_512_2048": (2048, 512)}
FP8_SHAPES = {"in_proj_qkv|q_proj": (8192, 2048), "in_proj_z": (4096, 2048),
              "out_proj|o_proj": (2048, 4096), "k_proj|v_proj": (512, 2048)}


def rand_fp8(n: int, k: int) -> FP8Weight:
    bits = torch.randint(0, 0x7E, (n, k), dtype=torch.uint8, device="cuda")
    bits |= torch.randint(0, 2, (n, k), dtype=torch.uint8, device="cuda") << 7
    return FP8Weight(bits, torch.ones(n, 1, device="cuda") * (0.5 / k**0.5))


def bench_shape(kind: str, n: int, k: int, bw: float, copy_bw: float) -> dict:
    module = nvfp4 if kind == "nvfp4" else fp8
    wb = nvfp4_bytes(n, k) if kind == "nvfp4" else n * k
    make = (lambda: rand_nvfp4(n, k, "cuda")) if kind == "nvfp4" else (lambda: rand_fp8(n, k))
    ws = [make() for _ in range(copies(wb, False))]
    src = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    xbuf = torch.empty_like(src)

    def gemv(w):
        if kind == "nvfp4":
            return nvfp4.nvfp4_linear(xbuf, w, path="gemv")
        return fp8.fp8_linear(xbuf, w, path="gemv")

    def produce():
        torch.mul(src, 1.0009765625, out=xbuf)

    produce()
    out: dict = {"kind": kind, "N": n, "K": k, "weight_bytes": wb}
    us_producer = time_graph([produce] * len(ws))
    out["producer_us"] = us_producer
    saved = module.GEMV_PDL
    try:
        ref = None
        for mode in PDL_MODES:
            module.GEMV_PDL = mode
            y = gemv(ws[0])
            ref = y if ref is None else ref
            chain = time_graph([lambda w=w: gemv(w) for w in ws])
            pair = time_graph([f for w in ws for f in (produce, lambda w=w: gemv(w))])
            pair *= 2  # time_graph divides by the launches: two per pair
            after = pair - us_producer
            out[mode] = {"same_bits": bool(torch.equal(y, ref)),
                         "chain_us": chain, "chain_frac_bw": wb / chain / 1e3 / bw,
                         "chain_frac_copy": wb / chain / 1e3 / copy_bw,
                         "pair_us": pair, "after_producer_us": after,
                         "after_producer_frac_bw": wb / after / 1e3 / bw,
                         "after_producer_frac_copy": wb / after / 1e3 / copy_bw}
    finally:
        module.GEMV_PDL = saved
    off = out["off"]
    for mode in PDL_MODES:
        out[mode]["chain_vs_off"] = out[mode]["chain_us"] / off["chain_us"]
        out[mode]["pair_vs_off"] = out[mode]["pair_us"] / off["pair_us"]
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 1
    rec = Recorder(ROOT / "bench/results/gemv_pdl.json", run_meta(
        "gemv_pdl", timing="median of 10 CUDA-graph replays, weights rotated past L2",
        baseline="the same GEMVs launched ordinarily (mode off), same run"))
    res = rec.run("bandwidth", bandwidth, "cuda") or {}
    bw, copy_bw = res.get("GBps", 4000.0), res.get("copy_GBps", 4000.0)
    for kind, shapes in (("nvfp4", NVFP4_SHAPES), ("fp8", FP8_SHAPES)):
        for name, (n, k) in shapes.items():
            rec.run(f"{kind}_{name}", bench_shape, kind, n, k, bw, copy_bw)
            torch.cuda.empty_cache()
    rec.save()
    print("us per GEMV: chain (back to back) | after its producer; off / wait_first / "
          "weights_first; fraction of bw and of the copy bandwidth for weights_first")
    for name, r in rec.data["cases"].items():
        if "off" not in r:
            continue
        chain = " / ".join(f"{r[m]['chain_us']:.2f}" for m in PDL_MODES)
        after = " / ".join(f"{r[m]['after_producer_us']:.2f}" for m in PDL_MODES)
        best = r["weights_first"]
        print(f"  {name:28s} {r['weight_bytes'] / 1e6:7.1f} MB  chain {chain} | after {after}"
              f" | {best['chain_frac_bw']:.2f} bw, {best['chain_frac_copy']:.2f} copy; "
              f"same bits {all(r[m]['same_bits'] for m in PDL_MODES)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

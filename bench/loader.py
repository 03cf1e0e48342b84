"""Checkpoint loading speed at Qwen3.5-35B-A3B shapes (a few layers), and quantizer speed.

A synthetic ModelOpt MIXED_PRECISION checkpoint (`testing.fullsize`: the layout of
nvidia/Qwen3.6-35B-A3B-NVFP4, random weights, real shapes, `--layers` layers, 1 GiB shards) is
written to a temporary directory. Then:

- plan: headers + plan_weights (no tensor data) for the whole checkpoint;
- load_cpu / load_cuda: `iter_weights` into CPU memory / onto the GPU, GB/s of checkpoint bytes;
- baseline: `safetensors.torch.load_file` of every shard (CPU and CUDA) in the same run, same
  page-cache state (every file is read once before timing);
- quantize: `quantize_nvfp4` of one expert projection [512, 2048] on CPU (baseline) and CUDA.

Each case records its own failure and the rest go on.

    python bench/loader.py [--layers 4] [--quick]      -> bench/results/loader.json
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from common import Recorder, run_meta, sync  # noqa: E402  (bench/ is on sys.path as a script)

from tinyserve.model.config import load_config  # noqa: E402
from tinyserve.model.loader import CheckpointReader, iter_weights  # noqa: E402
from tinyserve.model.loader_plan import plan_weights  # noqa: E402
from tinyserve.testing.fullsize import write_fullsize_checkpoint  # noqa: E402

OUT = Path(__file__).resolve().parent / "results" / "loader.json"


def write_checkpoint(path: Path, layers: int) -> int:
    """`testing.fullsize` checkpoint with `layers` layers in 1 GiB shards; returns its bytes."""
    write_fullsize_checkpoint(path, layers=layers, max_shard_bytes=1 << 30)
    return sum(f.stat().st_size for f in CheckpointReader(path).files)


def _timed(fn, reps: int = 3) -> float:
    """Median seconds."""
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_plan(path: Path) -> dict:
    config = load_config(path)

    def run() -> None:
        with CheckpointReader(path) as r:
            plan_weights(r, config)

    return {"seconds": _timed(run)}


def bench_load(path: Path, nbytes: int, device: str) -> dict:
    from safetensors.torch import load_file

    config = load_config(path)
    files = CheckpointReader(path).files

    def ours() -> None:
        for _ in iter_weights(path, config, dtype=torch.bfloat16, device=device):
            pass

    def baseline() -> None:
        for f in files:
            load_file(str(f), device=device)

    base = _timed(baseline)
    mine = _timed(ours)
    return {"bytes": nbytes, "seconds": mine, "GBps": nbytes / mine / 1e9,
            "baseline_seconds": base, "baseline_GBps": nbytes / base / 1e9,
            "ratio_to_baseline": base / mine}


def bench_quantize(quick: bool) -> dict:
    from tinyserve.kernels.nvfp4_ref import quantize_nvfp4

    w = torch.randn(512, 2048)
    reps = 3 if quick else 10
    cpu = _timed(lambda: quantize_nvfp4(w), reps)
    out = {"shape": [512, 2048], "cpu_ms": cpu * 1e3, "baseline": "cpu"}
    if torch.cuda.is_available():
        wc = w.cuda()
        quantize_nvfp4(wc)
        gpu = _timed(lambda: quantize_nvfp4(wc), reps)
        a, b = quantize_nvfp4(w), quantize_nvfp4(wc)
        out.update(cuda_ms=gpu * 1e3, speedup=cpu / gpu,
                   bit_identical=bool(torch.equal(a.packed, b.packed.cpu())
                                      and torch.equal(a.block_scale, b.block_scale.cpu())
                                      and a.global_scale == b.global_scale))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="one layer, fewer repetitions")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint")
    args = ap.parse_args()
    layers = 1 if args.quick else args.layers
    meta = run_meta(
        "loader", bench="loader",
        checkpoint=f"synthetic ModelOpt MIXED_PRECISION, Qwen3.5-35B-A3B shapes, {layers} layers",
        baseline="safetensors.torch.load_file of every shard, same run, warm page cache")
    meta.setdefault("device", "cpu")
    rec = Recorder(args.out, meta)
    res, case = rec.data, rec.run

    tmp = Path(tempfile.mkdtemp(prefix="tinyserve-loader-", dir=args.dir))
    try:
        t0 = time.perf_counter()
        nbytes = write_checkpoint(tmp / "ckpt", layers)
        res["write_seconds"] = time.perf_counter() - t0
        res["checkpoint_bytes"] = nbytes
        print(f"wrote {nbytes / 1e9:.2f} GB in {res['write_seconds']:.1f} s", flush=True)
        case("plan", bench_plan, tmp / "ckpt")
        case("load_cpu", bench_load, tmp / "ckpt", nbytes, "cpu")
        if torch.cuda.is_available():
            case("load_cuda", bench_load, tmp / "ckpt", nbytes, "cuda")
    except Exception:  # noqa: BLE001
        res["errors"]["write"] = traceback.format_exc()[-3000:]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    case("quantize_expert", bench_quantize, args.quick)
    print(f"wrote {args.out}")
    return 0 if not res["errors"] else 2


if __name__ == "__main__":
    sys.exit(main())

"""Engine-level expert offload: `build_engine` with `--gpu-memory 6GiB --kv iso3` on the
full-size random Qwen3.5-35B-A3B-shaped NVFP4 checkpoint, against the all-resident engine
(no budget) measured in the same run as the baseline.

Runs unattended on one CUDA GPU (the checkpoint is written by testing.fullsize unless it is
there: ~21 GB of disk; ~20 GB of host RAM for the pinned expert store) and writes
bench/results/engine_offload.json after every case; a failing case is recorded and the rest
still run. Per case: the memory plan, build seconds, prefill / decode tok/s (engine.bench),
peak allocated and reserved GPU memory, device memory in use, expert-cache counters.

    python bench/engine_offload.py [--ckpt DIR] [--gpu-memory 6GiB] [--prompt-len 1024]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common import Recorder, run_meta  # noqa: E402  (bench/ is on sys.path as a script)

from tinyserve.engine.bench import run_bench  # noqa: E402
from tinyserve.engine.build import build_engine  # noqa: E402
from tinyserve.engine.config import EngineConfig  # noqa: E402

RESULT = ROOT / "bench" / "results" / "engine_offload.json"
MiB = 1 << 20


def _checkpoint(ckpt: Path) -> dict[str, Any]:
    written = not (ckpt / "config.json").is_file()
    if written:
        from tinyserve.testing.fullsize import write_fullsize_checkpoint

        write_fullsize_checkpoint(ckpt)
    return {"path": str(ckpt), "written": written}


def case(args: argparse.Namespace, gpu_memory: str | None) -> dict[str, Any]:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    config = EngineConfig(model=args.ckpt, kv=args.kv, gpu_memory=gpu_memory,
                          max_context=args.max_context, max_seqs=args.batch)
    engine = build_engine(config).start()
    out: dict[str, Any] = {"build_s": round(time.perf_counter() - t0, 1)}
    try:
        plan = engine.memory_plan
        out["plan"] = None if plan is None else plan.as_dict()
        if plan is not None:
            print(plan.format(), flush=True)
        out["experts"] = type(engine.runner.model.experts).__name__
        out["embed_device"] = str(engine.runner.model.embed_tokens.device)
        out["cuda_graphs"] = engine.runner.graphs is not None
        for prompt_len in args.prompt_len:
            r = run_bench(engine, prompt_len=prompt_len, gen_len=args.gen_len, batch=args.batch)
            out[f"prompt_{prompt_len}"] = r
        s = engine.stats()
        out["expert_cache"] = {"hit_rate": s.expert_cache_hit_rate, "hits": s.expert_cache_hits,
                               "misses": s.expert_cache_misses,
                               "h2d_bytes": s.expert_cache_h2d_bytes}
        free, total = torch.cuda.mem_get_info()
        out["device_used_mib"] = round((total - free) / MiB, 1)
        out["max_allocated_mib"] = round(torch.cuda.max_memory_allocated() / MiB, 1)
        out["max_reserved_mib"] = round(torch.cuda.max_memory_reserved() / MiB, 1)
    finally:
        engine.shutdown()
        del engine
        torch.cuda.set_per_process_memory_fraction(1.0)
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt", default=os.environ.get("TINYSERVE_FULLSIZE_DIR",
                                                    "/tmp/tinyserve-fullsize"))
    p.add_argument("--gpu-memory", default="6GiB")
    p.add_argument("--kv", default="iso3")
    p.add_argument("--max-context", type=int, default=131072)
    p.add_argument("--prompt-len", type=int, nargs="+", default=[1024])
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--skip-baseline", action="store_true")
    args = p.parse_args()
    rec = Recorder(RESULT, run_meta(
        "engine_offload", args=vars(args),
        baseline="resident: the same engine with no --gpu-memory (every expert on the GPU)"))
    rec.run("checkpoint", _checkpoint, Path(args.ckpt))
    rec.run(f"offload_{args.gpu_memory}", case, args, args.gpu_memory)
    if not args.skip_baseline:
        rec.run("resident", case, args, None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
